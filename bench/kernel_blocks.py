"""The trade-off behind glm5f.kernels.triton_dsa's block choices: one kernel at a shape, compiled for sm_90a per candidate
blocks, with its registers, spills, what its tiles issue per query and the spill traffic of its loops.

    python bench/kernel_blocks.py sparse_mla_bwd_dq fp32 32,32,16,8 16,16,0,8   # H,K,C,warps (C: fp32 chunk, 0 whole)
    python bench/kernel_blocks.py sparse_mla_bwd_dq fp32 16,16,0,8 --json       # one JSON object per candidate

Spill traffic: the local loads and stores (LDL, STL) in the SASS of the kernel's outermost loop, bytes a thread per
iteration; those inside an inner loop (the fp32 channel chunks) counted once per chunk. Per query: times the threads,
the loop's iterations and the programs of a query ((K / BLOCK_K) x (H / BLOCK_H) for every sparse MLA kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels as report  # noqa: E402  (bench/kernels.py)

KEYS = {"sparse_mla_fwd": "forward", "sparse_mla_bwd_dq": "dq", "sparse_mla_bwd_rows": "rows"}
CUOBJDUMP = os.path.join(os.path.dirname(report.PTXAS), "cuobjdump")


def loop_spills(ptx: str, arch: str, chunks: int) -> tuple[int, int]:
    """(bytes a thread moves to and from local memory per iteration of the outermost loop, the share of it inside
    inner loops, counted `chunks` times)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        subprocess.run([report.PTXAS, f"--gpu-name={arch}", path, "-o", path + ".cubin"], check=True)
        sass = subprocess.run([CUOBJDUMP, "-sass", path + ".cubin"], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, op in code if (m := re.search(r"BRA\s+0x([0-9a-f]+)", op))
             and int(m.group(1), 16) < a]
    if not loops:
        return 0, 0
    outer = max(loops, key=lambda lo_hi: lo_hi[1] - lo_hi[0])
    inner = [lo_hi for lo_hi in loops if lo_hi != outer and outer[0] <= lo_hi[0] and lo_hi[1] <= outer[1]]
    total = in_inner = 0
    for a, op in code:
        m = re.search(r"\b(?:LDL|STL)(?:\.(\w+))?", op)
        if not m or not outer[0] <= a <= outer[1]:
            continue
        width = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(m.group(1), 4)
        if any(lo <= a <= hi for lo, hi in inner):
            in_inner += width * chunks
        else:
            total += width
    return total + in_inner, in_inner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=list(KEYS))
    ap.add_argument("dtype", choices=list(report.DTYPES))
    ap.add_argument("blocks", nargs="+", help="H,K,C,warps (C ignored by the forward)")
    ap.add_argument("--shape", default="glm5", choices=list(report.SHAPES))
    ap.add_argument("--arch", default="sm_90a", choices=list(report.ARCHS))
    ap.add_argument("--json", action="store_true", help="print one JSON object per candidate instead of the table")
    args = ap.parse_args(argv)
    triton_dsa = report._triton_dsa()
    shape, dtype = report.SHAPES[args.shape], report.DTYPES[args.dtype]
    kind = "fp32" if args.dtype == "fp32" else "half"
    n = shape["B"] * shape["S"]
    if not args.json:
        print(f"{args.kernel} {args.dtype} {args.shape} {args.arch}: blocks, regs / spill B / smem KB, issued MB a "
              f"query (x the minimum), est/bound, spill traffic MB a query (of it in inner loops)")
    for text in args.blocks:
        bh, bk, bc, warps = map(int, text.split(","))
        stages = triton_dsa.MLA_BLOCKS[KEYS[args.kernel]][kind][4]
        triton_dsa.MLA_BLOCKS[KEYS[args.kernel]][kind] = (bh, bk, bc, warps, stages)
        launch = next(x for x in report.launches(shape, dtype) if x.kernel == args.kernel)
        r = report.compile_launch(launch, args.arch, keep_ptx=True)
        bound, estimate = report.roofline(launch, dtype)
        chunks = math.ceil((shape["R"] + shape["P"]) / bc) if bc and args.kernel != "sparse_mla_fwd" else 1
        per_iter, inner = loop_spills(r["ptx"], args.arch, chunks) if r["spills"] else (0, 0)
        c = launch.consts
        scale = 32 * warps * math.ceil(shape["K"] / c["BLOCK_K"]) * math.ceil(shape["H"] / c["BLOCK_H"]) / 1e6
        row = dict(kernel=args.kernel, dtype=args.dtype, shape=args.shape, arch=args.arch, H=c["BLOCK_H"],
                   K=c["BLOCK_K"], C=c.get("BLOCK_C", 0), warps=warps, regs=r["regs"], spills=r["spills"],
                   shared=r["shared"], issued_mb_per_query=launch.bytes / n / 1e6,
                   issued_over_minimum=launch.bytes / launch.min_bytes, est_over_bound=estimate / bound,
                   spill_mb_per_query=per_iter * scale, inner_spill_mb_per_query=inner * scale)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(f"  H{row['H']} K{row['K']} C{row['C']} w{warps}: {r['regs']} / {r['spills']} / "
              f"{r['shared'] / 1024:.0f}, {row['issued_mb_per_query']:.1f} MB (x{row['issued_over_minimum']:.2f}), "
              f"{row['est_over_bound']:.2f}, {row['spill_mb_per_query']:.1f} ({row['inner_spill_mb_per_query']:.1f})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
