"""glm5f/run/launch.py: the workers of `spawn` stop together when one dies, reports an error or stops answering (named
before the collective timeout by the StallWatch, after it by the launcher), and die with their launcher; runs stopped
from outside: Ctrl-C to a DP2 run in the middle of a save, and the ranks of a run started by torchrun (or any launcher
that sets RANK / WORLD_SIZE, one process per node here) when the run directory is locked or a rank hangs."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dist_checks
from conftest import step_hook_script
from glm5f.run import rundir
from glm5f.ckpt import checkpoint
from glm5f.run.launch import TIMEOUT_EXIT, RankError, free_port, spawn
from glm5f.run.metrics import read_metrics
from scripts.align import COMMON
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
    import glm5f.ckpt.checkpoint as checkpoint
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


def answer_ctrl_c() -> None:
    """In the child before it starts: SIGINT back to its default, so Python turns it into KeyboardInterrupt as in a
    terminal (a suite started in the background, `pytest &`, passes SIGINT on ignored, and Python keeps that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_run(script, run, every: int) -> list[str]:
    """Run the DP2 wrapper `script` (whose rank 0 sends the Ctrl-C) into `run`; assert it stopped with exit 130 and
    exactly the one line naming checkpoint 2 and the resume command (no teardown warning of a collective the stop
    left unwaited); returns the run's flags."""
    args = TINY + ["--train.steps", "50", "--checkpoint.every", str(every), "--parallel.dp_shard", "2",
                   "--checkpoint.dir", str(run)]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV, start_new_session=True, preexec_fn=answer_ctrl_c)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == [
        f"stopped on Ctrl-C (SIGINT): the last checkpoint is {run / 'checkpoints' / 'step_00000002'}; resume with: "
        f"python train.py {' '.join(args)} --checkpoint.resume latest"]
    return args


@pytest.mark.parametrize("group", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["terminal", "launcher-only"])
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


def test_a_hung_rank_is_named_after_the_collective_timeout(tmp_path):
    script = step_hook_script(tmp_path, rank=1, at=1, action="time.sleep(600)")  # rank 1 hangs in its first step
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), *TINY, "--train.steps", "3", "--parallel.dp_shard", "2",
                           "--parallel.timeout_s", "5", "--checkpoint.dir", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1
    assert "error: [rank 0] a collective timed out after --parallel.timeout_s" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: worker(s) 1 stopped answering: the others' collective timed out after --parallel.timeout_s waiting "
        f"for them, and they were still running (hung or stopped), so all 2 workers were stopped; no checkpoint was "
        f"written in {run}")
    assert "Traceback" not in proc.stderr


def test_a_stopped_rank_is_named_before_the_collective_timeout(tmp_path):
    # rank 1 stops itself (as `kill -STOP` does) in its 4th step, past the first
    script = step_hook_script(tmp_path, rank=1, at=4, action="os.kill(os.getpid(), signal.SIGSTOP)")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), *TINY, "--train.steps", "10", "--parallel.dp_shard", "2",
                           "--parallel.timeout_s", "10", "--checkpoint.every", "2", "--checkpoint.dir", str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    warned = [i for i, line in enumerate(lines) if re.fullmatch(
        r"warning: step 4 has run \d+ s, more than half of --parallel.timeout_s 10: rank\(s\) 1 stopped answering "
        r"\(hung, stopped or dead\); at 10 s of waiting the run stops", line)]
    assert len(warned) == 1, proc.stderr
    assert lines[-1] == (
        f"error: worker(s) 1 stopped answering: the others' collective timed out after --parallel.timeout_s waiting "
        f"for them, and they were still running (hung or stopped), so all 2 workers were stopped; the last "
        f"checkpoint is {run / 'checkpoints' / 'step_00000002'}: resume from it with --checkpoint.resume latest")
    assert warned[0] < len(lines) - 1 and "Traceback" not in proc.stderr


def test_dead_worker_stops_the_others():
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="worker 1 died with exit code -9; all 2 workers were stopped"):
        spawn(dist_checks.die_on_rank_one, 2)
    assert time.perf_counter() - t < 30


def test_a_workers_error_for_the_user_is_one_line_from_the_launcher(capfd):
    with pytest.raises(RankError, match=r"^data.jsonl:3: field 'response' must be a string, found null$"):
        spawn(dist_checks.bad_input_on_rank_one, 2)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed" not in err, err  # rank 0's broken collective is its consequence


def test_torchrun_launch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "train.py", *COMMON, "--parallel.cp", "2", "--train.steps", "2",
                          "--checkpoint.dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("done: loss") == 1  # only rank 0 reports
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def _children(pid: int) -> list[int]:
    """The spawned ranks of process `pid` (its multiprocessing spawn_main children), from /proc."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_ranks_die_with_their_launcher(cmd: list[str], started) -> list[int]:
    """Run the launcher `cmd` until started() is true, kill -9 it, and require both of its spawned ranks to end
    within 10 s (survivors are killed, then reported). Returns the ranks' pids."""
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not started():
            assert launcher.poll() is None, "the launcher exited before its ranks started"
            assert time.time() < deadline, "the ranks never started"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 10
    while any(_alive(p) for p in ranks) and time.time() < deadline:
        time.sleep(0.2)
    left = [p for p in ranks if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
    return ranks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert_ranks_die_with_their_launcher(
        [sys.executable, "train.py", "--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size",
         "2", "--data.seq_len", "32", "--train.steps", "100000", "--checkpoint.every", "0", "--parallel.dp_shard", "2",
         "--checkpoint.dir", str(tmp_path / "run")],
        started=lambda: metrics.exists() and metrics.read_text() != "")


LAUNCH = ("import sys; sys.path[:0] = [{root!r}, {tests!r}]; import dist_checks; from glm5f.run.launch import RankError, spawn; "
          "spawn(dist_checks.ignore_sigint_and_wait, 2, {pids!r})")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_that_ignore_sigint_still_die_with_their_launcher(tmp_path):
    """torch's own parent-death signal is SIGINT, which a rank stuck in native code never acts on."""
    pids = tmp_path / "pids"
    pids.mkdir()
    code = LAUNCH.format(root=ROOT, tests=os.path.join(ROOT, "tests"), pids=str(pids))
    ranks = assert_ranks_die_with_their_launcher([sys.executable, "-c", code],
                                                 started=lambda: len(os.listdir(pids)) == 2)
    assert sorted(ranks) == sorted(int(p) for p in os.listdir(pids))
