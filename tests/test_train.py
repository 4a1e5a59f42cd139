"""train.py's loop end to end: learning, bitwise resume (RNG states included), non-finite steps, warnings, export,
held-out evaluation, the objectives it logs, and the resumes it refuses."""

import errno
import json
import math
import os
import random
import sys

import pytest
import torch

import glm5f
from configs import with_data_type
from conftest import RUN_64, cli, write_records
from glm5f.ckpt import checkpoint
from glm5f.data import make_eval_source, make_source
from glm5f.run.metrics import read_metrics
from glm5f.train.optim import adamw_init, trained_paths
from test_metrics import check_loss_png
from train import TrainingError, main, train

MOE = ["--model.preset", "glm5-scaled-moe", "--data.batch_size", "4", "--data.seq_len", "80",
       "--train.grad_accum", "2", "--checkpoint.every", "5"]
EVAL_TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--eval.batches", "2"]


def write_jsonl(path, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(str(int(x)) for x in torch.randint(0, 50, (int(torch.randint(5, 60, (1,), generator=g)),),
                                                                generator=g))
            rec = {"text": words} if i % 2 else {"prompt": f"count {i}:", "response": words}
            f.write(json.dumps(rec) + "\n")


def test_default_run_learns(tmp_path):
    recs = train(cli("--train.steps", "40", "--checkpoint.dir", str(tmp_path)))
    assert len(recs) == 40
    assert sum(r["loss"] for r in recs[-5:]) / 5 < recs[0]["loss"] - 1.5
    logged = read_metrics(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, 41))
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= logged[0].keys()
    check_loss_png(tmp_path / "loss.png", ["#1f77b4"])  # the training curve, falling
    assert checkpoint.latest(str(tmp_path)).endswith("step_00000040")


def test_without_matplotlib_one_line_says_why_there_is_no_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(TINY + ["--train.steps", "2", "--optim.warmup_steps", "2", "--checkpoint.dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "loss curve" in line] == [
        "no loss curve: matplotlib is not installed (pip install matplotlib)"]
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("data", ["synthetic", pytest.param("json_file", marks=pytest.mark.slow)])
def test_bitwise_resume(tmp_path, data):
    args = MOE + ["--model.preset", "glm5-tiny", "--data.type", data]  # the smallest preset with experts
    if data == "json_file":
        write_jsonl(tmp_path / "d.jsonl")
        args += ["--data.path", str(tmp_path / "d.jsonl")]
    straight = train(cli(*args, "--train.steps", "20", "--checkpoint.dir", str(tmp_path / "straight")))
    train(cli(*args, "--train.steps", "10", "--checkpoint.dir", str(tmp_path / "resumed")))
    train(cli(*args, "--train.steps", "20", "--checkpoint.dir", str(tmp_path / "resumed"),
              "--checkpoint.resume", "latest"))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight]


def test_resume_restores_the_rng_states_of_an_uninterrupted_run(tmp_path, monkeypatch):
    """A resumed run's torch and Python RNG states are an uninterrupted run's at the same step: what each step draws
    from them (as dropout would: a spy around step_grads draws from both) and the batches it trains on are the
    same, and so are the RNG states its checkpoints hold, though the resuming process starts from other states."""
    import glm5f.train.step as step_mod
    real, seen = step_mod.step_grads, []

    def drawing_step(params, batch, *args):
        seen.append((batch["input_ids"].clone(), torch.rand(4), random.random()))
        return real(params, batch, *args)
    monkeypatch.setattr(step_mod, "step_grads", drawing_step)
    write_jsonl(tmp_path / "d.jsonl")
    args = ["--data.type", "json_file", "--data.path", str(tmp_path / "d.jsonl"), "--data.batch_size", "2",
            "--data.seq_len", "32", "--eval.every", "0", "--checkpoint.every", "1", "--checkpoint.keep", "0"]
    random.seed(0)
    train(cli(*args, "--train.steps", "4", "--checkpoint.dir", str(tmp_path / "straight")))
    straight = seen[:]
    seen.clear()
    random.seed(0)
    train(cli(*args, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "resumed")))
    torch.manual_seed(1)  # a new process: other RNG states
    random.seed(1)
    train(cli(*args, "--train.steps", "4", "--checkpoint.dir", str(tmp_path / "resumed"), "--checkpoint.resume",
              "latest"))
    assert len(straight) == len(seen) == 4
    for step, ((ids, drawn, py), (ids2, drawn2, py2)) in enumerate(zip(straight, seen), 1):
        assert torch.equal(ids, ids2), f"step {step}: another batch than the uninterrupted run's"
        assert torch.equal(drawn, drawn2), f"step {step}: torch drew {drawn2.tolist()}, not {drawn.tolist()}"
        assert py == py2, f"step {step}: random drew {py2}, not {py}"
    assert not torch.equal(straight[2][1], straight[0][1])  # the draws do move the state
    for step in (2, 3, 4):
        a, b = (torch.load(tmp_path / run / "checkpoints" / f"step_{step:08d}" / "extra.pt", weights_only=True)["rng"]
                for run in ("straight", "resumed"))
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"], f"step {step}"


