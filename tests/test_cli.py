"""The command lines (train.py and configs.py's flags, scripts/convert.py, scripts/generate.py,
scripts/compare_runs.py): their help, invalid configurations, SIGTERM and the grace period, a GPU that is not there,
a closed pipe, a diverged checkpoint to start from, a longer resumed run's schedule, and what an export carries."""

import dataclasses
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
from safetensors.torch import load_file, save_file

import glm5f
from configs import Config, validate
from conftest import bpe_tokenizer, cli, run_script
from glm5f.run import preempt
from glm5f.ckpt import checkpoint
from glm5f.data import ByteTokenizer
from glm5f.run.metrics import read_metrics
from scripts import convert, generate
from train import main, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0", "--optim.warmup_steps", "2"]
RUN_TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "2"]

# train.py, with a real SIGTERM sent once step `at` is logged: to the process that writes metrics (rank 0), or to
# the run's process group (the launcher and every rank), as a scheduler sends it
SIGTERM_AT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import glm5f.run.metrics as metrics
    write = metrics.MetricsLog.write
    def write_then_sigterm(self, rec):
        write(self, rec)
        if rec["step"] == {at}:
            if {group}:
                os.killpg(os.getpgrp(), signal.SIGTERM)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
    metrics.MetricsLog.write = write_then_sigterm
    if __name__ == "__main__":
        from train import main
        sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("ranks,group", [(1, False), pytest.param(2, False, marks=pytest.mark.slow), (2, True)],
                         ids=["1", "2", "2-group"])
def test_sigterm_saves_one_checkpoint_that_resumes_bit_identically(tmp_path, ranks, group):
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_AT.format(root=ROOT, at=3, group=group))
    args = TINY + ["--train.steps", "6", "--checkpoint.every", "0", "--parallel.dp_shard", str(ranks)]
    run = args + ["--checkpoint.dir", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), *run], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=env, start_new_session=True)
    assert proc.returncode == 143, proc.stderr
    saved = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stopped after step 3 on SIGTERM: saved {saved}; resume with: python train.py {' '.join(run)} "
        f"--checkpoint.resume latest")
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["latest", "step_00000003"]  # no .tmp-*
    for more in (run + ["--checkpoint.resume", "latest"], args + ["--checkpoint.dir", str(tmp_path / "straight")]):
        # processes of their own, as the interrupted run: the same thread count, so the same sums
        done = subprocess.run([sys.executable, "train.py", *more], cwd=ROOT, capture_output=True, text=True,
                              timeout=240, env=env)
        assert done.returncode == 0, done.stderr
    resumed, straight = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    _, a = checkpoint.load_params(checkpoint.latest(str(tmp_path / "run")))
    _, b = checkpoint.load_params(checkpoint.latest(str(tmp_path / "straight")))
    assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a),
                                                 torch.utils._pytree.tree_leaves(b)))


def test_a_second_sigterm_or_the_grace_period_stops_without_saving():
    with preempt.handling(grace_s=None):
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.requested() == signal.SIGTERM  # the first only asks
        with pytest.raises(preempt.StopNow, match="a second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    with preempt.handling(grace_s=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(preempt.StopNow, match=r"--checkpoint.preempt_grace_s 0.2\) ran out"):
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and preempt.requested() is None


