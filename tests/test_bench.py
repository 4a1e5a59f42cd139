"""Every bench command runs, at toy sizes, both sides in one invocation, and prints its comparison (the figures
themselves come from the full-size commands in docs/, never from a test)."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

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


def test_posttrain_runs_both_sides():
    """bench/posttrain.py dpo at toy size: glm5f's (unshared and shared) and TRL's rows in one table, with their
    ratios."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "posttrain.py"), "dpo", "--preset", "glm5-tiny",
                          "--batch", "1", "--seq", "32", "--warmup", "1", "--steps", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines() if re.match(r"  (glm5f|shared|trl) +[\d.]+ ", line)]
    assert [r[0] for r in rows] == ["glm5f", "shared", "trl"] and all(len(r) == 6 for r in rows), res.stdout
    assert all(float(r[1]) > 0 and float(r[4]) > 0 for r in rows), res.stdout
    assert "glm5f / trl:" in res.stdout and "shared / trl:" in res.stdout, res.stdout



def test_posttrain_grpo_runs_both_sides():
    """bench/posttrain.py grpo at toy size: glm5f's and TRL's rows (with sampling time and completion length) in one
    table, with their ratio."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "posttrain.py"), "grpo", "--preset", "glm5-tiny",
                          "--batch", "1", "--seq", "16", "--group", "2", "--new-tokens", "4", "--warmup", "1",
                          "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines() if re.match(r"  (glm5f|trl) +[\d.]+ ", line)]
    assert [r[0] for r in rows] == ["glm5f", "trl"] and all(len(r) == 8 for r in rows), res.stdout
    assert all(float(r[1]) > 0 and float(r[4]) > 0 and 0 < float(r[7]) <= 4 for r in rows), res.stdout
    assert "glm5f / trl:" in res.stdout, res.stdout

def op_families(side: str) -> dict:
    """{op name: {family: calls}} of one profiled step of `side` ("glm5f" or "transformers") on the bench model at
    B1 S256, index_topk 64, in this process."""
    if os.path.join(ROOT, "bench") not in sys.path:  # last: bench/kernels.py must not stand for the `kernels` package
        sys.path.append(os.path.join(ROOT, "bench"))  # Transformers imports
    import common
    import forward_backward
    ap = argparse.ArgumentParser()
    common.add_model_flags(ap, "")
    common.add_run_flags(ap)
    step = forward_backward.make_step(ap.parse_args(["--batch", "1", "--seq", "256", "--topk", "64", "--child", side]))
    step()
    ops = {}
    common.profile_split(step, reps=1, ops=ops)
    return ops


@pytest.mark.parametrize("side", ["glm5f", "transformers"])
def test_profile_puts_each_side_s_work_in_its_family(side):
    """--profile's families: each side's linear layers, attention core, indexer and expert GEMMs land in those
    families and no GEMM in "other"; glm5f's custom ops land in the family of what they compute. Which family an op
    lands in, not how long it took (times depend on what else the CPU runs)."""
    torch.manual_seed(0)
    ops = op_families(side)
    import common  # bench/common.py, on the path once op_families ran
    gemms = {fam for op, fams in ops.items() if op in common.GEMM_OPS for fam in fams}
    assert {"linear layers", "attention core", "indexer", "MoE experts"} <= gemms, ops
    assert "other" not in gemms, {op: fams for op, fams in ops.items() if op in common.GEMM_OPS}
    if side == "glm5f":
        custom = {op: set(fams) for op, fams in ops.items() if op.startswith("glm5f::")}
        assert custom["glm5f::indexer_topk"] == {"indexer"}, custom
        attention = [op for op in custom if op.startswith(("glm5f::sparse_mla", "glm5f::topk_attention"))]
        assert attention and all(custom[op] == {"attention core"} for op in attention), custom
    else:
        assert set(ops["aten::_grouped_mm"]) == {"MoE experts"}, ops["aten::_grouped_mm"]
