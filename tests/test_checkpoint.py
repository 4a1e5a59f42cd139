"""glm5f/ckpt/checkpoint.py: checkpoints under trouble: a save that fails, is interrupted or killed, partial saves left
behind, a second run into a used run directory, damaged checkpoints and what `verify` finds, non-finite params
refused, malformed meta.json."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import glm5f
from conftest import TINY_RUN, cli, run_error
from glm5f.ckpt import checkpoint
from glm5f.run.metrics import read_metrics
from glm5f.train.optim import adamw_init
from train import main, train

TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = ["--model.preset", "glm5-scaled-moe", "--data.batch_size", "4", "--data.seq_len", "80",
       "--train.grad_accum", "2", "--checkpoint.every", "5"]
SYNTHETIC_TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2",
                  "--data.seq_len", "32"]


def fail_writes_of(monkeypatch, step: int, exc: BaseException):
    """Make DCP's file writer raise `exc` for checkpoint `step`, after writing part of its first item."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def write_item(transforms, stream, data, write_item, *args, **kwargs):
        if f".tmp-step_{step:08d}" in getattr(stream, "name", ""):
            stream.write(b"\0" * 1000)
            raise exc
        return real(transforms, stream, data, write_item, *args, **kwargs)
    monkeypatch.setattr(fs, "_write_item", write_item)


def test_a_full_disk_during_a_save_names_the_cause_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    fail_writes_of(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    args = TINY + ["--train.steps", "3", "--checkpoint.every", "1", "--checkpoint.dir", str(run)]
    assert main(args) == 1
    err = capsys.readouterr().err
    first = run / "checkpoints" / "step_00000001"  # the same state: as much room as it takes, not less
    size = checkpoint._size(sum(os.path.getsize(first / n) for n in os.listdir(first)))
    assert f"error: could not write checkpoint step 2 to {run / 'checkpoints'}: no space left on device: a checkpoint " \
           f"takes about {size} (as step_00000001 does), " in err
    assert " are free there now. The partial checkpoint was removed and " \
           f"{run / 'checkpoints' / 'step_00000001'} is still the latest checkpoint; free some space" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001"]  # no .tmp-step_00000002
    assert checkpoint.latest(str(run)).endswith("step_00000001")


def test_ctrl_c_during_a_save_removes_the_partial_folder_in_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    fail_writes_of(monkeypatch, 2, KeyboardInterrupt())
    args = TINY + ["--train.steps", "3", "--checkpoint.every", "1", "--checkpoint.dir", str(run)]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"stopped on Ctrl-C (SIGINT): the last checkpoint is {run / 'checkpoints' / 'step_00000001'}; resume with: "
        f"python train.py {' '.join(args)} --checkpoint.resume latest")
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001"]


def test_partial_saves_of_a_killed_run_are_removed_on_the_next_start_saying_so(tmp_path, capsys):
    run = tmp_path / "run"
    args = TINY + ["--train.steps", "2", "--checkpoint.dir", str(run)]
    assert main(args) == 0
    partial = run / "checkpoints" / ".tmp-step_00000003"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    capsys.readouterr()
    assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", str(run), "--checkpoint.resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"removed {partial}: a checkpoint a previous run did not finish writing (it was "
                                   f"stopped during the save)")
    assert not partial.exists() and checkpoint.latest(str(run)).endswith("step_00000002")


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import glm5f.ckpt.checkpoint as ck
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


def test_checkpoint_save_refuses_nonfinite_and_keeps_the_newest(tmp_path):
    good = {"params": {"w": torch.ones(3)}}
    first = checkpoint.save(str(tmp_path), 1, good, extra={"step": 1}, meta={}, keep=1)
    with pytest.raises(ValueError, match="refusing to save checkpoint 2: non-finite values in params.w"):
        checkpoint.save(str(tmp_path), 2, {"params": {"w": torch.tensor([1.0, float("inf"), 0.0])}},
                        extra={"step": 2}, meta={}, keep=1)
    assert checkpoint.latest(str(tmp_path)) == first
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000001"]


