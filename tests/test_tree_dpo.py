"""DPO on tree rows (--data.share_prefixes true: each pair's prompt computed once, glm5f/data/pairs.py): 3 fp64 steps'
metrics equal the unshared run's, full and LoRA, GLM-5 and GLM-5.3; the tokens it computes are fewer."""

import json

import pytest
import torch

import glm5f
from conftest import cli
from glm5f.data.pairs import PairSource, Pair, shared_prompt
from glm5f.data.tokens import IGNORE_INDEX, Example
from train import train

TOL = 1e-10


def records(vocab: int, n: int = 4, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(2, vocab, (k,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(14 + 3 * i), "chosen_ids": ids(3 + 2 * i), "rejected_ids": ids(6 - i)} for i in range(n)]


def run(tmp_path, name: str, share: bool, *flags) -> list[dict]:
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records(glm5f.preset(name).vocab_size)) + "\n")
    return train(cli("--model.preset", name, "--train.objective", "dpo", "--data.type", "preference",
                     "--data.path", str(data), "--data.batch_size", "4", "--data.seq_len", "48",
                     "--data.share_prefixes", str(share), "--train.steps", "3", "--train.dtype", "float64",
                     "--optim.warmup_steps", "0", "--optim.lr", "1e-2", "--eval.every", "0",
                     "--checkpoint.dir", str(tmp_path / f"run-{share}"), *flags))


@pytest.mark.parametrize("name,flags", [
    ("glm5-tiny", ("--model.index_topk", "8")),  # sparse DSA: the prompt and answers over top-8 keys
    ("glm5-tiny", ("--lora.rank", "4")),
    ("glm5-tiny", ("--dpo.precompute_reference",)),  # the reference's pass on trees too
    ("glm53-tiny", ()),
], ids=["glm5-top8", "glm5-lora", "glm5-precomputed", "glm53"])
def test_three_steps_equal_unshared(tmp_path, name, flags):
    shared, unshared = run(tmp_path, name, True, *flags), run(tmp_path, name, False, *flags)
    assert len(shared) == len(unshared) == 3
    for a, b in zip(shared, unshared):
        for k in ("loss", "margin", "accuracy", "chosen", "rejected", "logps_chosen", "logps_rejected", "grad_norm"):
            assert abs(a[k] - b[k]) <= TOL, (k, a[k], b[k])
        assert a["tokens_unshared"] == b["tokens_unshared"] == b["tokens_computed"]
        assert a["tokens_computed"] < a["tokens_unshared"]
    assert shared[-1]["loss"] != shared[0]["loss"]  # it trains


def test_tree_row_by_hand():
    def ex(prompt, answer):
        return Example(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer)
    pair = Pair(ex([5, 6, 7], [8, 9]), ex([5, 6, 7], [4]), "x")
    assert shared_prompt(pair) == 3
    src = PairSource([pair], 1, 9, 16, 0, pad_id=0, share_prefixes=True)
    b = src.batch_of([0])
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    assert b["tree_prev"].tolist() == [[-1, 0, 1, 2, 3, 2, -1, 6, 7]]
    assert b["tree_reach"].tolist() == [[5, 5, 5, 4, 4, 5, 8, 8, 8]]
    assert b["answer"].tolist() == [[0, 0, 0, 1, 1, 2, 0, 0, 0]]
    assert b["tokens_computed"].tolist() == [6] and b["tokens_unshared"].tolist() == [9]
    assert b["valid"].tolist() == [[2, 2, 2, 1, 1, 1, 0, 0, 0]]  # the unshared row has no padding
    same = Pair(ex([5], [8, 9]), ex([5], [8, 4]), "y")  # the answers' common first token is scored: not shared
    assert shared_prompt(same) == 1