def test_a_sigterm_from_the_process_group_and_the_launcher_counts_once():
    with preempt.handling(grace_s=None, launched=True):
        os.kill(os.getpid(), signal.SIGTERM)  # the group's SIGTERM, then the launcher's copy of it
        os.kill(os.getpid(), preempt.FORWARDED)
        time.sleep(0.1)
        assert preempt.requested() == signal.SIGTERM and preempt.stopped_now() is None
        with pytest.raises(preempt.StopNow, match="a second SIGTERM"):  # the group's second
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        os.kill(os.getpid(), preempt.FORWARDED)  # the launcher's copy of it: stopping already, ignored
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    with preempt.handling(grace_s=None, launched=True):
        os.kill(os.getpid(), preempt.FORWARDED)  # SIGTERM to the launcher alone, twice
        with pytest.raises(preempt.StopNow, match="a second SIGTERM"):
            os.kill(os.getpid(), preempt.FORWARDED)
            time.sleep(5)
    assert signal.getsignal(preempt.FORWARDED) is signal.SIG_DFL


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_an_error_line(tmp_path, capsys):
    assert main(TINY + ["--train.steps", "1", "--train.device", "cuda", "--checkpoint.dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "error: --train.device cuda asks for a GPU, but " in err and "pass --train.device cpu" in err
    assert not (tmp_path / "r").exists()
    assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    assert generate.main([str(tmp_path / "run"), "--device", "cuda"]) == 1
    assert "error: --device cuda asks for a GPU, but " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_stops_a_dp2_run_in_one_line(tmp_path):
    run = TINY + ["--train.steps", "1", "--train.device", "cuda", "--parallel.dp_shard", "2", "--checkpoint.dir",
                  str(tmp_path / "r")]
    proc = subprocess.run([sys.executable, "train.py", *run], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: --train.device cuda asks for a GPU")


def test_generate_into_a_closed_pipe_exits_quietly(tmp_path):
    assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    proc = subprocess.Popen([sys.executable, "scripts/generate.py", str(tmp_path / "run"), "--prompt", "The",
                             "--max-tokens", "50", "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.close()  # `| head` that has already gone
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


def test_init_from_a_checkpoint_with_nan_names_its_tensors(tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "a"),
                        "--checkpoint.export_hf", str(hf)]) == 0
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    save_file(tensors, hf / "model.safetensors")
    capsys.readouterr()
    assert main(["--model.init_from", str(hf), "--data.type", "synthetic", "--data.batch_size", "2",
                 "--optim.warmup_steps", "1", "--data.seq_len", "32", "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert (f"error: --model.init_from {hf}: the loaded checkpoint holds NaN/inf in 1 tensor(s): "
            f"model.layers.1.self_attn.o_proj.weight (2 values)") in err
    assert "--optim.lr" not in err and not (tmp_path / "b").exists()


def test_a_longer_resumed_run_says_the_lr_jumps_and_schedule_steps_keeps_the_schedule(tmp_path, capsys):
    run = TINY + ["--checkpoint.dir", str(tmp_path / "run")]
    assert main(run + ["--train.steps", "4"]) == 0
    capsys.readouterr()
    assert main(run + ["--train.steps", "8", "--checkpoint.resume", "latest", "--optim.schedule_steps", "4"]) == 0
    assert "learning-rate schedule" not in capsys.readouterr().out
    kept = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert kept[4:] == [3e-3 * 0.1] * 4  # the original schedule ended at step 4: min lr from there
    assert main(TINY + ["--checkpoint.dir", str(tmp_path / "b"), "--train.steps", "4"]) == 0
    capsys.readouterr()
    assert main(TINY + ["--checkpoint.dir", str(tmp_path / "b"), "--train.steps", "8", "--checkpoint.resume",
                        "latest"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "learning-rate schedule" in line]
    assert lines == ["the learning-rate schedule now ends at step 8, not 4 as in the checkpoint's run, so the lr "
                     "jumps from 3.00e-04 to 2.33e-03 at step 5; pass --optim.schedule_steps 4 to keep the original "
                     "schedule"]
    assert main(TINY + ["--checkpoint.dir", str(tmp_path / "b"), "--train.steps", "6", "--checkpoint.resume",
                        "latest"]) == 0  # nothing to do: no schedule to speak of
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "nothing to do: step 8 >= --train.steps 6" and "learning-rate" not in out


def test_convert_keeps_the_umask_and_the_run_tokenizer(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(TINY + ["--train.steps", "1", "--checkpoint.dir", str(tmp_path / "bytes")]) == 0
        assert convert.main([str(tmp_path / "bytes"), str(tmp_path / "hf-bytes")]) == 0
        assert os.stat(tmp_path / "hf-bytes").st_mode & 0o777 == 0o755
        cfg = json.loads((tmp_path / "hf-bytes" / "config.json").read_text())
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (256, 257, 258)
        (tmp_path / "tok").mkdir()
        tok = bpe_tokenizer(tmp_path / "tok")
        (tmp_path / "tok" / "tokenizer_config.json").write_text('{"model_max_length": 32}')
        assert main(TINY + ["--train.steps", "1", "--model.tokenizer_path", str(tmp_path / "tok"),
                            "--checkpoint.dir", str(tmp_path / "bpe")]) == 0
        assert convert.main([str(tmp_path / "bpe"), str(tmp_path / "hf-bpe")]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "hf-bpe"
    assert (out / "tokenizer.json").read_bytes() == open(tok, "rb").read()
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 32}'
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 3)  # <s>, </s>, <pad>
    _, tokenizer = generate.load(str(out))[::2]
    assert tokenizer.bos_id == 1


def test_invalid_run_configs_fail_before_any_work(tmp_path, capsys):
    run = tmp_path / "never"
    for args, message in [(["--train.steps", "-3"], "--train.steps must be >= 1"),
                          (["--model.preset", "glm9"], "--model.preset 'glm9' is unknown"),
                          (["--data.batch_size", "6", "--train.grad_accum", "4"], "must divide by"),
                          (["--model.n_group", "3"], "divisible by n_group"),
                          (["--data.type", "json_file"], "needs --data.path"),
                          (["--train.dtype", "float64", "--train.reduce_dtype", "float32"], "narrower than"),
                          (["--parallel.tp", "2"], "tensor parallelism is not built"),
                          (["--data.seq_len", "36", "--train.query_parts", "4"], "queries must divide by 8")]:
        assert main([*args, "--checkpoint.dir", str(run)]) == 1
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: invalid configuration"), (args, err)
    assert not run.exists()
    # under torchrun the world is the launcher's: a layout that does not fill it is refused
    assert any("must equal the number of processes" in e
               for e in validate(cli("--parallel.dp_shard", "2", "--parallel.cp", "2"), world_size=1))


def test_export_hf_and_compare_script(tmp_path):
    train(cli("--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r1"), "--checkpoint.export_hf",
              str(tmp_path / "hf")))
    cfg, params = glm5f.load_hf(tmp_path / "hf")
    # config.json carries the run's tokenizer's ids (the byte tokenizer's), as convert.py's does
    assert cfg == dataclasses.replace(glm5f.preset("glm5-tiny"), bos_token_id=256, eos_token_id=257, pad_token_id=258)
    train(cli("--train.steps", "2", "--checkpoint.dir", str(tmp_path / "r2")))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_runs.py"), str(tmp_path / "r1"),
                          str(tmp_path / "r2"), "--png", str(tmp_path / "c.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0.000e+00" in out.stdout and os.path.isfile(tmp_path / "c.png")


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
    presets = helps["--model.preset"].replace(" ", "")  # as wrapped; before, only the GLM-5 presets were named
    assert [p for p in glm5f.PRESETS if p + "," not in presets and p + "(" not in presets] == []
    assert "GLM-5 or GLM-5.3 checkpoint" in helps["--model.init_from"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A two-step glm5-tiny run on the embedded text."""
    run = tmp_path_factory.mktemp("run")
    train(tyro.cli(Config, args=RUN_TINY + ["--checkpoint.dir", str(run)], use_underscores=True))
    return run


def test_convert_loads_in_transformers_with_the_same_logits(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert convert.main([str(run_dir), str(tmp_path / "hf")]) == 0
    assert "step_00000002" in capsys.readouterr().out
    cfg, params = checkpoint.load_params(checkpoint.latest(str(run_dir)))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(ids).logits
    ours = glm5f.forward(params, cfg, ids)
    assert (ours - theirs).abs().max() <= 1e-5


def test_convert_errors(run_dir, tmp_path, capsys):
    assert convert.main([str(tmp_path / "missing"), str(tmp_path / "hf")]) == 1
    assert "error:" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert convert.main([str(tmp_path / "empty"), str(tmp_path / "hf")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    assert convert.main([str(run_dir), str(tmp_path / "notes")]) == 1
    assert "not a previous glm5f export" in capsys.readouterr().err
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"


def argmax_continuation(params, cfg, ids, n, eos):
    """Greedy tokens by the full forward over the growing sequence, up to eos."""
    ids, out = torch.tensor([ids]), []
    for _ in range(n):
        token = int(glm5f.forward(params, cfg, ids)[0, -1].argmax())
        if token == eos:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_generate_streams_the_greedy_continuation(run_dir, capsys, monkeypatch):
    printed = []
    real = generate.print_stream
    monkeypatch.setattr(generate, "print_stream", lambda tok, tokens: printed.append(real(tok, tokens)))
    assert generate.main([str(run_dir), "--prompt", "The ", "--max-tokens", "24"]) == 0
    cfg, params = checkpoint.load_params(checkpoint.latest(str(run_dir)))
    tok = ByteTokenizer()
    want = argmax_continuation(params, cfg, [tok.bos_id] + tok.encode("The "), 24, tok.eos_id)
    assert printed == [want]
    assert capsys.readouterr().out == "The " + tok.decode(want) + "\n"


def test_generate_sampling_is_seeded_and_errors_are_lines(run_dir, tmp_path, capsys):
    args = [str(run_dir), "--prompt", "a", "--max-tokens", "16", "--temperature", "1.0", "--top-p", "0.9"]
    assert generate.main(args + ["--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert generate.main(args + ["--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert generate.main([str(tmp_path / "nothing"), "--prompt", "a"]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    (tmp_path / "empty-run").mkdir()
    assert generate.main([str(tmp_path / "empty-run"), "--prompt", "a"]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_a_tokenizer_larger_than_an_init_from_checkpoints_vocab_gets_advice_that_works(tmp_path, capsys):
    cfg = glm5f.preset("glm5-tiny", vocab_size=20)
    glm5f.save_hf(str(tmp_path / "hf"), cfg, glm5f.init_params(cfg, seed=0))
    tok = bpe_tokenizer(tmp_path)
    args = ["--model.init_from", str(tmp_path / "hf"), "--model.tokenizer_path", tok, "--data.batch_size", "2",
            "--data.seq_len", "32", "--train.steps", "1", "--checkpoint.dir", str(tmp_path / "run")]
    assert main(args) == 1
    err = capsys.readouterr().err  # before: "raise --model.vocab_size", which init_from then refuses
    assert (f"  - --model.tokenizer_path {tok} has 27 ids but --model.init_from {tmp_path / 'hf'} embeds 20 (its "
            f"config.json's vocab_size, which a run from it keeps): pass the tokenizer that checkpoint was trained "
            f"with, or drop --model.tokenizer_path to use the one it carries") in err
    assert "--model.vocab_size" not in err and not (tmp_path / "run").exists()


def test_warnings_print_as_one_line_in_the_scripts():
    out = run_script("-c", "import warnings; from glm5f.data import warnings_as_lines; warnings_as_lines(); "
                    "warnings.warn('an FP8 checkpoint: dequantized as read')")
    assert out.returncode == 0 and out.stderr == "warning: an FP8 checkpoint: dequantized as read\n", out.stderr
