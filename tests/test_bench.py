"""Every bench command runs, at toy sizes, both sides in one invocation, and prints its comparison (the figures
themselves come from the full-size commands in the README, never from a test)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCHES = {
    "forward_backward": (["--batch", "1", "--seq", "64", "--steps", "1"], "x faster"),
    "attention": (["--seq", "256", "--topk", "64"], "faster"),
    "moe": (["--experts", "8", "--top", "2", "--tokens", "128", "--steps", "1"], "faster"),
    "fsdp_memory": (["--model", "--model.preset glm5-tiny --model.num_hidden_layers 2 --model.index_topk_pattern FS",
                     "--run", "--data.type synthetic --data.batch_size 2 --data.seq_len 32", "--steps", "1"],
                    "dp_shard 2 / 1 process, checkpointing"),
    "lora": (["--layers", "1", "--seq", "64", "--batch", "1", "--steps", "1"], "lora / full:"),
    "floor": (["--batch", "1", "--seq", "64", "--steps", "1"], "any implementation at most"),
    "floor --moe": (["--moe", "--experts", "8", "--top", "2", "--tokens", "128", "--steps", "1"],
                    "utilisation GEMMs alone"),
    "kda": (["--seq", "128", "--steps", "1"], "of the tensor memory"),
}


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_runs_both_sides(name):
    args, expected = BENCHES[name]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name.split()[0]}.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert expected in res.stdout, res.stdout


def test_profile_puts_each_side_s_work_in_its_family():
    """--profile: both sides' linear layers, attention and expert GEMMs land in their families, and the ops'
    time is most of each step's CPU time (no large share lost to 'other')."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "forward_backward.py"), "--batch", "1", "--seq",
                          "256", "--topk", "64", "--steps", "1", "--threads", "1", "--profile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = {line[:36].strip(): [float(v) for v in line[36:].split()] for line in res.stdout.splitlines()
            if line.startswith("  ") and "(" in line[:36] and line[36:].strip()[:1].isdigit()}
    for family in ("linear layers (GEMM)", "attention core (GEMM)", "MoE experts (GEMM)", "indexer (other)"):
        assert family in rows and min(rows[family]) > 0, (family, res.stdout)
    ops, other = rows["ops in all (profiled)"], rows.get("other (other)", [0.0, 0.0])
    assert all(o < 0.05 * t for o, t in zip(other, ops)), res.stdout