def test_grad_accumulation_does_not_change_the_step(tmp_path):
    base = ["--model.preset", "glm5-scaled-moe", "--data.type", "synthetic", "--data.batch_size", "4",
            "--data.seq_len", "80", "--train.steps", "3"]
    one = train(cli(*base, "--checkpoint.dir", str(tmp_path / "a")))
    four = train(cli(*base, "--train.grad_accum", "4", "--checkpoint.dir", str(tmp_path / "b")))
    for a, b in zip(one, four):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4


def test_activation_checkpointing_and_bf16(tmp_path):
    base = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "4", "--data.seq_len",
            "48", "--train.steps", "3"]
    plain = train(cli(*base, "--checkpoint.dir", str(tmp_path / "a")))
    remat = train(cli(*base, "--train.activation_checkpointing", "--checkpoint.dir", str(tmp_path / "b")))
    assert [r["loss"] for r in plain] == [r["loss"] for r in remat]
    assert [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in remat]
    bf16 = train(cli(*base, "--train.dtype", "bfloat16", "--checkpoint.dir", str(tmp_path / "c")))
    assert all(abs(a["loss"] - b["loss"]) < 0.05 for a, b in zip(plain, bf16))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    args = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len",
            "32", "--train.steps", "6", "--checkpoint.every", "1", "--optim.lr", "1e30", "--optim.warmup_steps", "0",
            "--checkpoint.dir", str(tmp_path)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert any(f"the {what} is {v}" in err for what in ("loss", "grad norm") for v in ("nan", "inf"))
    step = int(err.split("step ")[1].split(":")[0])
    assert f"step_{step - 1:08d}" in err
    assert checkpoint.latest(str(tmp_path)).endswith(f"step_{step - 1:08d}")
    assert not any(n.startswith(".tmp") for n in os.listdir(tmp_path / "checkpoints"))


TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32"]


def nan_grad_norm_at(monkeypatch, bad_step):
    """Make clip_by_global_norm report a NaN norm (with a finite loss) on the bad_step-th call."""
    import glm5f.train.step as step_mod
    real, calls = step_mod.clip_by_global_norm, []

    def clip(grads, max_norm):
        calls.append(1)
        grads, norm = real(grads, max_norm)
        return grads, torch.full_like(norm, float("nan")) if len(calls) == bad_step else norm
    monkeypatch.setattr(step_mod, "clip_by_global_norm", clip)


