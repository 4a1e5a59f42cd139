"""The run directory and its checkpoints under trouble: a second run into it, a save that fails or is interrupted,
partial saves left by a killed run, and paths a run cannot write."""

import errno
import os
import socket

import pytest

from glm5f import checkpoint
from glm5f.metrics import read_metrics
from train import main

TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0"]


def test_a_second_run_into_a_locked_run_dir_stops_before_writing_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    with checkpoint.RunLock(str(run)):  # a run holding the directory (flock: a second open file conflicts)
        assert (run / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}\n"
        assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", str(run)]) == 1
        err = capsys.readouterr().err
        assert (f"error: the run directory {run} is in use by another run (pid {os.getpid()} on host "
                f"{socket.gethostname()}, lock {run / '.lock'})") in err
        assert os.listdir(run) == [".lock"]  # nothing written
    assert not run.exists()  # the lock created the directory and, the run writing nothing, removed it


def test_a_stale_lock_of_a_dead_run_is_taken_over_saying_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("otherhost 999999\n")  # left by a run that was killed (its flock died with it)
    assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert (f"took over the lock {run / '.lock'} of a run that is no longer running (pid 999999 on host "
            f"otherhost: it stopped without releasing it)") in out
    assert not (run / ".lock").exists() and [r["step"] for r in read_metrics(run)] == [1, 2]


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
    assert f"error: could not write checkpoint step 2 to {run / 'checkpoints'}: no space left on device: it needs " \
           f"about " in err
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


@pytest.mark.parametrize("case", ["run dir is a file", "run dir under a file", "checkpoints is a file",
                                  "export under a file", "read-only run dir", "read-only export parent"])
def test_unwritable_run_paths_are_an_error_before_any_training(tmp_path, capsys, monkeypatch, case):
    run, export = tmp_path / "run", tmp_path / "hf"
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    if case == "run dir is a file":
        run = blocker
        want = f"the run directory (--checkpoint.dir) {blocker} is a file, not a directory"
    elif case == "run dir under a file":
        run = blocker / "run"
        want = f"the run directory (--checkpoint.dir) {run} is under {blocker}, which is a file"
    elif case == "checkpoints is a file":
        run.mkdir()
        (run / "checkpoints").write_text("mine")
        want = f"{run / 'checkpoints'} is a file, but a run keeps its checkpoints in a directory there"
    elif case == "export under a file":
        export = blocker / "hf"
        want = f"the directory of --checkpoint.export_hf {blocker} is a file"
    else:  # as root every directory is writable: make os.access say what a read-only directory would
        denied = str(tmp_path / "ro")
        os.mkdir(denied)
        if case == "read-only run dir":
            run = tmp_path / "ro" / "run"
            want = f"the run directory (--checkpoint.dir) {run} would be created in {denied}, which is not writable"
        else:
            export = tmp_path / "ro" / "hf"
            want = f"the directory of --checkpoint.export_hf {denied} is not writable"
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.abspath(p) == denied else real(p, mode))
    before = sorted(os.listdir(tmp_path))
    assert main(TINY + ["--train.steps", "2", "--checkpoint.dir", str(run), "--checkpoint.export_hf",
                        str(export)]) == 1
    err = capsys.readouterr().err
    assert f"error: {want}" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before and blocker.read_text() == "mine"
