"""glm5f/data/rollouts.py: rollout groups become one completion per row with their rewards and the engine's
log-probabilities at the labels' positions; bad records are refused by file:line, nothing read from them."""

import json
import math

import pytest
import torch

from glm5f.data.rollouts import RolloutSource, read_groups
from glm5f.data.tokens import IGNORE_INDEX, make_tokenizer


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_rows_hold_each_completion_with_its_reward_and_logprobs(tmp_path):
    recs = [{"prompt_ids": [1, 2], "completions": [{"ids": [3, 4], "reward": 1.0, "logprobs": [-0.5, -0.25]},
                                                  {"ids": [5], "reward": 0.0}]}]
    src = RolloutSource(read_groups(write(tmp_path / "r.jsonl", recs), None), batch_size=1, seq_len=6,
                        vocab_size=8, seed=0, pad_id=0)
    b = src.next_batch()
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 0, 0], [1, 2, 5, 0, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 3, 4] + [IGNORE_INDEX] * 2,
                                    [IGNORE_INDEX, IGNORE_INDEX, 5] + [IGNORE_INDEX] * 3]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    lp = b["rollout_logprobs"]
    assert lp[0, 2:4].tolist() == [-0.5, -0.25] and torch.isnan(lp[0, :2]).all() and torch.isnan(lp[1]).all()
    assert b["reward"].tolist() == [1.0, 0.0] and b["group"].tolist() == [0, 0]


def test_text_completions_end_in_eos(tmp_path):
    tok = make_tokenizer(None)
    rec = {"prompt": "hi", "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}
    g = read_groups(write(tmp_path / "r.jsonl", [rec]), tok)[0]
    assert g.completions[0].example.ids == [tok.bos_id] + tok.encode("hi") + tok.encode("a") + [tok.eos_id]


@pytest.mark.parametrize("completions,message", [
    ([{"ids": [3], "reward": 1.0}], "at least 2 completions"),
    ([{"ids": [3], "reward": float("nan")}, {"ids": [4], "reward": 0}], "finite number"),
    ([{"ids": [3], "reward": "1"}, {"ids": [4], "reward": 0}], "finite number"),
    ([{"ids": [3, 4], "reward": 1, "logprobs": [-1.0]}, {"ids": [4], "reward": 0}], "1 logprobs for 2"),
    ([{"ids": [3], "reward": 1, "logprobs": [0.5]}, {"ids": [4], "reward": 0}], "log-probabilities"),
    ([{"reward": 1}, {"ids": [4], "reward": 0}], "needs one of 'text'"),
])
def test_bad_groups_are_named_by_file_and_line(tmp_path, completions, message):
    good = {"prompt_ids": [1], "completions": [{"ids": [2], "reward": 0}, {"ids": [3], "reward": 1}]}
    path = write(tmp_path / "r.jsonl", [good, {"prompt_ids": [1], "completions": completions}])
    with pytest.raises(ValueError, match=message) as e:
        read_groups(path, None)
    assert f"{path}:2" in str(e.value)


def test_groups_of_another_size_are_refused(tmp_path):
    two = {"prompt_ids": [1], "completions": [{"ids": [2], "reward": 0}, {"ids": [3], "reward": 1}]}
    three = {"prompt_ids": [1], "completions": [{"ids": [2], "reward": 0}] * 3}
    with pytest.raises(ValueError, match="same size"):
        read_groups(write(tmp_path / "r.jsonl", [two, three]), None)


def test_resume_serves_the_same_groups(tmp_path):
    recs = [{"prompt_ids": [i], "completions": [{"ids": [i + 1], "reward": i}, {"ids": [i + 2], "reward": 0}]}
            for i in range(5)]
    groups = read_groups(write(tmp_path / "r.jsonl", recs), None)
    a = RolloutSource(groups, 2, 4, 16, seed=3, pad_id=0)
    a.next_batch()
    b = RolloutSource(groups, 2, 4, 16, seed=3, pad_id=0)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["reward"], y["reward"])
    assert not math.isnan(float(x["reward"].sum()))


@pytest.mark.parametrize("routing,message", [
    (lambda M, K, E, n: [[[0] * K] * M] * (n - 2), "positions, expected"),
    (lambda M, K, E, n: [[[0] * (K + 1)] * M] * (n - 1), "must be"),
    (lambda M, K, E, n: [[[E] + [0] * (K - 1)] * M] * (n - 1), "expert id"),
    (lambda M, K, E, n: "experts", "must be a list"),
])
def test_routing_records_of_the_wrong_shape_or_ids_are_refused(tmp_path, routing, message):
    import glm5f
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset("glm5-tiny")
    (M, K), E = replay_shapes(cfg)["routing"], cfg.n_routed_experts
    ids = [1, 2, 3]
    bad = {"ids": [4, 5], "reward": 1, "routing": routing(M, K, E, len(ids) + 2)}
    rec = {"prompt_ids": ids, "completions": [{"ids": [4], "reward": 0}, bad]}
    path = write(tmp_path / "r.jsonl", [rec])
    with pytest.raises(ValueError, match=message) as e:
        read_groups(path, None, cfg=cfg)
    assert str(e.value).startswith(f"{path}:1: completion 1")


def test_routing_records_become_the_batch_key_minus_one_where_none(tmp_path):
    import glm5f
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset("glm5-tiny")
    M, K = replay_shapes(cfg)["routing"]
    routed = [[[(p + m + k) % cfg.n_routed_experts for k in range(K)] for m in range(M)] for p in range(3)]
    rec = {"prompt_ids": [1, 2], "completions": [{"ids": [3, 4], "reward": 1, "routing": routed},
                                                 {"ids": [5], "reward": 0}]}
    src = RolloutSource(read_groups(write(tmp_path / "r.jsonl", [rec]), None, cfg=cfg), batch_size=1, seq_len=6,
                        vocab_size=cfg.vocab_size, seed=0, pad_id=0)
    b = src.next_batch()
    assert b["routing"].shape == (2, 6, M, K)
    assert b["routing"][0, :3].tolist() == routed and (b["routing"][0, 3:] == -1).all() and (b["routing"][1] == -1).all()
