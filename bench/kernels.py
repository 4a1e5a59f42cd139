"""Ahead-of-time fitness of glm5f's Triton kernels (glm5f/kernels/triton_dsa.py) without a GPU: each compiled for sm_90a and
sm_100a, ptxas' registers, spills and shared memory, and its FLOPs and bytes per call against H100's roofline.

    python bench/kernels.py                                        # every kernel, arch, dtype and shape
    python bench/kernels.py --shapes tiny --archs sm_90a           # a subset
    python bench/kernels.py --shapes tiny --json                   # one JSON object per kernel row, for programs

Per row: the launch (blocks, warps), registers, spill stores (bytes), shared memory (KB); the call's minimum FLOPs and
bytes (each selected latent row read once per query, every other operand once) and the time they bound on H100
(989 TFLOP/s dense bf16 on tensor cores, 67 TFLOP/s fp32 on the CUDA cores, which run glm5f's IEEE fp32 dots;
3.35 TB/s); then what the kernel's tiles issue (each program's loads and dots, padded tiles included, all bytes
counted at HBM bandwidth though repeats of a query's rows mostly hit L2), the time at the same peaks and its ratio to
the bound. Exit code 1 when a kernel does not compile, spills, or needs more shared memory than a block may use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to keep it quiet

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import glm5f  # noqa: E402

ARCHS = {"sm_90a": 90, "sm_100a": 100}
SHARED_LIMIT = 227 * 1024  # bytes a block may use on sm_90 and sm_100 (228 KB per SM)
H100 = dict(bf16=989e12, fp32=67e12, bytes_per_s=3.35e12)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KERNELS = ("sparse_mla_fwd", "sparse_mla_bwd_dq", "sparse_mla_bwd_rows", "segment_sum", "indexer_scores")


def _shape(cfg: glm5f.GLM5Config, B: int, S: int) -> dict:
    """The kernels' sizes for a DSA layer of cfg, S queries over T = S keys: heads, value and rope channels, top-k,
    indexer heads and width."""
    return dict(B=B, S=S, T=S, H=cfg.num_attention_heads, R=cfg.kv_lora_rank, P=cfg.qk_rope_head_dim,
                K=cfg.index_topk, I=cfg.index_n_heads, J=cfg.index_head_dim)


SHAPES = {
    "glm5": _shape(glm5f.preset("glm5"), 1, 4096),  # 64 heads, C 576 = 512 + 64, K 2048, indexer 32 x 128
    # GLM-5.3's DSA layers (Transformers' glm5_next defaults): 64 heads, kv_lora_rank 512, qk_rope_head_dim 0,
    # indexer 32 x 128, top-k 2048
    "glm5.3": dict(B=1, S=4096, T=4096, H=64, R=512, P=0, K=2048, I=32, J=128),
    "tiny": _shape(glm5f.preset("glm5-tiny"), 2, 64),
}


@dataclasses.dataclass
class Launch:
    """One kernel call: its function, argument types and values, constexprs and options, and its counts."""
    kernel: str
    fn: object
    args: dict  # name: "*dtype" for a pointer, else the scalar's value
    consts: dict  # constexprs and launch options (num_warps, num_stages)
    flops: float  # what its tiles compute, padded tiles included
    bytes: float  # what its programs load and store
    min_flops: float  # what the math needs
    min_bytes: float  # each operand once (each selected latent row once per query)
    tensor_cores: bool
    rows_per_query: int = 0  # times each selected latent row is read per query (0: not a sparse MLA kernel)


def _ptr(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]


def _triton_dsa():
    """glm5f.kernels.triton_dsa, imported when first needed: a process that imported it with TRITON_INTERPRET=1 (the
    interpreter tests) holds interpreted kernels, which do not compile; run this file as its own process there."""
    from glm5f.kernels import triton_dsa
    return triton_dsa


def mla_launches(dtype: torch.dtype, B, S, T, H, R, P, K, block_h=None, block_k=None, **_) -> list[Launch]:
    """The sparse MLA forward, its two backward kernels and the segment sum, as glm5f.kernels.triton_dsa launches them
    (block_h, block_k: as its wrappers' overrides)."""
    triton_dsa = _triton_dsa()
    C, e, n = R + P, dtype.itemsize, B * S
    dt = _ptr(dtype)
    common = dict(q_ptr=dt, latent_ptr=dt, idx_ptr="*i64", allowed_ptr="*i1", bias_ptr="*i1", S=S, T=T, K=K, H=H, R=R,
                  C=C, scale=C ** -0.5)  # H, R, C: constexprs where the kernel takes them so
    select = K * (C * e + 8 + 1)  # one query's selected rows with their index and allowed flag
    out = []

    c = triton_dsa.mla_constants("forward", dtype, H, R, C, False, block_h, block_k)
    bh, bk, br, bp = c["BLOCK_H"], c["BLOCK_K"], c["BLOCK_R"], c["BLOCK_P"] if P else 0  # no rope: no dot
    blocks, kp = math.ceil(H / bh), math.ceil(K / bk) * bk
    out.append(Launch(
        "sparse_mla_fwd", triton_dsa._sparse_mla_fwd_kernel, dict(common, out_ptr=dt, lse_ptr="*fp32"), c,
        flops=n * blocks * 2 * bh * kp * (2 * br + bp), bytes=n * (blocks * select + H * (C + R) * e + H * 4),
        min_flops=n * 2 * H * K * (C + R), min_bytes=n * (select + H * (C + R) * e + H * 4),
        tensor_cores=c.get("DOT_PRECISION", "ieee") != "ieee", rows_per_query=blocks))

    c = triton_dsa.mla_constants("dq", dtype, H, R, C, False, block_h, block_k)
    bh, bk, br, bp = c["BLOCK_H"], c["BLOCK_K"], c["BLOCK_R"], c["BLOCK_P"] if P else 0  # no rope: no dot
    blocks, tiles, kp = math.ceil(H / bh), math.ceil(K / bk), math.ceil(K / bk) * bk
    per_query = H * (2 * C + R) * e + H * 8  # q, dout, dq; lse and delta
    products = 2 * br + bp  # q . row and dout . value over whole rows, or (fp32) over chunks of BLOCK_C channels
    issued = n * (blocks * select + per_query)
    if c["BLOCK_C"]:  # q and dout chunks again for every tile of selections, the rows again whole for dq
        products = _padded(C, c["BLOCK_C"]) + _padded(R, c["BLOCK_C"])
        issued += n * ((tiles - 1) * H * (C + R) * e + blocks * K * C * e)
    out.append(Launch(
        "sparse_mla_bwd_dq", triton_dsa._sparse_mla_bwd_dq_kernel,
        dict(common, dout_ptr=dt, lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr=dt), c,
        flops=n * blocks * 2 * bh * kp * (products + br + bp), bytes=issued,
        min_flops=n * 2 * H * K * (2 * C + R), min_bytes=n * (select + per_query),
        tensor_cores=c.get("DOT_PRECISION", "ieee") != "ieee", rows_per_query=blocks * (2 if c["BLOCK_C"] else 1)))

    c = triton_dsa.mla_constants("rows", dtype, H, R, C, False, block_h, block_k)
    bh, bk, br, bp = c["BLOCK_H"], c["BLOCK_K"], c["BLOCK_R"], c["BLOCK_P"] if P else 0  # no rope: no dot
    tiles, hp = math.ceil(K / bk), math.ceil(H / bh) * bh
    heads = H * (C + R) * e + H * 8  # q, dout, lse and delta of all heads: every tile of the query loads them
    products = 2 * br + bp
    issued = n * (select + tiles * (heads + 1) + K * C * e)
    if c["BLOCK_C"]:  # every head block reads the tile's rows in chunks, and q and dout in chunks too
        products = _padded(C, c["BLOCK_C"]) + _padded(R, c["BLOCK_C"])
        issued += n * ((hp // bh - 1) * K * C * e + tiles * H * (C + R) * e)
    out.append(Launch(
        "sparse_mla_bwd_rows", triton_dsa._sparse_mla_bwd_rows_kernel,
        dict(common, dout_ptr=dt, lse_ptr="*fp32", delta_ptr="*fp32", has_key_ptr="*i1", drow_ptr=dt,
             first_query=0), c,
        flops=n * tiles * 2 * hp * bk * (products + 2 * br + bp), bytes=issued,
        min_flops=n * 2 * H * K * (2 * C + 2 * R), min_bytes=n * (select + heads + 1 + K * C * e),
        tensor_cores=c.get("DOT_PRECISION", "ieee") != "ieee", rows_per_query=hp // bh if c["BLOCK_C"] else 1))

    c = triton_dsa.segment_sum_constants(C)
    col_blocks = math.ceil(C / c["BLOCK_C"])
    gathered = n * K * C * e + 2 * B * T * C * e  # the row gradients once, dlatent read and written
    out.append(Launch(
        "segment_sum", triton_dsa._segment_sum_kernel, dict(drow_ptr=dt, order_ptr="*i64", starts_ptr="*i64",
                                                           dlatent_ptr=dt, C=C), c,
        flops=n * K * C, bytes=gathered + col_blocks * (n * K + 2 * B * T) * 8, min_flops=n * K * C,
        min_bytes=gathered + (n * K + B * T) * 8, tensor_cores=False))
    return out


def _padded(n: int, block: int) -> int:
    return math.ceil(n / block) * block


def indexer_launch(dtype: torch.dtype, B, S, T, I, J, **_) -> Launch:
    """The indexer's scores over all S queries (one chunk), causal: the queries are the last S of T keys. Tiles above
    the diagonal skip the head loop; only the visible (query, key) pairs count towards the minimum."""
    triton_dsa = _triton_dsa()
    c = triton_dsa.indexer_constants(dtype, J)
    bs, bt, e = c["BLOCK_S"], c["BLOCK_T"], dtype.itemsize
    dt = _ptr(dtype)
    args = dict(q_ptr=dt, w_ptr=dt, keys_ptr=dt, q_index_ptr="*i64", key_valid_ptr="*i64", q_segment_ptr="*i64",
                k_segment_ptr="*i64", dense_ptr="*i64", bias_ptr="*i64", out_ptr="*fp32", S=S, T=T, I=I, J=J,
                first=0, n=S, key_valid_sb=0, q_segment_sb=0, k_segment_sb=0, dense_sb=0, bias_sb=0,
                scale=J ** -0.5)
    consts = dict(c, HAS_KEY_VALID=False, HAS_SEGMENTS=False, HAS_DENSE=False, HAS_BIAS=False)
    s_blocks = math.ceil(S / bs)
    live = sum(min(math.ceil(T / bt), (T - S + min(S, (i + 1) * bs) - 1) // bt + 1) for i in range(s_blocks))
    visible = S * (T - S) + S * (S + 1) // 2
    flops = B * live * 2 * bs * bt * I * c["BLOCK_J"]
    loads = B * live * (bs * I * (J + 1) + bt * J) * e + B * s_blocks * math.ceil(T / bt) * bs * (bt * 4 + 8)
    return Launch("indexer_scores", triton_dsa._indexer_scores_kernel, args, consts, flops=flops, bytes=loads,
                  min_flops=B * visible * 2 * I * J,
                  min_bytes=B * (S * I * (J + 1) * e + T * J * e + S * T * 4 + S * 8),
                  tensor_cores=c.get("DOT_PRECISION", "ieee") != "ieee")


def launches(shape: dict, dtype: torch.dtype) -> list[Launch]:
    return mla_launches(dtype, **shape) + [indexer_launch(dtype, **shape)]


def compile_launch(launch: Launch, arch: str, keep_ptx: bool = False) -> dict:
    """Compile for arch as Triton's launcher would specialise these arguments (pointers 16-byte aligned, integers
    divisible by 16 marked so, 1 a constant); ptxas-blackwell -v reads the PTX. {regs, spills, shared}, and the
    PTX as "ptx" with keep_ptx."""
    names = launch.fn.arg_names
    consts = {k: v for k, v in launch.consts.items() if k not in ("num_warps", "num_stages")}
    options = {k: launch.consts[k] for k in ("num_warps", "num_stages") if k in launch.consts}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        value = launch.args.get(name)
        if name in consts:
            signature[name] = "constexpr"
        elif isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [n for n in names if n not in signature and n not in consts]
    if missing:
        raise ValueError(f"{launch.kernel}: no type or value for {missing}")
    kernel = triton.compile(ASTSource(launch.fn, signature, consts, attrs),
                            target=GPUTarget("cuda", ARCHS[arch], 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([PTXAS, "-v", f"--gpu-name={arch}", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    if res.returncode or not (regs and spills):
        raise RuntimeError(f"ptxas on {launch.kernel} for {arch} failed:\n{log[-2000:]}")
    out = dict(regs=int(regs.group(1)), spills=int(spills.group(1)), shared=kernel.metadata.shared)
    return dict(out, ptx=kernel.asm["ptx"]) if keep_ptx else out


def roofline(launch: Launch, dtype: torch.dtype) -> tuple[float, float]:
    """(bound, estimate) in seconds on H100: the minimum's and the issued counts' max(FLOPs / peak, bytes / BW)."""
    math_peak = H100["fp32" if dtype == torch.float32 else "bf16"]
    issued_peak = H100["bf16"] if launch.tensor_cores and dtype != torch.float32 else H100["fp32"]
    bound = max(launch.min_flops / math_peak, launch.min_bytes / H100["bytes_per_s"])
    estimate = max(launch.flops / issued_peak, launch.bytes / H100["bytes_per_s"])
    return bound, estimate


def shape_label(shape: dict) -> str:
    return "B{B} S{S} H{H} C{R}+{P} K{K} I{I}x{J}".format(**shape)


def report(shapes=tuple(SHAPES), archs=tuple(ARCHS), dtypes=tuple(DTYPES), kernels=KERNELS) -> list[dict]:
    """One row per kernel, arch, dtype and shape; a compile failure is a row with its error."""
    rows = []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for launch in launches(shape, dtype):
                if launch.kernel not in kernels:
                    continue
                bound, estimate = roofline(launch, dtype)
                for arch in archs:
                    row = dict(kernel=launch.kernel, arch=arch, dtype=dtype_name, shape=shape_name,
                               blocks=_blocks(launch.consts), gflop=launch.min_flops / 1e9,
                               mbytes=launch.min_bytes / 1e6, bound_us=bound * 1e6,
                               issued_gflop=launch.flops / 1e9, issued_mbytes=launch.bytes / 1e6,
                               estimate_us=estimate * 1e6, rows_per_query=launch.rows_per_query)
                    t0 = time.perf_counter()
                    try:
                        row.update(compile_launch(launch, arch), error=None)
                    except Exception as e:  # a compile error is a failed row, reported with the others
                        row.update(regs=0, spills=0, shared=0, error=f"{type(e).__name__}: {e}"[:300])
                    row["compile_s"] = time.perf_counter() - t0
                    row["ok"] = row["error"] is None and row["spills"] == 0 and row["shared"] <= SHARED_LIMIT
                    rows.append(row)
    return rows


def _blocks(consts: dict) -> str:
    sizes = [f"{k[6:]}{v}" for k, v in consts.items() if k.startswith("BLOCK_") and k not in ("BLOCK_R", "BLOCK_P",
                                                                                             "BLOCK_J")]
    return " ".join(sizes) + f" w{consts.get('num_warps', 4)} s{consts.get('num_stages', 3)}"


HEADER = (f"{'kernel':<20}{'arch':<8}{'dtype':<6}{'shape':<7}{'blocks':<19}{'regs':>5}{'spill':>7}{'smem KB':>8}"
          f"{'GFLOP':>10}{'MB':>9}{'bound us':>10}{'issued GFLOP':>14}{'MB':>9}{'est us':>9}{'est/bound':>10}"
          f"{'reads/q':>8}")


def format_row(r: dict, measured: str = "") -> str:
    if r["error"]:
        return f"{r['kernel']:<20}{r['arch']:<8}{r['dtype']:<6}{r['shape']:<7}COMPILE ERROR {r['error']}"
    flag = "" if r["ok"] else "  <- " + ("spills" if r["spills"] else "shared memory over 227 KB")
    return (f"{r['kernel']:<20}{r['arch']:<8}{r['dtype']:<6}{r['shape']:<7}{r['blocks']:<19}{r['regs']:>5}"
            f"{r['spills']:>7}{r['shared'] / 1024:>8.0f}{r['gflop']:>10.4g}{r['mbytes']:>9.1f}{r['bound_us']:>10.1f}"
            f"{r['issued_gflop']:>14.4g}{r['issued_mbytes']:>9.1f}{r['estimate_us']:>9.1f}"
            f"{r['estimate_us'] / max(r['bound_us'], 1e-12):>10.2f}{r['rows_per_query'] or '':>8}{measured}{flag}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="with no value (or -): print one JSON object per kernel row instead of the table (the "
                         "summary line goes to stderr); with a path: also write the rows to that file")
    ap.add_argument("--fla", nargs="?", const="all", default=None, choices=["all", "first"],
                    help="then fla-core's KDA kernels (bench/kernels_fla.py): every autotune config, or each first")
    args = ap.parse_args(argv)
    if os.environ.pop("TRITON_INTERPRET", None) and "glm5f.kernels.triton_dsa" in sys.modules:
        print("error: glm5f.kernels.triton_dsa was imported with TRITON_INTERPRET set (interpreted kernels do not compile); "
              "run bench/kernels.py as its own process", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = report(args.shapes, args.archs, args.dtypes, args.kernels)
    as_lines = args.json == "-"
    if as_lines:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        for name in args.shapes:
            print(f"{name}: {shape_label(SHAPES[name])}")
        print(HEADER)
        for r in rows:
            print(format_row(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} kernels compiled in {time.perf_counter() - t0:.0f} s; "
          + ("all fit" if not failed else f"{len(failed)} FAIL (compile error, spills or shared memory)"),
          file=sys.stderr if as_lines else sys.stdout)
    code = 1 if failed else 0
    if args.fla:  # fla's kernels are not glm5f's: their spills are reported, not failed on
        from bench import kernels_fla
        shapes = [s for s in args.shapes if s in kernels_fla.SHAPES] or list(kernels_fla.SHAPES)
        print()
        code = max(code, kernels_fla.main(["--shapes", *shapes, "--archs", *args.archs, "--dtypes", *args.dtypes,
                                           "--configs", args.fla]))
    return code


if __name__ == "__main__":
    sys.exit(main())
