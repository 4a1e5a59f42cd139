"""--dpo.precompute_reference (glm5f/posttrain/reference.py): the stored sums equal each answer's log-probabilities
computed alone with glm5f.forward; a run with them steps as a run with the reference in memory; the file is reused
on resume and recomputed when the data changes; resume stays bitwise; LoRA refuses the flag."""

import dataclasses
import math

import pytest
import torch

import glm5f
from configs import validate
from conftest import cli
from glm5f.posttrain import reference as dpo_reference
from glm5f.ckpt import checkpoint
from glm5f.data.pairs import PairSource, read_pairs
from glm5f.train.loss import Step
from glm5f.posttrain.dpo import DPO, DPOConfig
from glm5f.core.params import flatten, map_with_path
from glm5f.parallel.layout import Layout
from test_dpo import answer_logp, pair_records, write
from train import train

METRICS = ("loss", "margin", "accuracy", "chosen", "rejected", "logps_chosen", "logps_rejected", "sft_loss",
           "grad_norm")


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> str:
    """A Transformers checkpoint of glm5-tiny other than the run's start (seed 1; the run starts from seed 0)."""
    cfg = glm5f.preset("glm5-tiny")
    path = tmp_path_factory.mktemp("ref") / "reference"
    glm5f.save_hf(path, cfg, glm5f.init_params(cfg, seed=1))
    return str(path)


def run(run_dir, data: str, reference: str, *args: str) -> list[dict]:
    return train(cli("--model.preset", "glm5-tiny", "--train.objective", "dpo", "--data.type", "preference",
                     "--data.path", data, "--dpo.reference", reference, "--dpo.sft_weight", "0.5",
                     "--data.batch_size", "2", "--data.seq_len", "40", "--train.dtype", "float64",
                     "--optim.warmup_steps", "0", "--optim.lr", "1e-2", "--optim.schedule_steps", "4",
                     "--eval.every", "0", "--checkpoint.dir", str(run_dir), *args))


def test_the_stored_sums_equal_each_answer_alone(tmp_path):
    """Each pair's (chosen, rejected) in the table: its answers' summed log-probabilities from glm5f.forward of
    each sequence alone (not packed), fp64, the pair at its own index."""
    cfg = glm5f.preset("glm5-tiny")
    reference = map_with_path(lambda p, t: t.double(), glm5f.init_params(cfg, seed=1))
    recs = pair_records(cfg.vocab_size, n=5, seed=11)
    src = PairSource(read_pairs(write(tmp_path / "p.jsonl", recs), None), batch_size=2, seq_len=48,
                     vocab_size=cfg.vocab_size, seed=0, pad_id=0)
    assert len(src.pairs) == len(recs)  # none cut
    step = Step(objective=DPO, dtype=torch.float64, settings=DPOConfig())
    lines = []
    table = dpo_reference.compute(reference, src, cfg, Layout("cpu"), step, rows=2, say=lines.append)
    assert lines[-1] == "reference log-probabilities: 5/5 pairs"
    for i, rec in enumerate(recs):
        for j, answer in enumerate(("chosen_ids", "rejected_ids")):
            ids = rec["prompt_ids"] + rec[answer]
            with torch.no_grad():
                want = answer_logp(glm5f.forward(reference, cfg, torch.tensor([ids]))[0], ids, len(rec["prompt_ids"]))
            assert abs(table[i, j].item() - want.item()) <= 1e-10, (i, answer, table[i, j].item(), want.item())


def test_the_same_steps_as_with_the_reference_in_memory_fp64(tmp_path, reference_dir):
    """4 steps (the 6 pairs in 2-pair batches: into a second epoch) of full training against --dpo.reference:
    every metric within 1e-12 of the run that keeps the reference in memory."""
    data = write(tmp_path / "pairs.jsonl", pair_records(glm5f.preset("glm5-tiny").vocab_size, n=6, seed=3))
    kept = run(tmp_path / "kept", data, reference_dir, "--train.steps", "4")
    pre = run(tmp_path / "pre", data, reference_dir, "--train.steps", "4", "--dpo.precompute_reference")
    assert abs(kept[0]["loss"] - math.log(2)) > 1e-3  # the reference is not the start
    assert kept[-1]["loss"] != kept[0]["loss"]
    for a, b in zip(kept, pre, strict=True):
        for k in METRICS:
            assert abs(a[k] - b[k]) <= 1e-12, (a["step"], k, a[k], b[k])


