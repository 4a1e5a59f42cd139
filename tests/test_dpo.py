"""glm5f/posttrain/dpo.py: DPO's step-1 loss equals the formula over Transformers' fp64 log-probabilities with a reference
that differs from the policy; its gradients equal torch.func.grad of the formula over glm5f.forward in fp64; a LoRA
run starts at ln 2 (the base is its reference); the flags that cannot work are refused."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import glm5f
from configs import validate
from conftest import cli, hf_model_fp64, stable_topk, transformers_in_fp64
from glm5f.ckpt import checkpoint
from glm5f.data.pairs import PairSource, read_pairs
from glm5f.posttrain.dpo import DPO, DPOConfig
from glm5f.train.loss import Step, step_grads
from glm5f.parallel.layout import Layout
from glm5f.core.params import flatten, map_with_path, unflatten
from train import train

BETA = 0.1


def pair_records(vocab: int, n: int = 3, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(4 + i), "chosen_ids": ids(3 + 2 * i), "rejected_ids": ids(5 + i)} for i in range(n)]


def write(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def answer_logp(logits_SxV: torch.Tensor, ids: list[int], prompt: int) -> torch.Tensor:
    """The summed log-probability of ids[prompt:] given what precedes each, from one sequence's logits."""
    lp = torch.log_softmax(logits_SxV[:-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[prompt - 1:].sum()


def formula(logp) -> torch.Tensor:
    """The mean DPO loss over pairs, logp(model, record, "chosen_ids" | "rejected_ids") each answer's sum."""
    def loss(recs, pi, ref):
        terms = [-F.logsigmoid(BETA * ((pi(r, "chosen_ids") - ref(r, "chosen_ids"))
                                       - (pi(r, "rejected_ids") - ref(r, "rejected_ids")))) for r in recs]
        return torch.stack(terms).mean()
    return loss


def test_step_one_loss_equals_the_formula_with_transformers_fp64(tmp_path):
    cfg = glm5f.preset("glm5-tiny")
    with transformers_in_fp64():
        policy, reference = hf_model_fp64(cfg, seed=0), hf_model_fp64(cfg, seed=1)
    policy.float().save_pretrained(tmp_path / "policy")
    reference.float().save_pretrained(tmp_path / "reference")
    policy.double(), reference.double()
    recs = pair_records(cfg.vocab_size)
    data = write(tmp_path / "pairs.jsonl", recs)
    records = train(cli("--model.init_from", str(tmp_path / "policy"), "--dpo.reference", str(tmp_path / "reference"),
                        "--train.objective", "dpo", "--data.type", "preference", "--data.path", data,
                        "--data.batch_size", "3", "--data.seq_len", "40", "--train.steps", "1",
                        "--train.dtype", "float64", "--eval.every", "0", "--checkpoint.dir", str(tmp_path / "run")))

    def logp(model):
        def f(rec, answer):
            ids = rec["prompt_ids"] + rec[answer]
            with torch.no_grad(), transformers_in_fp64(), stable_topk():
                logits = model(torch.tensor([ids])).logits[0]
            return answer_logp(logits, ids, len(rec["prompt_ids"]))
        return f
    expected = formula(None)(recs, logp(policy), logp(reference)).item()
    assert abs(records[0]["loss"] - expected) <= 1e-8, (records[0]["loss"], expected)
    assert abs(expected - math.log(2)) > 1e-3  # the reference differs from the policy
    assert 0 <= records[0]["accuracy"] <= 1


def test_gradients_equal_torch_func_grad_of_the_formula_fp64(tmp_path):
    cfg = glm5f.preset("glm5-tiny")
    wide = lambda p: map_with_path(lambda path, t: t.double(), p)  # noqa: E731
    params, reference = wide(glm5f.init_params(cfg, seed=2)), wide(glm5f.init_params(cfg, seed=3))
    recs = pair_records(cfg.vocab_size, seed=4)
    src = PairSource(read_pairs(write(tmp_path / "p.jsonl", recs), None), batch_size=3, seq_len=40,
                     vocab_size=cfg.vocab_size, seed=0, pad_id=0)
    batch = src.next_batch()
    step = Step(objective=DPO, dtype=torch.float64, settings=DPOConfig(beta=BETA))
    metrics, grads, _ = step_grads(params, batch, cfg, Layout(torch.device("cpu")), step, reference)
    paths = sorted(grads)
    flat = flatten(params)

    def value(trained: dict) -> torch.Tensor:
        p = unflatten({**flat, **trained}, params)

        def pi(rec, answer):
            ids = rec["prompt_ids"] + rec[answer]
            return answer_logp(glm5f.forward(p, cfg, torch.tensor([ids]))[0], ids, len(rec["prompt_ids"]))

        def ref(rec, answer):
            ids = rec["prompt_ids"] + rec[answer]
            with torch.no_grad():
                return answer_logp(glm5f.forward(reference, cfg, torch.tensor([ids]))[0], ids,
                                   len(rec["prompt_ids"]))
        return formula(None)(recs, pi, ref)

    expected = torch.func.grad(value)({k: flat[k] for k in paths})
    assert abs(metrics["loss"] - value({k: flat[k] for k in paths}).item()) <= 1e-12
    worst = max(float((grads[k] - expected[k]).abs().max()) for k in paths)
    assert worst <= 1e-10, worst
    assert sum(float(expected[k].abs().max()) > 0 for k in paths) > 20  # the gradients are not trivially zero


def test_a_lora_run_starts_at_ln_2(tmp_path):
    cfg = glm5f.preset("glm5-tiny")
    data = write(tmp_path / "pairs.jsonl", pair_records(cfg.vocab_size, n=4, seed=5))
    records = train(cli("--model.preset", "glm5-tiny", "--lora.rank", "4", "--train.objective", "dpo",
                        "--data.type", "preference", "--data.path", data, "--data.batch_size", "4",
                        "--data.seq_len", "40", "--train.steps", "3", "--train.dtype", "float64",
                        "--optim.warmup_steps", "0", "--optim.lr", "1e-2", "--eval.every", "0",
                        "--checkpoint.dir", str(tmp_path / "run")))
    assert abs(records[0]["loss"] - math.log(2)) <= 1e-12
    assert records[0]["margin"] == 0 and records[0]["accuracy"] == 0
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["margin"] > 0  # the adapters learn


@pytest.mark.parametrize("flags,message", [
    (["--train.objective", "dpo", "--data.type", "text"], "trains on --data.type preference"),
    (["--train.objective", "lm", "--data.type", "preference", "--data.path", "x.jsonl"], "for --train.objective dpo"),
    (["--train.objective", "dpo", "--data.type", "preference", "--data.path", "x.jsonl", "--lora.rank", "4",
      "--dpo.reference", "r"], "a LoRA run's reference is its base"),
    (["--train.objective", "dpo", "--data.type", "preference", "--data.path", "x.jsonl", "--dpo.beta", "0"],
     "--dpo.beta must be positive"),
])
def test_flags_that_cannot_work_are_refused(flags, message):
    assert any(message in e for e in validate(cli(*flags)))


def test_a_pair_whose_answers_are_the_same_is_left_out_of_the_loss_fp64(tmp_path):
    cfg = glm5f.preset("glm5-tiny")
    wide = lambda p: map_with_path(lambda path, t: t.double(), p)  # noqa: E731
    params, reference = wide(glm5f.init_params(cfg, seed=2)), wide(glm5f.init_params(cfg, seed=3))
    differ = pair_records(cfg.vocab_size, n=2, seed=6)
    same = {**differ[0], "rejected_ids": list(differ[0]["chosen_ids"])}
    step = Step(objective=DPO, dtype=torch.float64, settings=DPOConfig(beta=BETA))

    def run(recs):
        src = PairSource(read_pairs(write(tmp_path / "p.jsonl", recs), None), batch_size=len(recs), seq_len=40,
                         vocab_size=cfg.vocab_size, seed=0, pad_id=0)
        return step_grads(params, src.batch_of(list(range(len(recs)))), cfg, Layout(torch.device("cpu")), step,
                          reference)[:2]
    mixed, mixed_grads = run([same, *differ])
    alone, alone_grads = run(differ)  # the same pairs without the one that carries no signal
    assert abs(mixed["loss"] - alone["loss"]) <= 1e-12 and abs(alone["loss"] - math.log(2)) > 1e-3
    assert mixed["frac_identical_pairs"] == 1 / 3 and alone["frac_identical_pairs"] == 0
    assert abs(mixed["margin"] - alone["margin"]) <= 1e-12
    assert max(float((mixed_grads[k] - alone_grads[k]).abs().max()) for k in alone_grads) <= 1e-12


def test_a_step_whose_pairs_all_have_the_same_answers_skips_its_update_and_says_so(tmp_path, capsys):
    cfg = glm5f.preset("glm5-tiny")
    recs = [{**r, "rejected_ids": list(r["chosen_ids"])} for r in pair_records(cfg.vocab_size, n=4, seed=7)]
    records = train(cli("--train.objective", "dpo", "--data.type", "preference",
                        "--data.path", write(tmp_path / "same.jsonl", recs), "--data.batch_size", "4",
                        "--data.seq_len", "40", "--train.steps", "2", "--optim.warmup_steps", "0",
                        "--checkpoint.dir", str(tmp_path / "run")))
    out, err = capsys.readouterr()
    assert ("no evaluation: the held-out loss is the LM loss of held-out text, and --train.objective dpo trains on "
            "--data.type preference (pass --eval.every 0 to turn evaluation off without this line)") in out
    assert all(r.get("skipped") for r in records) and records[0]["frac_identical_pairs"] == 1
    assert "step 1: every pair's chosen answer equals its rejected one" in out and "skipping" in out
    assert "got no gradient" not in err  # a skipped step's zero gradients are no advice about --lora.targets
    _, after = checkpoint.load_params(str(tmp_path / "run" / "checkpoints" / "step_00000002"))
    before = glm5f.init_params(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(flatten(after).values(), flatten(before).values()))