def test_nan_grad_norm_with_finite_loss_stops_before_the_update(tmp_path, capsys, monkeypatch):
    nan_grad_norm_at(monkeypatch, 3)
    assert main(TINY + ["--train.steps", "6", "--checkpoint.every", "1", "--checkpoint.keep", "1",
                        "--checkpoint.dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: step 3: the grad norm is nan; stopping before the update" in err
    assert f"The last good checkpoint is {tmp_path / 'checkpoints' / 'step_00000002'}" in err
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000002"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    cfg = glm5f.preset("glm5-tiny")
    state = {"params": glm5f.init_params(cfg), "optim": adamw_init(glm5f.init_params(cfg))}
    assert checkpoint.load(checkpoint.latest(str(tmp_path)), state)["step"] == 2
    assert all(torch.isfinite(t).all() for t in glm5f.flatten(state["params"]).values())


def test_skip_nonfinite_skips_the_update_and_goes_on(tmp_path, capsys, monkeypatch):
    nan_grad_norm_at(monkeypatch, 2)
    recs = train(cli(*TINY, "--train.steps", "4", "--train.skip_nonfinite", "--checkpoint.dir", str(tmp_path)))
    assert "step 2: the grad norm is nan; skipping this step's update" in capsys.readouterr().out
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and [r.get("skipped", False) for r in recs] == [0, 1, 0, 0]
    cfg = glm5f.preset("glm5-tiny")
    state = {"params": glm5f.init_params(cfg), "optim": adamw_init(glm5f.init_params(cfg))}
    checkpoint.load(checkpoint.latest(str(tmp_path)), state)
    assert int(state["optim"]["count"]) == 3  # three updates of four steps


def test_nonfinite_params_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    import dataclasses

    import glm5f.train.step as step_mod
    make, calls = step_mod.make_optimizer, []

    def with_inf_at_step_two(o, model_cfg, lora=False):
        opt = make(o, model_cfg, lora=lora)

        def update(params, *a, **k):
            calls.append(1)
            params, state = opt.update(params, *a, **k)
            if len(calls) == 2:
                params = {**params, "lm_head": {"weight": params["lm_head"]["weight"] * float("inf")}}
            return params, state
        return dataclasses.replace(opt, update=update)
    monkeypatch.setattr(step_mod, "make_optimizer", with_inf_at_step_two)
    assert main(TINY + ["--train.steps", "4", "--checkpoint.every", "1", "--checkpoint.dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: step 2: non-finite values in 1 parameter(s) (lm_head.weight); not writing a checkpoint" in err
    assert checkpoint.latest(str(tmp_path)).endswith("step_00000001")


def test_warnings_print_once_and_only_when_due(tmp_path, capsys):
    data = write_records(tmp_path / "d.jsonl", [{"prompt": "q", "response": "an answer"},
                                                 {"prompt": "q", "response": ""}, {"prompt": "q", "response": " "},
                                                 {"text": "some text"}])
    args = ["--model.preset", "glm5-tiny", "--data.type", "json_file", "--data.path", data, "--data.batch_size", "2",
            "--data.seq_len", "32", "--train.steps", "2"]
    assert main(args + ["--checkpoint.dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 2, err
    assert ("warning: --train.steps 2 ends inside the 20-step warm-up (--optim.warmup_steps): the learning rate peaks "
            "at 3.00e-04, not --optim.lr 3.00e-03\n") in err
    assert (f"warning: 2 of 4 records have an empty response (the first at {data}:2); each trains only on its "
            f"end-of-sequence token\n") in err
    clean = write_records(tmp_path / "clean.jsonl", [{"prompt": "q", "response": "a"}, {"text": "some text"}])
    assert main(args + ["--data.path", clean, "--optim.warmup_steps", "2",
                        "--checkpoint.dir", str(tmp_path / "b")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_export_hf_refuses_foreign_directories_before_training(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("years of work")
    with pytest.raises(TrainingError, match=r"holds files that are not a previous glm5f export \(thesis.txt\)"):
        train(cli(*TINY, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r"),
                  "--checkpoint.export_hf", str(foreign)))
    assert (foreign / "thesis.txt").read_text() == "years of work" and os.listdir(foreign) == ["thesis.txt"]
    assert not (tmp_path / "r").exists()  # refused before training
    for target in (tmp_path / "r", tmp_path):
        with pytest.raises(TrainingError, match="is or contains the run directory"):
            train(cli(*TINY, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r"),
                      "--checkpoint.export_hf", str(target)))
    assert sorted(os.listdir(tmp_path)) == ["notes"]


def test_export_hf_replaces_its_own_export_and_exports_a_finished_run(tmp_path):
    run, hf = str(tmp_path / "r"), tmp_path / "hf"
    hf.mkdir()  # empty is fine
    train(cli(*TINY, "--train.steps", "2", "--checkpoint.dir", run, "--checkpoint.export_hf", str(hf)))
    first = (hf / "model.safetensors").read_bytes()
    train(cli(*TINY, "--train.steps", "4", "--checkpoint.dir", run, "--checkpoint.resume", "latest",
              "--checkpoint.export_hf", str(hf)))  # a previous export: replaced
    assert (hf / "model.safetensors").read_bytes() != first
    again = tmp_path / "again"
    train(cli(*TINY, "--train.steps", "4", "--checkpoint.dir", run, "--checkpoint.resume", "latest",
              "--checkpoint.export_hf", str(again)))  # nothing to train, still exported
    assert (again / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert not any(".tmp-" in n or ".old-" in n for n in os.listdir(tmp_path))


def test_resume_under_another_data_type_is_refused(tmp_path, capsys):
    run = str(tmp_path)
    assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", run]) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    assert main(TINY[:4] + ["--data.type", "text", "--train.steps", "4", "--checkpoint.dir", run,
                            "--checkpoint.resume", "latest"]) == 1
    err = capsys.readouterr().err
    assert (f"error: {tmp_path / 'checkpoints' / 'step_00000002'} was saved by a run on --data.type synthetic, not "
            f"text: resume it with --data.type synthetic") in err
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_resume_training_another_set_of_leaves_is_refused(tmp_path, capsys):
    """The indexer warm-up (--train.trainable indexer) saves optimizer state for the indexer alone: resuming it
    with everything trained would find no moments for the rest; it says so and names the way on (export, then
    --model.init_from). The same trained set with another indexer loss mode resumes."""
    run = str(tmp_path)
    warm_up = ["--train.trainable", "indexer", "--train.indexer_loss", "dense"]
    assert main(TINY + warm_up + ["--train.steps", "2", "--checkpoint.dir", run]) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    assert main(TINY + ["--train.steps", "3", "--checkpoint.dir", run, "--checkpoint.resume", "latest"]) == 1
    err = capsys.readouterr().err
    assert (f"error: {tmp_path / 'checkpoints' / 'step_00000002'} was saved by a run that trained 10 leaves "
            f"(--train.trainable 'indexer', --train.indexer_loss dense); this run trains ") in err
    assert "--model.init_from DIR" in err and (tmp_path / "metrics.jsonl").read_text() == before
    assert main(TINY + ["--train.trainable", "indexer", "--train.indexer_loss", "sparse", "--train.steps", "3",
                        "--checkpoint.dir", run, "--checkpoint.resume", "latest"]) == 0


def test_a_run_failing_before_its_first_step_writes_nothing(tmp_path, monkeypatch):
    import glm5f.train.step as step_mod
    monkeypatch.setattr(step_mod, "step_grads", lambda *a: (_ for _ in ()).throw(TrainingError("boom")))
    with pytest.raises(TrainingError, match="boom"):
        train(cli(*TINY, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()  # no empty metrics.jsonl


def test_indexer_warmup_trains_only_the_indexer(tmp_path):
    """The warm-up (`--train.trainable indexer --train.indexer_loss dense`) on the embedded text, from weights wide
    enough that the frozen model's attention is not near-uniform (as a trained model's is not)."""
    recs = train(cli("--train.trainable", "indexer", "--train.indexer_loss", "dense", "--train.steps", "20",
                     "--model.initializer_range", "0.2", "--data.batch_size", "4", "--data.seq_len", "64",
                     "--optim.warmup_steps", "2", "--optim.lr", "1e-2", "--eval.every", "0",
                     "--checkpoint.dir", str(tmp_path)))
    first, last = recs[:3], recs[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "indexer_loss") < 0.8 * mean(first, "indexer_loss")
    assert mean(last, "indexer_recall") > mean(first, "indexer_recall") + 0.02
    assert len({r["loss"] for r in recs}) > 1  # the data changes, the LM loss is still reported
    model_cfg = glm5f.preset("glm5-tiny", initializer_range=0.2)
    init = glm5f.init_params(model_cfg)
    trained = trained_paths(init, "indexer", indexer=True)
    state = {"params": glm5f.init_params(model_cfg, seed=1), "optim": adamw_init(init, trained)}
    checkpoint.load(checkpoint.latest(str(tmp_path)), state)
    final = glm5f.flatten(state["params"])
    for k, t in glm5f.flatten(init).items():
        if k in trained:
            assert not torch.equal(final[k], t), k
        else:
            assert torch.equal(final[k], t), k  # including the routers' e_score_correction_bias


def test_train_cli_writes_mtp_loss(tmp_path):
    assert main(["--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "3", "--eval.every", "0",
                 "--model.num_nextn_predict_layers", "1", "--checkpoint.dir", str(tmp_path / "a")]) == 0
    history = read_metrics(str(tmp_path / "a"))
    assert len(history) == 3 and all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in history)


def independent_eval_loss(params, cfg, batches) -> float:
    total, count = 0.0, 0
    for b in batches:
        logits = glm5f.forward(params, cfg, b["input_ids"], position_ids=b["position_ids"])
        s, n = glm5f.cross_entropy_sum(logits, glm5f.shift_labels(b["labels"]))
        total, count = total + float(s), count + int(n)
    return total / count


def test_eval_loss_is_the_loss_of_the_params_on_the_held_out_batches(tmp_path, capsys):
    recs = train(cli(*EVAL_TINY, "--train.steps", "3", "--eval.every", "2", "--checkpoint.dir", str(tmp_path)))
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 3]  # every 2 steps and at the end
    assert "eval_loss" in capsys.readouterr().out
    logged = read_metrics(tmp_path)[-1]
    cfg, params = checkpoint.load_params(checkpoint.latest(str(tmp_path)))
    src = make_eval_source("text", vocab_size=cfg.vocab_size, batch_size=2, seq_len=32)
    batches = [src.next_batch() for _ in range(2)]
    want = independent_eval_loss(params, cfg, batches)
    assert logged["eval_loss"] == pytest.approx(want, rel=1e-6)
    assert logged["eval_ppl"] == pytest.approx(torch.tensor(want).exp().item(), rel=1e-6)
    both = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "position_ids")}
    logits = glm5f.forward(params, cfg, both["input_ids"], position_ids=both["position_ids"])
    assert logged["eval_loss"] == pytest.approx(float(glm5f.causal_lm_loss(logits, both["labels"])), rel=1e-6)


def test_eval_from_a_file_and_errors(tmp_path, capsys):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": f"held out document number {i}"}) + "\n" for i in range(8)))
    recs = train(cli(*EVAL_TINY, "--train.steps", "1", "--eval.path", str(data), "--checkpoint.dir", str(tmp_path / "a")))
    cfg, params = checkpoint.load_params(checkpoint.latest(str(tmp_path / "a")))
    src = make_source("json_file", vocab_size=cfg.vocab_size, batch_size=2, seq_len=32, path=str(data))
    assert recs[-1]["eval_loss"] == pytest.approx(
        independent_eval_loss(params, cfg, [src.next_batch() for _ in range(2)]), rel=1e-6)
    assert main(EVAL_TINY + ["--eval.split", "test", "--checkpoint.dir", str(tmp_path / "b")]) == 1
    assert "--eval.split needs --data.type hf_datasets" in capsys.readouterr().err
    assert main(EVAL_TINY + ["--eval.path", str(tmp_path / "none.jsonl"), "--checkpoint.dir", str(tmp_path / "c")]) == 1
    assert "none.jsonl" in capsys.readouterr().err


def test_default_run_evaluates():
    cfg = with_data_type(cli())  # no --data.type and no --data.path: the embedded text
    assert cfg.data.type == "text" and 0 < cfg.eval.every <= cfg.train.steps


def test_a_full_disk_while_writing_the_run_files_is_an_error_line(tmp_path, capsys, monkeypatch):
    from glm5f.run import recipe_file
    import glm5f.run.metrics as metrics
    from glm5f.run import finish
    run = tmp_path / "run"
    args = TINY + ["--train.steps", "3", "--checkpoint.every", "1", "--checkpoint.dir", str(run)]
    write = metrics.MetricsLog.write

    def full_at_step_3(self, rec):
        if rec["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        write(self, rec)
    monkeypatch.setattr(metrics.MetricsLog, "write", full_at_step_3)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"error: could not write {run / 'metrics.jsonl'}: No space left on device (ENOSPC); free some space; the last "
        f"checkpoint is {run / 'checkpoints' / 'step_00000002'}: resume from it with --checkpoint.resume latest")
    monkeypatch.undo()

    def full(cfg):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(recipe_file, "config_yaml", full)  # config.yaml, written beside the first record
    assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "r2")]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"error: could not write {tmp_path / 'r2' / 'config.yaml'}: No space left on device (ENOSPC); free some space")
    assert sorted(os.listdir(tmp_path / "r2")) == ["metrics.jsonl"]  # no config.yaml.tmp left
    monkeypatch.undo()

    monkeypatch.setattr(finish, "plot_losses", lambda runs, png: full(None))  # the loss curve is not worth an error
    assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "r3")]) == 0
    assert (f"warning: no loss curve: could not write {tmp_path / 'r3' / 'loss.png'}: No space left on device "
            f"(ENOSPC)") in capsys.readouterr().err