def test_reused_on_resume_bitwise_and_recomputed_when_the_data_changes(tmp_path, reference_dir, capsys, monkeypatch):
    vocab = glm5f.preset("glm5-tiny").vocab_size
    data = write(tmp_path / "pairs.jsonl", pair_records(vocab, n=6, seed=3))
    passes = []
    compute = dpo_reference.compute
    monkeypatch.setattr(dpo_reference, "compute", lambda *a, **k: passes.append(1) or compute(*a, **k))
    whole = run(tmp_path / "whole", data, reference_dir, "--train.steps", "4", "--dpo.precompute_reference")
    run(tmp_path / "cut", data, reference_dir, "--train.steps", "2", "--dpo.precompute_reference")
    assert len(passes) == 2
    capsys.readouterr()
    resumed = run(tmp_path / "cut", data, reference_dir, "--train.steps", "4", "--dpo.precompute_reference",
                  "--checkpoint.resume", "latest")
    out = capsys.readouterr().out
    assert len(passes) == 2 and f"reusing {tmp_path / 'cut' / dpo_reference.FILE}" in out, out
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(whole[2:], resumed, strict=True):
        assert all(a[k] == b[k] for k in METRICS), (a, b)
    final = [flatten(checkpoint.load_params(checkpoint.latest(str(tmp_path / d)))[1]) for d in ("whole", "cut")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])

    write(tmp_path / "pairs.jsonl", pair_records(vocab, n=6, seed=4))  # other pairs, the same file name
    changed = run(tmp_path / "cut", data, reference_dir, "--train.steps", "1", "--dpo.precompute_reference",
                  "--checkpoint.overwrite")
    out = capsys.readouterr().out
    assert len(passes) == 3 and "was computed from other inputs (the data file changed); computing them" in out, out
    kept = run(tmp_path / "kept", data, reference_dir, "--train.steps", "1")
    assert abs(changed[0]["loss"] - kept[0]["loss"]) <= 1e-12


@pytest.mark.parametrize("flags,message", [
    (["--train.objective", "dpo", "--data.type", "preference", "--data.path", "x.jsonl", "--lora.rank", "4"],
     "--dpo.precompute_reference with --lora.rank"),
    (["--train.objective", "lm", "--data.type", "text"], "--dpo.precompute_reference is for --train.objective dpo"),
])
def test_flags_that_cannot_work_are_refused(flags, message):
    assert any(message in e for e in validate(cli(*flags, "--dpo.precompute_reference")))


def test_the_plan_counts_no_reference_copy(capsys):
    """--plan: the reference copy of full training (the params in the compute dtype) is gone from the objective's
    row and from the peak with --dpo.precompute_reference; the table says it was precomputed."""
    import json

    from train import main

    flags = ["--train.objective", "dpo", "--data.type", "preference", "--data.path",
             "glm5f/assets/arithmetic_pairs.jsonl", "--train.dtype", "bfloat16"]
    plans = []
    for extra in ([], ["--dpo.precompute_reference"]):
        assert main(["--plan", "json", *flags, *extra]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    kept, pre = plans
    assert kept["objective_bytes"] == kept["params_bytes"] // 2  # fp32 masters, a bf16 copy
    assert pre["objective_bytes"] == 0
    planned = [p["total_bytes"] - p["runtime_bytes"] for p in plans]  # the runtime is this process's, measured
    assert planned[0] - planned[1] == kept["objective_bytes"]
    assert main(["--plan", "table", *flags, "--dpo.precompute_reference"]) == 0
    assert "objective dpo (reference precomputed)            0.000 GB" in capsys.readouterr().out


def test_a_reference_differing_only_in_token_ids_is_accepted_another_architecture_refused_by_key(tmp_path,
                                                                                                 reference_dir):
    """--dpo.reference compares what computes: a checkpoint of the same weights with other bos/eos/pad ids and
    init scale steps exactly as the original; one with another rms_norm_eps is refused naming that key."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=1)
    relabelled = tmp_path / "relabelled"
    glm5f.save_hf(relabelled, dataclasses.replace(cfg, bos_token_id=5, eos_token_id=(7, 8), pad_token_id=3,
                                                  initializer_range=0.5), params)
    data = write(tmp_path / "p.jsonl", pair_records(cfg.vocab_size, n=2, seed=12))
    expected = run(tmp_path / "a", data, reference_dir, "--train.steps", "1")
    got = run(tmp_path / "b", data, str(relabelled), "--train.steps", "1")
    assert got[0]["loss"] == expected[0]["loss"] and abs(got[0]["loss"] - math.log(2)) > 1e-3
    other = tmp_path / "other"
    glm5f.save_hf(other, dataclasses.replace(cfg, rms_norm_eps=1e-3, bos_token_id=5), params)
    with pytest.raises(ValueError, match=rf"--dpo.reference {other} is another architecture than the trained model: "
                                         rf"rms_norm_eps 0.001 \(the trained model's 1e-05\); pass"):
        run(tmp_path / "c", data, str(other), "--train.steps", "1")
    assert not (tmp_path / "c" / "checkpoints").exists()
