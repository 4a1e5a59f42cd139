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
}


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_runs_both_sides(name):
    args, expected = BENCHES[name]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert expected in res.stdout, res.stdout
