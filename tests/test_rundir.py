"""glm5f/run/rundir.py: the run directory's lock (a second run into a locked directory, a stale lock taken over, what
the lock leaves behind) and the paths a run cannot write, named before any training."""

import os
import socket

import pytest

from glm5f.run import rundir
from glm5f.run.metrics import read_metrics
from train import main

TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0"]


def test_a_run_lock_refuses_a_second_holder_and_removes_only_what_it_created(tmp_path):
    made, kept = tmp_path / "made", tmp_path / "kept"
    kept.mkdir()
    for run in (made, kept):
        with rundir.RunLock(str(run), say=lambda line: None):
            with pytest.raises(rundir.RunDirBusy) as refused:
                rundir.RunLock(str(run)).__enter__()
            assert str(refused.value) == (
                f"the run directory {run} is in use by another run (pid {os.getpid()} on host "
                f"{socket.gethostname()}, lock {run / '.lock'}); wait for it to finish or stop it, or pass another "
                f"--checkpoint.dir")
            assert os.listdir(run) == [".lock"]
        with rundir.RunLock(str(run), say=lambda line: None):  # released: the next run takes it
            pass
    assert not made.exists() and kept.is_dir() and os.listdir(kept) == []


def test_a_second_run_into_a_locked_run_dir_stops_before_writing_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    with rundir.RunLock(str(run)):  # a run holding the directory (flock: a second open file conflicts)
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
