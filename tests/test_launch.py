"""Multi-process runs stopped from outside: Ctrl-C to a DP2 run in the middle of a save, and the ranks of a run
started by torchrun (or any launcher that sets RANK / WORLD_SIZE, one process per node here) when the run directory
is locked or a rank hangs."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import step_hook_script
from glm5f import checkpoint, rundir
from glm5f.distributed import TIMEOUT_EXIT, free_port
from glm5f.metrics import read_metrics
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0", "--optim.warmup_steps", "2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")

# train.py whose rank 0, while writing checkpoint `at` (after DCP wrote every rank's shards), sends SIGINT to the
# run's process group, as Ctrl-C in a terminal does (the launcher and both ranks get it), or to the launcher only
# (`kill -INT PID`); removing the partial checkpoint takes 5 s, as a large one's would
CTRL_C_IN_SAVE = textwrap.dedent("""
    import os, shutil, signal, sys, time
    sys.path.insert(0, {root!r})
    import glm5f.checkpoint as checkpoint
    remove = shutil.rmtree
    def slow_remove(path, *args, **kwargs):
        if ".tmp-step_" in str(path) and os.path.exists(path):
            time.sleep(5)
        remove(path, *args, **kwargs)
    shutil.rmtree = slow_remove
    write = checkpoint._write_manifest
    def write_after_ctrl_c(path):
        if path.endswith(".tmp-step_{at:08d}"):
            if {group}:
                os.killpg(os.getpgrp(), signal.SIGINT)
            else:
                os.kill(os.getppid(), signal.SIGINT)
            time.sleep(30)
        write(path)
    checkpoint._write_manifest = write_after_ctrl_c
    if __name__ == "__main__":
        from train import main
        sys.exit(main(sys.argv[1:]))
""")


def ctrl_c_run(script, run, every: int) -> list[str]:
    """Run the DP2 wrapper `script` (whose rank 0 sends the Ctrl-C) into `run`; assert it stopped with exit 130 and
    exactly the one line naming checkpoint 2 and the resume command (no teardown warning of a collective the stop
    left unwaited); returns the run's flags."""
    args = TINY + ["--train.steps", "50", "--checkpoint.every", str(every), "--parallel.dp_shard", "2",
                   "--checkpoint.dir", str(run)]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV, start_new_session=True)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == [
        f"stopped on Ctrl-C (SIGINT): the last checkpoint is {run / 'checkpoints' / 'step_00000002'}; resume with: "
        f"python train.py {' '.join(args)} --checkpoint.resume latest"]
    return args


@pytest.mark.parametrize("group", [True, False], ids=["terminal", "launcher-only"])
def test_ctrl_c_to_a_dp2_run_during_a_save_is_one_line_and_leaves_nothing_half_written(tmp_path, group):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_IN_SAVE.format(root=ROOT, at=3, group=group))
    run = tmp_path / "run"
    ctrl_c_run(script, run, every=1)
    ckpts = run / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["latest", "step_00000001", "step_00000002"]  # no .tmp-step_00000003
    assert all(checkpoint.verify(str(ckpts / n)) is None for n in ("step_00000001", "step_00000002"))
    # the lock released (tokenizer/: the run's tokenizer and template, written at its start)
    assert sorted(os.listdir(run)) == ["checkpoints", "config.yaml", "metrics.jsonl", "tokenizer"]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert main(TINY + ["--train.steps", "3", "--checkpoint.dir", str(run), "--checkpoint.resume", "latest"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_ctrl_c_to_a_dp2_run_in_a_step_is_one_line(tmp_path):
    # rank 0 sends SIGINT to the process group (Ctrl-C in a terminal) in its 3rd step: every rank stops mid-step
    script = step_hook_script(tmp_path, rank=0, at=3, action="os.killpg(os.getpgrp(), signal.SIGINT)")
    ctrl_c_run(script, tmp_path / "run", every=2)


def start_ranks(script_or_train: str, args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """`world` processes joined as torchrun joins them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each as the only
    process of its node, so no launcher of ours (nor torchrun's agent) stops the others when one ends."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, script_or_train, *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(ENV, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(world)]


def test_a_locked_run_dir_stops_every_torchrun_rank_at_once(tmp_path):
    run = tmp_path / "run"
    with rundir.RunLock(str(run)):
        t0 = time.monotonic()
        ranks = start_ranks("train.py", TINY + ["--train.steps", "2", "--parallel.dp_shard", "2",
                                                "--parallel.timeout_s", "240", "--checkpoint.dir", str(run)])
        try:
            outs = [p.communicate(timeout=200) for p in ranks]
        finally:
            for p in ranks:
                p.kill()
        elapsed = time.monotonic() - t0
    assert [p.returncode for p in ranks] == [1, 1]
    assert elapsed < 120, f"rank 1 waited {elapsed:.0f} s for a rank 0 that had stopped"  # not the 240 s timeout
    assert outs[0][1] == (f"error: the run directory {run} is in use by another run (pid {os.getpid()} on host "
                          f"{os.uname().nodename}, lock {run / '.lock'}); wait for it to finish or stop it, or pass "
                          f"another --checkpoint.dir\n")
    assert outs[1][1] == ""  # rank 0 says it, once
    assert not run.exists()


def test_a_hung_torchrun_rank_is_named_in_one_line(tmp_path):
    script = step_hook_script(tmp_path, rank=1, at=1, action="time.sleep(600)")  # rank 1 hangs in its first step
    run = tmp_path / "run"
    ranks = start_ranks(str(script), TINY + ["--train.steps", "3", "--parallel.dp_shard", "2",
                                             "--parallel.timeout_s", "5", "--checkpoint.dir", str(run)])
    try:
        _, err = ranks[0].communicate(timeout=200)
        assert ranks[1].poll() is None  # still hanging: no launcher of ours watches it
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    assert ranks[0].returncode == TIMEOUT_EXIT, err
    assert err.splitlines() == [f"error: a collective timed out after --parallel.timeout_s 5: rank(s) 1 stopped "
                                f"answering (hung, stopped or dead); no checkpoint was written in {run}"]
    assert not (run / ".lock").exists()
