"""GRPO on tree rows (--data.share_prefixes true: each group's prompt computed once, glm5f/data/rollout_trees.py): 3
fp64 steps (2 updates a batch, a KL term, routing replayed on half the groups) equal the unshared run's metrics and
final weights, GLM-5 and GLM-5.3, full and LoRA; the step-1 loss equals the formula over Transformers' log-probs."""

import json
import math

import pytest
import torch

import glm5f
from conftest import cli
from glm5f.ckpt.checkpoint import latest, load_params
from glm5f.core import IGNORE_INDEX
from glm5f.core.params import flatten
from glm5f.core.replay import replay_shapes
from glm5f.data.rollout_trees import tree_rows
from glm5f.data.rollouts import Completion, Group, rollout_batch
from glm5f.data.tokens import Example
from test_grpo import completion_logp, formula, grpo_flags, setup  # noqa: F401  (setup: test_grpo's fixture)
from train import train

TOL = 1e-10
METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "advantage_abs", "completion_length",
           "clip_fraction", "tis_capped_fraction", "rollout_logprob_gap", "rollout_logprob_gap_max", "kl",
           "rollout_logprob_masked_fraction", "grad_norm", "tokens_unshared")


def records(cfg) -> list[dict]:
    """4 groups of 3 token-id completions with the engine's log-probabilities. Group 1 replays routing that agrees
    over its prompt (shared), group 3 routing drawn per completion (its prompt laid out unshared); group 2 does not
    fit a row of 32 with its prompt once (split over two rows)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(2, cfg.vocab_size, (k,), generator=g).tolist()  # noqa: E731
    M, K = replay_shapes(cfg)["routing"]
    experts = lambda: [torch.randperm(cfg.n_routed_experts, generator=g)[:K].tolist() for _ in range(M)]  # noqa: E731
    out = []
    for i, (p, lengths) in enumerate([(12, (3, 5, 4)), (14, (6, 2, 3)), (16, (8, 7, 9)), (10, (4, 6, 2))]):
        prompt = ids(p)
        shared = [experts() for _ in range(p)]
        comps = []
        for j, n in enumerate(lengths):
            c = {"ids": ids(n), "reward": float((j * (i + 2)) % 3 + j / 5),
                 "logprobs": (-torch.rand(n, generator=g, dtype=torch.float64) * 6).tolist()}
            if i == 1:
                c["routing"] = shared + [experts() for _ in range(n - 1)]
            elif i == 3:
                c["routing"] = [experts() for _ in range(p + n - 1)]
            comps.append(c)
        out.append({"prompt_ids": prompt, "completions": comps})
    return out


def run(tmp_path, name: str, share: bool, *flags) -> tuple[list[dict], dict]:
    data = tmp_path / "rollouts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(glm5f.preset(name))))
    run_dir = tmp_path / f"run-{share}"
    recs = train(cli("--model.preset", name, "--train.objective", "grpo", "--data.type", "rollouts",
                     "--data.path", str(data), "--data.batch_size", "4", "--data.seq_len", "32",
                     "--data.share_prefixes", str(share), "--train.steps", "3", "--train.dtype", "float64",
                     "--optim.warmup_steps", "0", "--optim.lr", "3e-2", "--eval.every", "0",
                     "--rl.updates_per_batch", "2", "--rl.kl_beta", "0.1", "--rl.replay", "routing",
                     "--checkpoint.every", "3", "--checkpoint.dir", str(run_dir), *flags))
    return recs, flatten(load_params(latest(str(run_dir)))[1])


@pytest.mark.parametrize("name,flags", [
    ("glm5-tiny", ("--model.index_topk", "8")),  # sparse DSA over the tree's visible keys
    ("glm5-tiny", ("--lora.rank", "4", "--rl.loss", "grpo", "--train.grad_accum", "2")),  # LoRA; each completion's
    # token mean; micro-batches cut the tree rows and the unshared rows apart
    ("glm53-tiny", ()),
], ids=["glm5-top8", "glm5-lora", "glm53"])
def test_three_steps_and_weights_equal_unshared(tmp_path, name, flags):
    (shared, w_shared), (unshared, w_unshared) = run(tmp_path, name, True, *flags), run(tmp_path, name, False, *flags)
    assert len(shared) == len(unshared) == 3
    for a, b in zip(shared, unshared):
        for k in METRICS:
            assert abs(a[k] - b[k]) <= TOL, (k, a[k], b[k])
        assert b["tokens_computed"] == b["tokens_unshared"] and a["tokens_computed"] < a["tokens_unshared"]
        assert a["prefixes_unshared_replay"] == 1 and a["prefixes_unshared_mixed"] == 0  # group 3's prompt
    assert shared[1]["clip_fraction"] > 0 and shared[2]["loss"] != shared[0]["loss"]  # the second update clips
    assert w_shared.keys() == w_unshared.keys()
    for k, v in w_shared.items():
        assert (v - w_unshared[k]).abs().max() <= TOL, k


def test_step_one_loss_equals_the_formula_with_transformers_fp64(setup):  # noqa: F811
    tmp, policy, recs, data = setup
    records = train(cli(*grpo_flags(tmp, data, "run_tree", "--train.steps", "1", "--data.share_prefixes", "True")))
    own = lambda rec, c: completion_logp(policy, rec, c)  # noqa: E731
    expected = formula(recs, own, own)
    assert abs(records[0]["loss"] - expected["loss"]) <= 1e-8, (records[0]["loss"], expected)
    assert abs(records[0]["tis_capped_fraction"] - expected["tis_capped_fraction"]) <= 1e-12
    assert records[0]["tokens_computed"] < records[0]["tokens_unshared"]


def test_tree_rows_by_hand():
    """A group sharing a 3-token prompt split over two rows of 8, a mixed group (one completion replays routing)
    laid out unshared: ids, positions, predecessors, reach, valid counts, slots."""
    def comp(prompt, answer, reward, routing=None):
        replay = {} if routing is None else {"routing": torch.tensor(routing).view(-1, 1, 1)}
        return Completion(Example(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer), reward, None, replay)
    groups = [Group((comp([5, 6, 7], [8, 9], 1.0), comp([5, 6, 7], [4], 0.0), comp([5, 6, 7], [3, 2, 1], 2.0)), "a",
                    {}),
              Group((comp([5, 6], [9], 1.0, [1, 2]), comp([5, 6], [7], 3.0)), "b", {})]
    b = tree_rows(rollout_batch(groups, 8, 0), 8, 0, ("routing",))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 0, 0], [5, 6, 7, 3, 2, 1, 0, 0], [5, 6, 9, 0, 0, 0, 0, 0],
                                       [5, 6, 7, 0, 0, 0, 0, 0]]
    assert b["position_ids"].tolist()[0] == [0, 1, 2, 3, 4, 3, 0, 1]
    assert b["tree_prev"].tolist()[0] == [-1, 0, 1, 2, 3, 2, -1, 6]
    assert b["tree_reach"].tolist()[0] == [5, 5, 5, 4, 4, 5, 7, 7]
    assert b["valid"].tolist() == [[2, 2, 2, 1, 1, 1, 0, 0], [1] * 6 + [0, 0], [1] * 3 + [0] * 5, [1] * 3 + [0] * 5]
    assert b["completion_slot"].tolist()[0] == [-1, -1, -1, 0, 0, 1, -1, -1]
    assert b["labels"].tolist()[0] == [IGNORE_INDEX] * 3 + [8, 9, 4, IGNORE_INDEX, IGNORE_INDEX]
    assert b["reward"].tolist() == [[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [3.0, 0.0]]
    assert b["group"].tolist() == [[0, 0], [0, -1], [1, -1], [1, -1]]
    assert b["routing"][2, :2, 0, 0].tolist() == [1, 2] and bool((b["routing"][3] == -1).all())
    assert b["tokens_computed"].tolist() == [6, 6, 3, 3] and b["tokens_unshared"].tolist() == [9, 6, 3, 3]
    assert b["prefixes_unshared_mixed"].tolist() == [0, 0, 1, 0] and int(b["prefixes_unshared_replay"].sum()) == 0
    assert math.isnan(b["rollout_logprobs"][0, 0])
    indexed = [Group(tuple(Completion(c.example, c.reward, None, {"indexer": torch.zeros(len(c.example.ids) - 1, 1,
                                                                                     1, dtype=torch.long)})
                           for c in g.completions), g.where, {}) for g in groups]
    kept = tree_rows(rollout_batch(indexed, 8, 0), 8, 0, ("indexer",))  # key positions of unshared sequences
    assert "tree_prev" not in kept and kept["prefixes_unshared_indexer"].tolist() == [1, 0, 0, 1, 0]


def test_sampled_prompts_on_trees_equal_unshared(tmp_path):
    """--data.type prompts: each batch sampled by the policy, then laid out as trees (GRPOFeed): 2 fp64 steps, 2
    updates a batch, equal the unshared run's."""
    from test_sampler import run_flags

    def go(share: bool) -> list[dict]:
        return train(cli(*run_flags(tmp_path, f"prompts-{share}", "glm5f.posttrain.rewards:lowercase_share",
                                    "--train.steps", "2", "--train.dtype", "float64", "--rl.updates_per_batch", "2",
                                    "--data.share_prefixes", str(share))))
    shared, unshared = go(True), go(False)
    for a, b in zip(shared, unshared):
        for k in METRICS:
            assert abs(a[k] - b[k]) <= TOL, (k, a[k], b[k])
        assert a["tokens_computed"] < a["tokens_unshared"] == b["tokens_computed"]