def test_out_of_memory_names_the_allocation_the_step_and_what_to_change(monkeypatch, tmp_path, capsys):
    import glm5f.train.step as step_mod

    real = step_mod.step_grads

    def step_grads(*args, **kwargs):
        if len(calls := step_grads.calls) == 1:
            raise step_grads.error
        calls.append(1)
        return real(*args, **kwargs)
    step_grads.calls = []
    step_grads.error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total "
                                              "capacity of 79.11 GiB of which 1.02 GiB is free.")
    monkeypatch.setattr(step_mod, "step_grads", step_grads)
    assert main(["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64[:4], "--train.steps", "3",
                 "--checkpoint.dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 2: out of memory on cpu trying to allocate 2.50 GiB") and \
        "--train.grad_accum" in err and "--train.activation_checkpointing" in err and "--plan" in err, err
    step_grads.calls = [1]  # the CPU allocator's error
    step_grads.error = RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 3221225472 bytes.")
    assert main(["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64[:4], "--train.steps", "3",
                 "--checkpoint.dir", str(tmp_path / "cpu")]) == 1
    assert "error: step 1: out of memory on cpu trying to allocate 3.00 GiB" in capsys.readouterr().err


def test_trained_leaves_without_a_gradient_and_positions_past_the_model_are_warned(tmp_path, capsys):
    tiny = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64]
    assert main(tiny + ["--lora.rank", "2", "--lora.targets", "indexer", "--checkpoint.dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warning: 6 of the 6 trained leaves got no gradient in the first step " \
           "(model.layers.0.self_attn.indexer.wq_b, " in err, err
    assert main(tiny + ["--lora.rank", "2", "--checkpoint.dir", str(tmp_path / "b"),
                        "--model.max_position_embeddings", "32"]) == 0
    err = capsys.readouterr().err
    assert "no gradient" not in err and "--data.seq_len 64 reaches past the model's max_position_embeddings 32" in err


def test_a_preset_pt_runs_start_line_shows_the_sizes_of_its_batches(tmp_path, capsys):
    """--data.type preset_pt trains on the batches of its file, whatever --data.batch_size and --data.seq_len say:
    the start line shows their sizes (the tokens each step's metrics record counts), not the flags'."""
    path = tmp_path / "batches.pt"
    g = torch.Generator().manual_seed(0)
    torch.save([{"input_ids": torch.randint(0, 200, (4, 48), generator=g)},
                {"input_ids": torch.randint(0, 200, (2, 64), generator=g)}], path)
    assert main(["--model.preset", "glm5-tiny", "--data.path", str(path), "--data.batch_size", "16",
                 "--data.seq_len", "128", "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("glm5f:"))
    assert f"preset_pt data, 4x48 or 2x64 tokens/step (the batches of {path})," in start and "16x128" not in start
    assert [json.loads(line)["tokens"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] \
        == [4 * 48, 2 * 64]
