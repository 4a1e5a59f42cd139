"""bench/kernels.py's ahead-of-time report: every glm5f Triton kernel compiles for sm_90a and sm_100a without spills
or shared memory past a block's limit, and the FLOPs and bytes it prints agree with a count by hand.

The compiles run in their own processes: tests/test_kernels.py interprets the kernels (TRITON_INTERPRET=1), and
glm5f.kernels.triton_dsa is imported once per process."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

# Triton is not imported here: it reads TRITON_INTERPRET when first imported, and tests/test_kernels.py sets it
# when it is collected (after this module); an import here would leave its kernels compiled, not interpreted.
TRITON = importlib.util.find_spec("triton")
if TRITON is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(TRITON.origin), "backends", "nvidia", "bin", "ptxas-blackwell")
if not os.path.exists(PTXAS):
    pytest.skip(f"no {PTXAS} (Triton's wheel ships it on Linux x86_64)", allow_module_level=True)


def run(*args):
    """python args... from the repository root, TRITON_INTERPRET unset; (exit code, stdout + stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return res.returncode, res.stdout + res.stderr


def report():
    sys.path.insert(0, ROOT)
    from bench import kernels
    return kernels


def json_rows(out: str) -> list[dict]:
    """The JSON objects a --json run printed, one a line (other lines, e.g. warnings, skipped)."""
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def fits(row: dict) -> bool:
    """A kernel fits when it compiled, spilled nothing and stays within a block's shared memory (227 KB on sm_90 and
    sm_100); the numbers are ptxas', the rule is the test's own."""
    return row["error"] is None and row["regs"] > 0 and row["spills"] == 0 and 0 <= row["shared"] <= 227 * 1024


def test_every_kernel_fits_at_tiny_and_glm5_forward_shapes():
    """The tiny shapes for every kernel, arch and dtype, and GLM-5's forward in bf16 on sm_90a (64 heads in one
    program, each selected row read once): every row fits, and the report says so (exit 0, every row ok)."""
    code, out = run("bench/kernels.py", "--shapes", "tiny", "--json")
    rows = json_rows(out)
    assert code == 0 and len(rows) == 20 and all(fits(r) and r["ok"] for r in rows), out
    assert sorted((r["kernel"], r["dtype"]) for r in rows if r["arch"] == "sm_90a") == \
        sorted((r["kernel"], r["dtype"]) for r in rows if r["arch"] == "sm_100a"), out
    code, out = run("bench/kernels.py", "--shapes", "glm5", "--archs", "sm_90a", "--dtypes", "bf16", "--kernels",
                    "sparse_mla_fwd", "--json")
    (row,) = json_rows(out)
    assert code == 0 and fits(row) and row["blocks"].split()[0] == "H64" and row["rows_per_query"] == 1, out


def test_fp32_backward_fits_at_glm5_shapes():
    """GLM-5's fp32 dq and row gradients on sm_90a: their products over channel chunks (BLOCK_C) leave no 512-long
    reduction in a thread's registers, so neither spills (over whole rows both did)."""
    code, out = run("bench/kernels.py", "--shapes", "glm5", "--archs", "sm_90a", "--dtypes", "fp32", "--kernels",
                    "sparse_mla_bwd_dq", "sparse_mla_bwd_rows", "--json")
    rows = json_rows(out)
    assert code == 0 and sorted(r["kernel"] for r in rows) == ["sparse_mla_bwd_dq", "sparse_mla_bwd_rows"], out
    assert all(fits(r) and "C0" not in r["blocks"].split() for r in rows), out


def test_block_tradeoff_counts_the_loop_spill_traffic():
    """bench/kernel_blocks.py: GLM-5's fp32 dq over whole rows spills, and its main loop moves the spilled values to
    and from local memory (traffic counted a query); over channel chunks it spills nothing and moves nothing."""
    code, out = run("bench/kernel_blocks.py", "sparse_mla_bwd_dq", "fp32", "16,16,0,8", "32,32,16,8", "--json")
    rows = json_rows(out)
    assert code == 0 and [(r["H"], r["K"], r["C"]) for r in rows] == [(16, 16, 0), (32, 32, 16)], out
    whole, chunked = rows
    assert whole["spills"] > 0 and whole["spill_mb_per_query"] > 0, out
    assert chunked["spills"] == 0 and chunked["spill_mb_per_query"] == 0, out


def test_a_spilling_launch_fails_the_report():
    """The same forward at 4 warps holds a [64, 512] fp32 accumulator in 128 threads (256 registers each): ptxas
    spills, and the report marks the row not ok and exits 1."""
    code, out = run("-c", "import dataclasses, sys; from bench import kernels as k; "
                          "first = k.launches; "
                          "k.launches = lambda *a: [dataclasses.replace(f, consts=dict(f.consts, num_warps=4)) "
                          "for f in first(*a)]; "
                          "sys.exit(k.main(['--shapes', 'glm5', '--archs', 'sm_90a', '--dtypes', 'bf16', "
                          "'--kernels', 'sparse_mla_fwd', '--json']))")
    (row,) = json_rows(out)
    assert code == 1 and row["spills"] > 0 and not fits(row) and not row["ok"] and "1 FAIL" in out, out


def test_counts_of_the_forward_by_hand():
    """B2 S3 H20 R40 P9 K19 in fp32 with BLOCK_H 16 (2 head blocks: rows read twice), BLOCK_K 16 (K padded to 32),
    BLOCK_R 64, BLOCK_P 16: per query the math is 2 H K (C + R) FLOPs; the tiles compute
    2 x 32 heads x 32 keys x (64 + 16 + 64)."""
    kr = report()
    shape = dict(B=2, S=3, T=7, H=20, R=40, P=9, K=19, I=2, J=16)
    fwd = kr.mla_launches(torch.float32, **shape, block_h=16, block_k=16)[0]
    assert fwd.kernel == "sparse_mla_fwd" and fwd.consts["BLOCK_R"] == 64 and fwd.consts["BLOCK_P"] == 16
    n, C = 6, 49
    assert fwd.min_flops == n * 2 * 20 * 19 * (49 + 40)
    assert fwd.flops == n * 2 * 2 * 16 * 32 * (64 + 16 + 64)
    rows = 19 * (C * 4 + 8 + 1)  # a query's selected rows with their int64 index and bool allowed flag
    assert fwd.min_bytes == n * (rows + 20 * (C + 40) * 4 + 20 * 4)
    assert fwd.bytes == n * (2 * rows + 20 * (C + 40) * 4 + 20 * 4) and fwd.rows_per_query == 2
    bound, estimate = kr.roofline(fwd, torch.float32)
    assert bound == pytest.approx(max(fwd.min_flops / 67e12, fwd.min_bytes / 3.35e12))
    assert estimate == pytest.approx(max(fwd.flops / 67e12, fwd.bytes / 3.35e12))


def test_counts_of_the_chunked_fp32_backward_by_hand():
    """B2 S3 H20 R40 P9 K19 in fp32, 16 heads and 16 selections a program, chunks of 16 channels (C = 49 padded to
    64, R to 48): dq reads the rows in chunks and again whole per head block, and q and dout in chunks per tile of
    selections; the row gradients read the rows in chunks per head block, and q and dout twice per tile."""
    kr = report()
    shape = dict(B=2, S=3, T=7, H=20, R=40, P=9, K=19, I=2, J=16)
    _, dq, rows, _ = kr.mla_launches(torch.float32, **shape, block_h=16, block_k=16)
    assert dq.consts["BLOCK_C"] and rows.consts["BLOCK_C"]
    n, C, R, e = 6, 49, 40, 4
    bc = dq.consts["BLOCK_C"]
    cp, rp = -(-C // bc) * bc, -(-R // bc) * bc
    select = 19 * (C * e + 8 + 1)
    assert dq.flops == n * 2 * 2 * 16 * 32 * (cp + rp + 64 + 16)  # s, dprob over chunks; dq over BLOCK_R + BLOCK_P
    assert dq.bytes == n * (2 * select + 2 * 19 * C * e + 2 * 20 * (C + R) * e + 20 * C * e + 20 * 8)
    assert dq.rows_per_query == 4
    assert rows.flops == n * 2 * 2 * 32 * 16 * (cp + rp + 2 * 64 + 16)
    assert rows.bytes == n * (select + 19 * C * e + 2 * (20 * (C + R) * e + 20 * 8 + 1) + 2 * 20 * (C + R) * e
                              + 19 * C * e)
    assert rows.rows_per_query == 2


def test_indexer_counts_only_visible_pairs():
    """Causal, the S queries the last S of T keys: the math scores S (T - S) + S (S + 1) / 2 pairs; 32-query by
    512-key tiles wholly above the diagonal are skipped."""
    kr = report()
    shape = dict(B=1, S=512, T=768, H=1, R=16, P=0, K=1, I=2, J=16)
    launch = kr.indexer_launch(torch.bfloat16, **shape)
    assert launch.consts["BLOCK_S"] == 32 and launch.consts["BLOCK_T"] == 512
    assert launch.min_flops == 2 * (512 * 256 + 512 * 513 // 2) * 2 * 16
    # query block i (queries 256 + 32 i ... 287 + 32 i) sees key tiles 0..(287 + 32 i) // 512: one tile for i < 8,
    # two for the 8 blocks after
    assert launch.flops == (8 * 1 + 8 * 2) * 2 * 32 * 512 * 2 * 16