def test_second_run_into_a_used_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --checkpoint.dir, runs/default, as a user running train.py twice
    assert main(SYNTHETIC_TINY + ["--train.steps", "2"]) == 0
    before = (tmp_path / "runs" / "default" / "metrics.jsonl").read_text()
    assert main(SYNTHETIC_TINY + ["--train.steps", "3", "--data.seed", "1"]) == 1
    err = capsys.readouterr().err
    assert ("error: the run directory runs/default already holds a run (checkpoints, metrics.jsonl); continue it "
            "with --checkpoint.resume latest, start over with --checkpoint.overwrite") in err
    assert (tmp_path / "runs" / "default" / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(tmp_path / "runs" / "default" / "checkpoints")) == ["latest", "step_00000002"]
    (tmp_path / "runs" / "default" / "notes.txt").write_text("mine")
    assert main(SYNTHETIC_TINY + ["--train.steps", "3", "--checkpoint.overwrite", "--checkpoint.every", "0"]) == 0
    run = tmp_path / "runs" / "default"
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000003"]
    assert (run / "notes.txt").read_text() == "mine"  # overwrite removes only what a run writes
    assert main(SYNTHETIC_TINY + ["--train.steps", "3", "--checkpoint.overwrite", "--checkpoint.resume", "latest"]) == 1
    assert "--checkpoint.overwrite deletes the checkpoints --checkpoint.resume would" in capsys.readouterr().err


