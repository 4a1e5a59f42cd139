"""The train loop: learning, bitwise resume, crash-safe checkpoints, bad input, and the optimizer functions."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import tyro

import glm5f
from configs import Config, validate
from glm5f import checkpoint
from glm5f.data import ByteTokenizer, make_source
from glm5f.metrics import read_metrics
from glm5f.optim import (adamw_init, adamw_update, balance_router_bias, clip_by_global_norm, leaf_rule, lr_schedule,
                         value_and_grad)
from train import TrainingError, main, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = ["--model.preset", "glm5-scaled-moe", "--data.batch_size", "4", "--data.seq_len", "80",
       "--train.grad_accum", "2", "--checkpoint.every", "5"]


def cli(*args: str) -> Config:
    return tyro.cli(Config, args=list(args), use_underscores=True)


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
    assert os.path.isfile(tmp_path / "loss.png")
    assert checkpoint.latest(str(tmp_path)).endswith("step_00000040")


def test_without_matplotlib_one_line_says_why_there_is_no_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(TINY + ["--train.steps", "2", "--optim.warmup_steps", "2", "--checkpoint.dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "loss curve" in line] == [
        "no loss curve: matplotlib is not installed (pip install matplotlib)"]
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("data", ["synthetic", "json_file"])
def test_bitwise_resume(tmp_path, data):
    args = MOE + ["--data.type", data]
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


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import glm5f.checkpoint as ck
    real_replace = os.replace
    def slow_replace(src, dst):
        if os.path.basename(dst) == "step_00000010":  # the second save: stop with its files half-way there
            open({marker!r}, "w").close()
            time.sleep(600)
        return real_replace(src, dst)
    ck.os.replace = slow_replace
    from train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_during_checkpoint_keeps_previous(tmp_path):
    run = tmp_path / "run"
    marker = tmp_path / "saving"
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(root=ROOT, marker=str(marker)))
    args = MOE + ["--data.type", "synthetic", "--train.steps", "12", "--checkpoint.dir", str(run)]
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, "training never reached its second checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(run / "checkpoints" / ".tmp-step_00000010")  # the half-written one
    assert checkpoint.latest(str(run)).endswith("step_00000005")
    cfg = glm5f.preset("glm5-scaled-moe")
    state = {"params": glm5f.init_params(cfg, seed=123), "optim": adamw_init(glm5f.init_params(cfg))}
    extra = checkpoint.load(checkpoint.latest(str(run)), state)
    assert extra["step"] == 5 and int(state["optim"]["count"]) == 5
    recs = train(cli(*args, "--checkpoint.resume", "latest"))
    assert recs[0]["step"] == 6 and recs[-1]["step"] == 12
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    assert not any(n.startswith(".tmp") for n in os.listdir(run / "checkpoints"))


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
    import train as train_mod
    real, calls = train_mod.clip_by_global_norm, []

    def clip(grads, max_norm):
        calls.append(1)
        grads, norm = real(grads, max_norm)
        return grads, torch.full_like(norm, float("nan")) if len(calls) == bad_step else norm
    monkeypatch.setattr(train_mod, "clip_by_global_norm", clip)


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


def test_checkpoint_save_refuses_nonfinite_and_keeps_the_newest(tmp_path):
    good = {"params": {"w": torch.ones(3)}}
    first = checkpoint.save(str(tmp_path), 1, good, extra={"step": 1}, meta={}, keep=1)
    with pytest.raises(ValueError, match="refusing to save checkpoint 2: non-finite values in params.w"):
        checkpoint.save(str(tmp_path), 2, {"params": {"w": torch.tensor([1.0, float("inf"), 0.0])}},
                        extra={"step": 2}, meta={}, keep=1)
    assert checkpoint.latest(str(tmp_path)) == first
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000001"]


def test_nonfinite_params_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    import train as train_mod
    real, calls = train_mod.adamw_update, []

    def update(params, *a, **k):
        calls.append(1)
        params, state = real(params, *a, **k)
        if len(calls) == 2:
            params = {**params, "lm_head": {"weight": params["lm_head"]["weight"] * float("inf")}}
        return params, state
    monkeypatch.setattr(train_mod, "adamw_update", update)
    assert main(TINY + ["--train.steps", "4", "--checkpoint.every", "1", "--checkpoint.dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: step 2: non-finite values in 1 parameter(s) (lm_head.weight); not writing a checkpoint" in err
    assert checkpoint.latest(str(tmp_path)).endswith("step_00000001")


def test_bad_data_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: not valid JSON"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(bad))
    assert main(["--data.type", "json_file", "--data.path", str(bad), "--checkpoint.dir", str(tmp_path / "r")]) == 1
    assert f"{bad}:3: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoints").exists()
    (tmp_path / "keys.jsonl").write_text('{"words": "no"}\n')
    with pytest.raises(ValueError, match="keys.jsonl:1: a record needs 'text'"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "keys.jsonl"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="dataset is empty"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 600]}\n')
    with pytest.raises(ValueError, match="token id 600 outside \\[0, vocab_size=512\\)"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "ids.jsonl"))
    with pytest.raises(ValueError, match="raise --model.vocab_size to at least 259"):
        make_source("text", vocab_size=100, batch_size=2, seq_len=16)
    torch.save([{"input_ids": torch.tensor([[1, 2, 999]])}], tmp_path / "b.pt")
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=512\\)"):
        make_source("preset_pt", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "b.pt"))


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


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


def test_unused_tokenizer_warns(tmp_path, capsys):
    tok = bpe_tokenizer(tmp_path)
    assert main(TINY + ["--model.tokenizer_path", tok, "--train.steps", "1", "--optim.warmup_steps", "1",
                        "--checkpoint.dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"warning: --model.tokenizer_path {tok} is not used: --data.type synthetic does not tokenize text"]
    ids = write_records(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    text = write_records(tmp_path / "text.jsonl", [{"input_ids": [1, 2, 3]}, {"text": "the cat"}])
    for kind, path, tokenizer, expected in [
            ("synthetic", None, tok, f"--model.tokenizer_path {tok} is not used: --data.type synthetic does not "
                                     f"tokenize text"),
            ("json_file", ids, tok, f"--model.tokenizer_path {tok} is not used: every record holds input_ids "
                                    f"already"),
            ("synthetic", None, None, None), ("json_file", ids, None, None), ("json_file", text, tok, None)]:
        seen = []
        make_source(kind, vocab_size=512, batch_size=1, seq_len=8, path=path, tokenizer_path=tokenizer,
                    warn=seen.append)
        assert seen == ([expected] if expected else []), (kind, path, tokenizer)


def test_invalid_run_configs_fail_before_any_work(tmp_path, capsys):
    run = tmp_path / "never"
    for args, message in [(["--train.steps", "-3"], "--train.steps must be >= 1"),
                          (["--model.preset", "glm9"], "--model.preset 'glm9' is unknown"),
                          (["--data.batch_size", "6", "--train.grad_accum", "4"], "must divide by"),
                          (["--model.n_group", "3"], "divisible by n_group"),
                          (["--data.type", "json_file"], "needs --data.path"),
                          (["--train.dtype", "float64", "--train.reduce_dtype", "float32"], "narrower than"),
                          (["--parallel.tp", "2"], "tensor parallelism is not built")]:
        assert main([*args, "--checkpoint.dir", str(run)]) == 1
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: invalid configuration"), (args, err)
    assert not run.exists()
    # under torchrun the world is the launcher's: a layout that does not fill it is refused
    assert any("must equal the number of processes" in e
               for e in validate(cli("--parallel.dp_shard", "2", "--parallel.cp", "2"), world_size=1))


def test_packing_positions_and_prompt_masking():
    tok = ByteTokenizer()
    src = make_source("text", vocab_size=512, batch_size=3, seq_len=64)
    b = src.next_batch()
    starts = b["input_ids"] == tok.bos_id
    assert torch.all(b["position_ids"][starts] == 0)  # positions restart at each document
    assert torch.all(b["labels"][starts] == glm5f.IGNORE_INDEX)  # no prediction across documents
    state = src.state_dict()
    nxt = src.next_batch()
    src.load_state_dict(state)
    again = src.next_batch()
    assert all(torch.equal(nxt[k], again[k]) for k in nxt)


def test_json_prompt_response_and_unpacked_rows(tmp_path):
    f = tmp_path / "pr.jsonl"
    f.write_text(json.dumps({"prompt": "ab", "response": "cd"}) + "\n")
    b = make_source("json_file", vocab_size=512, batch_size=1, seq_len=8, path=str(f), pack=False).next_batch()
    tok = ByteTokenizer()
    assert b["input_ids"][0].tolist() == [tok.bos_id, 97, 98, 99, 100, tok.eos_id, tok.pad_id, tok.pad_id]
    assert b["labels"][0].tolist() == [-100, -100, -100, 99, 100, tok.eos_id, -100, -100]
    assert b["attention_mask"][0].tolist() == [1] * 6 + [0] * 2


def test_preset_batches_replay_in_order(tmp_path):
    batches = [{"input_ids": torch.full((2, 5), i), "labels": torch.full((2, 5), -100)} for i in range(3)]
    torch.save(batches, tmp_path / "b.pt")
    src = make_source("preset_pt", vocab_size=16, batch_size=2, seq_len=5, path=str(tmp_path / "b.pt"))
    assert [int(src.next_batch()["input_ids"][0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_adamw_matches_torch_optim():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg)
    state = adamw_init(params)
    ref_leaves = {p: t.clone().requires_grad_() for p, t in glm5f.flatten(params).items() if p in state["mu"]}
    decay = [t for p, t in ref_leaves.items() if leaf_rule(p, t.ndim) == "decay"]
    no_decay = [t for p, t in ref_leaves.items() if leaf_rule(p, t.ndim) == "no_decay"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = {p: torch.randn(t.shape, generator=g) for p, t in ref_leaves.items()}
        for p, t in ref_leaves.items():
            t.grad = grads[p].clone()
        opt.step()
        params, state = adamw_update(params, grads, state, 1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    flat = glm5f.flatten(params)
    for p, t in ref_leaves.items():
        assert torch.allclose(flat[p], t.detach(), atol=1e-6), p
    assert leaf_rule("model.layers.0.self_attn.indexer.wk.weight", 2) == "frozen"
    assert leaf_rule("model.layers.1.mlp.gate.e_score_correction_bias", 1) == "balance"
    assert leaf_rule("model.norm.weight", 1) == "no_decay"


def test_value_and_grad_clip_schedule_and_balance():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    loss, grads = value_and_grad(lambda p: glm5f.causal_lm_loss(glm5f.forward(p, cfg, ids), ids))(params)
    assert ".indexer." not in "".join(grads) and "e_score" not in "".join(grads)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    clipped, before = clip_by_global_norm(grads, float(norm) / 2)
    assert torch.isclose(before, norm)
    assert torch.isclose(torch.sqrt(sum((g ** 2).sum() for g in clipped.values())), norm / 2, rtol=1e-4)
    assert lr_schedule(0, peak=1.0, warmup=10, total=100) == pytest.approx(0.1)
    assert lr_schedule(9, peak=1.0, warmup=10, total=100) == pytest.approx(1.0)
    assert lr_schedule(100, peak=1.0, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    counts = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])
    moved = glm5f.flatten(balance_router_bias(params, {key: counts}, 0.01))[key]
    assert moved.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_export_hf_and_compare_script(tmp_path):
    train(cli("--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r1"), "--checkpoint.export_hf",
              str(tmp_path / "hf")))
    cfg, params = glm5f.load_hf(tmp_path / "hf")
    assert cfg == glm5f.preset("glm5-tiny")
    train(cli("--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r2")))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_runs.py"), str(tmp_path / "r1"),
                          str(tmp_path / "r2"), "--png", str(tmp_path / "c.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0.000e+00" in out.stdout and os.path.isfile(tmp_path / "c.png")


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


def test_second_run_into_a_used_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --checkpoint.dir, runs/default, as a user running train.py twice
    assert main(TINY + ["--train.steps", "2"]) == 0
    before = (tmp_path / "runs" / "default" / "metrics.jsonl").read_text()
    assert main(TINY + ["--train.steps", "3", "--data.seed", "1"]) == 1
    err = capsys.readouterr().err
    assert ("error: the run directory runs/default already holds a run (checkpoints, metrics.jsonl); continue it "
            "with --checkpoint.resume latest, start over with --checkpoint.overwrite") in err
    assert (tmp_path / "runs" / "default" / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(tmp_path / "runs" / "default" / "checkpoints")) == ["latest", "step_00000002"]
    (tmp_path / "runs" / "default" / "notes.txt").write_text("mine")
    assert main(TINY + ["--train.steps", "3", "--checkpoint.overwrite", "--checkpoint.every", "0"]) == 0
    run = tmp_path / "runs" / "default"
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000003"]
    assert (run / "notes.txt").read_text() == "mine"  # overwrite removes only what a run writes
    assert main(TINY + ["--train.steps", "3", "--checkpoint.overwrite", "--checkpoint.resume", "latest"]) == 1
    assert "--checkpoint.overwrite deletes the checkpoints --checkpoint.resume would" in capsys.readouterr().err


def test_help_lists_every_section():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0
    for flag in ("--model.preset", "--data.type", "--optim.lr", "--train.steps", "--train.activation_checkpointing",
                 "--parallel.cp", "--checkpoint.resume", "--model.hidden_size"):
        assert flag in out.stdout, flag


def test_every_flag_has_help():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, COLUMNS="100"))
    assert out.returncode == 0
    helps, flag = {}, None  # flag -> its help text, "(default: ...)" left out
    for line in out.stdout.splitlines():
        inner = line.strip().strip("│").strip()
        if line.strip()[:1] in "╭╰─":
            flag = None
        elif inner.startswith("-"):
            flag = inner.split()[0].rstrip(",")
            helps[flag] = ""
        elif flag:
            helps[flag] += " " + inner
    helps = {f: re.sub(r"\(default: [^)]*\)", "", h).strip() for f, h in helps.items()}
    assert len(helps) > 60 and "--data.seq_len" in helps
    assert [f for f, h in helps.items() if not h] == []


def bpe_tokenizer(directory) -> str:
    """A small BPE tokenizer.json in `directory` (its path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    tok.save(str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


def test_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(bpe_tokenizer(tmp_path))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    b = make_source("json_file", vocab_size=64, batch_size=1, seq_len=6, path=str(data), tokenizer_path=str(tmp_path),
                    pack=False).next_batch()
    assert b["input_ids"][0].tolist()[0] == tok.token_to_id("<s>")
    assert tok.decode(b["input_ids"][0].tolist()[1:4]) == "the cat sat"
    assert b["input_ids"][0].tolist()[4] == tok.token_to_id("</s>")


def test_hf_datasets_from_disk(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["hello world", "a second document"]}).save_to_disk(str(tmp_path / "one"))
    b = make_source("hf_datasets", vocab_size=512, batch_size=2, seq_len=12, path=str(tmp_path / "one"),
                    shuffle_buffer=1).next_batch()
    # packed in the dataset's order: bos "hello world", then its eos, bos and the start of the second document
    assert b["input_ids"].tolist() == [[256, *b"hello world"], [257, 256, *b"a second d"]]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["q"], "response": ["a"]}),
                                   "test": datasets.Dataset.from_dict({"prompt": ["x"], "response": ["y"]})})
    splits.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="choose one with --data.split"):
        make_source("hf_datasets", vocab_size=512, batch_size=1, seq_len=8, path=str(tmp_path / "two"))
    b = make_source("hf_datasets", vocab_size=512, batch_size=1, seq_len=8, path=str(tmp_path / "two"),
                    split="test", pack=False).next_batch()
    assert b["input_ids"][0, :4].tolist() == [256, ord("x"), ord("y"), 257]
    assert b["labels"][0, :4].tolist() == [-100, -100, ord("y"), 257]


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
    import train as train_mod
    monkeypatch.setattr(train_mod, "step_grads", lambda *a: (_ for _ in ()).throw(TrainingError("boom")))
    with pytest.raises(TrainingError, match="boom"):
        train(cli(*TINY, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()  # no empty metrics.jsonl


def test_damaged_checkpoint_is_named_and_latest_falls_back(tmp_path, capsys):
    run, root = str(tmp_path), tmp_path / "checkpoints"
    args = TINY + ["--checkpoint.every", "1", "--checkpoint.keep", "0", "--checkpoint.dir", run]
    assert main(args + ["--train.steps", "3"]) == 0
    manifest = json.loads((root / "step_00000003" / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "extra.pt", "meta.json"]
    size = manifest["__0_0.distcp"]["bytes"]
    with open(root / "step_00000003" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (root / "step_00000002" / "extra.pt").unlink()
    capsys.readouterr()
    assert main(args + ["--train.steps", "4", "--checkpoint.resume", str(root / "step_00000003")]) == 1
    assert (f"error: checkpoint {root / 'step_00000003'} is damaged: __0_0.distcp has 1000 bytes, not the {size} it "
            f"was saved with. Resume from the newest complete checkpoint instead: --checkpoint.resume "
            f"{root / 'step_00000001'}") in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # the refused resume wrote nothing
    assert main(args + ["--train.steps", "4", "--checkpoint.keep", "1", "--checkpoint.resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert (f"checkpoint {root / 'step_00000003'} is damaged (__0_0.distcp has 1000 bytes, not the {size} it was "
            f"saved with): resuming from {root / 'step_00000001'}, the newest complete one") in out
    assert f"resumed from {root / 'step_00000001'} at step 1" in out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert checkpoint.latest(run).endswith("step_00000004") and checkpoint.verify(checkpoint.latest(run)) is None
    assert sorted(os.listdir(root)) == ["latest", "step_00000004"]  # rotation kept the newest complete one


def test_checkpoint_verify_finds_each_kind_of_damage(tmp_path):
    path = checkpoint.save(str(tmp_path), 1, {"params": {"w": torch.ones(64)}}, extra={"step": 1}, meta={})
    assert checkpoint.verify(path) is None
    meta_file = tmp_path / "checkpoints" / "step_00000001" / ".metadata"
    good = meta_file.read_bytes()
    meta_file.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # same size, one byte flipped
    assert checkpoint.verify(path) == ".metadata does not match its CRC-32 in manifest.json (corrupted)"
    meta_file.write_bytes(good)
    os.remove(os.path.join(path, "extra.pt"))
    assert checkpoint.verify(path) == "extra.pt is missing"
    with pytest.raises(ValueError, match="no other checkpoint in .* is complete: start over with --checkpoint.overw"):
        checkpoint.choose(str(tmp_path), "latest")
    (tmp_path / "checkpoints" / "step_00000001" / "manifest.json").write_text("{")
    assert checkpoint.verify(path) == "manifest.json is unreadable"
    os.remove(os.path.join(path, "manifest.json"))  # as a checkpoint written before manifests: not checked
    assert checkpoint.verify(path) is None and checkpoint.choose(str(tmp_path), "latest") == (path, None)


def test_checkpoint_without_manifest_still_resumes(tmp_path, capsys):
    run = str(tmp_path)
    assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", run]) == 0
    os.remove(tmp_path / "checkpoints" / "step_00000002" / "manifest.json")
    assert main(TINY + ["--train.steps", "3", "--checkpoint.dir", run, "--checkpoint.resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000002'} at step 2" in out and "damaged" not in out
    old = tmp_path / "checkpoints" / "step_00000003"
    os.remove(old / "manifest.json")
    with open(old / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    assert main(TINY + ["--train.steps", "4", "--checkpoint.dir", run, "--checkpoint.resume", "latest"]) == 1
    assert (f"error: cannot read checkpoint {old} (") in capsys.readouterr().err