def test_damaged_checkpoint_is_named_and_latest_falls_back(tmp_path, capsys):
    run, root = str(tmp_path), tmp_path / "checkpoints"
    args = SYNTHETIC_TINY + ["--checkpoint.every", "1", "--checkpoint.keep", "0", "--checkpoint.dir", run]
    assert main(args + ["--train.steps", "3"]) == 0
    manifest = json.loads((root / "step_00000003" / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "extra.pt", "meta.json"]
    size = manifest["__0_0.distcp"]["bytes"]
    with open(root / "step_00000003" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (root / "step_00000002" / "extra.pt").unlink()
    capsys.readouterr()
    assert main(args + ["--train.steps", "4", "--checkpoint.resume", str(root / "step_00000003")]) == 1
    assert (f"error: checkpoint {root / 'step_00000003'} is damaged (__0_0.distcp has 1000 bytes, not the {size} it "
            f"was saved with). Resume from the newest verified checkpoint instead: --checkpoint.resume "
            f"{root / 'step_00000001'}") in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # the refused resume wrote nothing
    assert main(args + ["--train.steps", "4", "--checkpoint.keep", "1", "--checkpoint.resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert (f"checkpoint {root / 'step_00000003'} is damaged (__0_0.distcp has 1000 bytes, not the {size} it was "
            f"saved with); checkpoint {root / 'step_00000002'} is damaged (extra.pt is missing): resuming from "
            f"{root / 'step_00000001'}, the newest verified one") in out
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
    with pytest.raises(ValueError, match="no other checkpoint in .* can be verified: start over with --checkpoint.ov"):
        checkpoint.choose(str(tmp_path), "latest")
    (tmp_path / "checkpoints" / "step_00000001" / "manifest.json").write_text("{")
    assert checkpoint.verify(path) == "manifest.json is unreadable"
    os.remove(os.path.join(path, "manifest.json"))  # as a checkpoint written before manifests: nothing to check by
    assert checkpoint.verify(path) == checkpoint.NO_MANIFEST
    with pytest.raises(ValueError, match="cannot be verified .* resume it with --checkpoint.resume .*step_00000001 "
                                         "--checkpoint.trust_unverified"):
        checkpoint.choose(str(tmp_path), "latest")
    assert checkpoint.choose(str(tmp_path), "latest", trust_unverified=True)[0] == path


def test_a_checkpoint_that_cannot_be_verified_is_not_resumed_unless_trusted(tmp_path, capsys):
    run, root = str(tmp_path), tmp_path / "checkpoints"
    args = SYNTHETIC_TINY + ["--checkpoint.dir", run, "--checkpoint.every", "1", "--checkpoint.keep", "0"]
    assert main(args + ["--train.steps", "2"]) == 0
    first, second = root / "step_00000001", root / "step_00000002"
    os.remove(second / "manifest.json")  # and 64 bytes flipped: without a manifest nothing can tell
    with open(second / "__0_0.distcp", "r+b") as f:
        f.seek(4096)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(4096)
        f.write(flipped)
    capsys.readouterr()
    assert checkpoint.latest(run) == str(first)  # the newest one that can be verified
    assert main(args + ["--train.steps", "3", "--checkpoint.resume", "latest"]) == 0
    out = capsys.readouterr().out
    assert (f"checkpoint {second} cannot be verified (it has no manifest.json to check its files against: it was "
            f"written before checkpoints had manifests, or copied without it): resuming from {first}, the newest "
            f"verified one") in out
    assert f"resumed from {first} at step 1" in out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # step 2 again, from step 1's state
    os.remove(root / "step_00000003" / "manifest.json")
    with open(root / "step_00000003" / "__0_0.distcp", "r+b") as f:  # 1.5 MB overwritten, as a bad copy does
        f.seek(1000)
        f.write(bytes(1_500_000))
    assert main(args + ["--train.steps", "4", "--checkpoint.resume", str(root / "step_00000003")]) == 1
    err = capsys.readouterr().err
    assert (f"error: checkpoint {root / 'step_00000003'} cannot be verified (it has no manifest.json to check its "
            f"files against: it was written before checkpoints had manifests, or copied without it). If you trust "
            f"it, resume it unchecked with --checkpoint.trust_unverified. Resume from the newest verified checkpoint "
            f"instead: --checkpoint.resume {second}") in err  # written again, with its manifest, by the resume
    assert main(args + ["--train.steps", "4", "--checkpoint.resume", str(root / "step_00000003"),
                        "--checkpoint.trust_unverified"]) == 1
    captured = capsys.readouterr()
    assert (f"resuming from {root / 'step_00000003'} unchecked: it has no manifest.json "
            f"(--checkpoint.trust_unverified)") in captured.out
    assert (f"error: cannot read checkpoint {root / 'step_00000003'}: its data does not unpickle: the bytes of a file "
            f"were changed after it was saved. It is damaged (or not this run's): resume from an older one in "
            f"{root}\n") in captured.err
    assert "weights_only" not in captured.err and "Weights only" not in captured.err  # torch's advice stays out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # the refused resumes wrote nothing
    os.remove(first / "manifest.json")  # an old checkpoint, whole: trusted, it exports (the way load_params names)
    assert main(args + ["--train.steps", "1", "--checkpoint.resume", str(first), "--checkpoint.trust_unverified",
                        "--checkpoint.export_hf", str(tmp_path / "hf")]) == 0
    assert f"resuming from {first} unchecked" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")


def test_malformed_meta_and_config_json_name_the_file(tmp_path, capsys):
    from train import main
    run = tmp_path / "r"
    assert main(TINY_RUN + ["--data.type", "synthetic", "--checkpoint.dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    (ckpt / "manifest.json").unlink(missing_ok=True)  # as a checkpoint written before manifests
    (ckpt / "meta.json").write_text('{"step": 2,\n')
    err = run_error(capsys, "--data.type", "synthetic", "--train.steps", "3", "--checkpoint.dir", str(run),
                    "--checkpoint.resume", str(ckpt), "--checkpoint.trust_unverified")
    assert f"error: {ckpt / 'meta.json'}: not valid JSON (Expecting property name" in err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": \n')
    from train import main
    assert main(["--model.init_from", str(tmp_path / "hf"), "--checkpoint.dir", str(tmp_path / "r2")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'hf' / 'config.json'}: not valid JSON (Expecting value at line 2 column 1)" in err
    with pytest.raises(ValueError, match="config.json: holds a JSON list"):
        (tmp_path / "hf" / "config.json").write_text("[1]")
        glm5f.load_hf(tmp_path / "hf")
