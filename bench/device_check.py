"""One command that checks glm5f on an accelerator and prints one table: the kernels against the fp64 oracle, the
whole model against CPU fp64, KDA (fla's chunk_kda and glm5f's op) against its fp64 recurrence, a short bf16 run
beside CPU fp32, tokens/s and MFU, long-context attention, and peak memory against --plan.

    python bench/device_check.py                  # CUDA (the Triton kernels), about 6 minutes on one H200
    python bench/device_check.py --device cpu     # the same code at tiny sizes, about a minute (CI)

Each row: what was checked, its setting, the measured value, its bound (derived where stated), ok. Before them,
bench/kernels.py's ahead-of-time table of the Triton kernels (registers, spills, shared memory, FLOPs and bytes
against H100's roofline), with each kernel's measured time on a GPU. The exit code
is 1 when a row fails. Bounds: fp32 kernels 1e-5 relative (the issue's); bf16 kernels 4 x 2^-8 (four bf16
roundings on the longest path: the probabilities or score gradients, the product, the output); the bf16 model's
logits and gradients 16 x 2^-8 in norm (the weights themselves rounded, and roundings compounding over the
layers); the bf16 loss curve 4 x 2^-8 relative to the fp32 one; the plan's peak within 25% of the measured one; KDA's
in KDA_BOUNDS. On CUDA fla's autotuner compiles and times every config of its kernels at their first call per shape
and dtype (bench/kernels_fla.py counts them: minutes); here each kernel keeps its first config untimed unless
--fla-autotune is passed, so the KDA times are those of fla's first configs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import glm5f  # noqa: E402
from bench.common import BENCH_MODEL, matmul_peak_flops  # noqa: E402
from glm5f.kernels import dsa as kernels  # noqa: E402
from glm5f.model.env import Mask, make_mask  # noqa: E402
from glm5f.core.flops import flops_per_token  # noqa: E402
from glm5f.run.plan import plan, process_rss_bytes, run_shape  # noqa: E402

BF16 = 2.0 ** -8
# per device: the kernels' shapes (B, S, T, H, R, P, K; I, J), the model check's, the training run's, the speed
# configs (name, preset overrides, batch, seq) and the attention lengths
SIZES = {
    "cuda": dict(kernel=(2, 1024, 4096, 16, 512, 64, 2048, 32, 128), model=("bench", 2, 1024),
                 train=("glm5-scaled-moe", 50, 4, 512),
                 speed=[("bench", 8, 4096), ("large", 2, 4096)], attention=(8192, 32768, 131072)),
    "cpu": dict(kernel=(2, 48, 64, 4, 32, 8, 16, 4, 16), model=("tiny", 2, 32), train=("glm5-tiny", 4, 2, 32),
                speed=[("tiny", 2, 64)], attention=(64, 128, 256)),
}
# the KDA checks' shapes (B, T, H, d_k = d_v, heads the fp64 recurrence checks): a small one, GLM-5.3's layer; the
# recurrence keeps a state per token for its backward, so at GLM-5.3's size it checks the first two heads (each head
# is the same program on its own slice)
SIZES["cuda"]["kda"] = [(2, 512, 4, 64, 4), (1, 4096, 64, 128, 2)]
SIZES["cpu"]["kda"] = [(2, 64, 2, 16, 2)]  # glm53-tiny's heads
# GLM-5's widths, 4 layers, 16 experts: 5.6B parameters; its step at B2 x S4096 in bf16 with fp32 params and
# gradients plans to 97 GB (glm5f.run.plan: params, gradients, gathered bf16 weights, activations) of an H200's 141
LARGE = dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16, index_topk_pattern=None,
             max_position_embeddings=8192)


def model_cfg(name: str, seq: int) -> glm5f.GLM5Config:
    if name == "bench":
        return glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "num_hidden_layers": 4, "index_topk": 512,
                                            "max_position_embeddings": max(4096, seq)})
    if name == "large":
        return glm5f.preset("glm5", **LARGE)
    return glm5f.preset("glm5-tiny", index_topk=16, max_position_embeddings=max(2048, seq))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_bytes(device: str) -> int:
    """Peak memory since the last `reset_peak`: allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return process_rss_bytes("VmHWM")


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in fp64 on the CPU."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def row(rows: list, check: str, setting: str, value: float, bound: float | None, unit: str = "",
        ok: bool = True) -> None:
    rows.append((check, setting, value, bound, unit, ok and (bound is None or value <= bound)))
    print(f"  {check:<28}{setting:<34}{value:>12.3g}{unit:<6}" + ("" if bound is None else f" <= {bound:.3g}"),
          flush=True)


# ---- kernels against the fp64 oracle ------------------------------------------------------------------------------

def kernel_inputs(B, S, T, H, R, P, K, I, J, gen):
    """fp64 CPU inputs of both ops: queries at the last S of T positions of two packed documents per row."""
    pos = torch.cat([torch.arange(T // 3), torch.arange(T - T // 3)]).expand(B, T)
    mask = make_mask(None, pos, torch.arange(T - S, T))
    qi, wi, ki = (torch.randn(B, S, I, J, generator=gen, dtype=torch.float64),
                  torch.randn(B, S, I, generator=gen, dtype=torch.float64),
                  torch.randn(B, T, J, generator=gen, dtype=torch.float64))
    q = torch.randn(B, S, H, R + P, generator=gen, dtype=torch.float64)
    latent = torch.randn(B, T, R + P, generator=gen, dtype=torch.float64)
    return mask, (qi, wi, ki), q, latent


def index_scores(qi, wi, ki, mask):
    """The oracle's index scores [B, S, T] in fp64, -inf where masked."""
    z = torch.einsum("bsij,btj->bsit", qi.double(), ki.double()) * qi.shape[-1] ** -0.5
    scores = torch.einsum("bsi,bsit->bst", wi.double(), z.relu())
    return scores.masked_fill(~mask.rows(0, qi.shape[1]), float("-inf"))


def check_kernels(rows, device, shape, gen):
    B, S, T, H, R, P, K, I, J = shape
    mask, (qi, wi, ki), q64, latent64 = kernel_inputs(B, S, T, H, R, P, K, I, J, gen)
    scale = (R + P) ** -0.5
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 4 * BF16)):
        name = str(dtype).replace("torch.", "")
        # the indexer: the picks' total oracle score against the oracle's own top-k (ties may pick other keys)
        q_d, w_d, k_d = (t.to(dtype) for t in (qi, wi, ki))
        dmask = Mask(mask.q_index.to(device), T, q_segment=mask.q_segment.to(device),
                               k_segment=mask.k_segment.to(device))
        idx = kernels.indexer_topk(q_d.to(device), w_d.to(device).float(), k_d.to(device),
                                   dmask.q_index, None, dmask.q_segment, dmask.k_segment, None, None, K).cpu()
        oracle = index_scores(q_d, w_d, k_d, mask)
        best = oracle.topk(K, dim=-1).values
        picked = oracle.gather(-1, idx)
        finite = best.isfinite()
        gap = float(((best - picked).where(finite, 0).sum(-1).abs() / best.where(finite, 0).abs().sum(-1)
                     .clamp(min=1e-30)).max())
        row(rows, "indexer top-k vs fp64", f"{name} B{B} S{S} T{T} K{K}", gap, 1e-5 * J)
        # sparse MLA forward and backward, on the dtype-rounded inputs (the oracle sees the same numbers)
        q, latent = q64.to(dtype), latent64.to(dtype)
        allowed = mask.at(idx)
        qd = q.to(device).requires_grad_()
        ld = latent.to(device).requires_grad_()
        out = kernels.sparse_mla(qd, ld, idx.to(device), allowed.to(device), None, scale, R)[0]
        dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        dq, dl = torch.autograd.grad(out, [qd, ld], dout.to(device, dtype))
        qo, lo = q.double().requires_grad_(), latent.double().requires_grad_()
        ref = kernels.sparse_attention_unblocked(qo, lo, idx, allowed, scale, R)
        rdq, rdl = torch.autograd.grad(ref, [qo, lo], dout)
        err = max(rel(out, ref), rel(dq, rdq), rel(dl, rdl))
        row(rows, "sparse MLA fwd+bwd vs fp64", f"{name} B{B} S{S} T{T} H{H} K{K}", err, bound)


# ---- kernel fitness: bench/kernels.py's ahead-of-time table, with each kernel's measured time on a device ---------

KERNEL_NAMES = {"_sparse_mla_fwd_kernel": "sparse_mla_fwd", "_sparse_mla_bwd_dq_kernel": "sparse_mla_bwd_dq",
                "_sparse_mla_bwd_rows_kernel": "sparse_mla_bwd_rows", "_segment_sum_kernel": "segment_sum",
                "_indexer_scores_kernel": "indexer_scores"}


def measure_kernels(device, shape, dtype) -> dict:
    """Device microseconds of each Triton kernel for one call at shape (summed over its launches, as the report
    counts them): sparse MLA forward and backward over random causal picks, the indexer's scores of all queries."""
    from glm5f.kernels import triton_dsa
    B, S, T, H, R, P, K, I, J = (shape[k] for k in "B S T H R P K I J".split())
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(B, S, H, R + P, device=device, dtype=dtype, generator=g)
    latent = torch.randn(B, T, R + P, device=device, dtype=dtype, generator=g)
    idx = torch.randint(0, T, (B, S, K), device=device, generator=g)
    q_index = torch.arange(T - S, T, device=device)
    allowed = idx <= q_index[None, :, None]
    dout = torch.randn(B, S, H, R, device=device, dtype=dtype, generator=g)
    qi = torch.randn(B, S, I, J, device=device, dtype=dtype, generator=g)
    wi = torch.randn(B, S, I, device=device, dtype=dtype, generator=g)
    ki = torch.randn(B, T, J, device=device, dtype=dtype, generator=g)
    scale = (R + P) ** -0.5

    def calls():
        out, lse = triton_dsa.sparse_mla_forward(q, latent, idx, allowed, None, scale, R)
        triton_dsa.sparse_mla_backward(dout, q, latent, idx, allowed, None, out, lse, scale)
        triton_dsa.indexer_scores(qi, wi, ki, q_index, None, None, None, None, None, 0, S)

    calls()  # compiles
    sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        calls()
        sync(device)
    times = {}
    for event in prof.key_averages():
        kernel = next((k for name, k in KERNEL_NAMES.items() if name in event.key), None)
        if kernel:
            times[kernel] = times.get(kernel, 0.0) + event.device_time_total
    return times


def check_kernel_fitness(rows, device):
    """bench/kernels.py's table: at GLM-5's shapes for this GPU's architecture with measured times beside the
    estimates, or at the tiny shapes for sm_90a on the CPU. Spills are reported here (bench/kernels.py's test is
    their gate)."""
    from bench import kernels as report
    if device.startswith("cuda"):
        arch = {9: "sm_90a", 10: "sm_100a"}.get(torch.cuda.get_device_capability()[0])
        shapes, dtypes = ["glm5"], ["bf16", "fp32"]
    else:
        arch, shapes, dtypes = "sm_90a", ["tiny"], ["bf16"]
    if arch is None:
        print(f"    kernel report: no ahead-of-time target for {torch.cuda.get_device_name()} (sm_90a, sm_100a)")
        return
    with tempfile.TemporaryDirectory() as tmp:  # its own process: compiling needs kernels not interpreted
        path = os.path.join(tmp, "rows.json")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernels.py"), "--shapes", *shapes,
                              "--archs", arch, "--dtypes", *dtypes, "--json", path], env=env, capture_output=True,
                             text=True)
        if not os.path.exists(path):
            row(rows, "kernel report", f"{arch} {' '.join(shapes)}", res.returncode, 0, ok=False)
            print(res.stdout[-2000:] + res.stderr[-3000:])
            return
        with open(path) as f:
            table = json.load(f)
    measured = {d: measure_kernels(device, report.SHAPES[shapes[0]], report.DTYPES[d]) for d in dtypes
                if device.startswith("cuda")}
    print(report.HEADER + f"{'measured us':>13}")
    for r in table:
        us = measured.get(r["dtype"], {}).get(r["kernel"])
        print(report.format_row(r, "" if us is None else f"{us:>13.1f}"))
    for r in table:
        us = measured.get(r["dtype"], {}).get(r["kernel"])
        setting = f"{r['kernel']} {r['dtype']} {arch} {r['shape']}"
        row(rows, "kernel spill bytes", setting, r["spills"], None, ok=r["error"] is None)
        if us is not None:
            row(rows, "kernel time / H100 estimate", setting, us / r["estimate_us"], None)


# ---- KDA: fla's chunk_kda (glm5f.kernels.kda.kda on CUDA) and glm5f's own op against the fp64 recurrence --------------------

def kda_inputs(B, T, H, K, gen):
    """fp64 CPU inputs of the delta rule as GLM-5.3's layer makes them: L2-normalised q and k, g in (-5, 0) (the
    forget gate's lower bound -5), beta in (0, 1), an initial state; and the output's and final state's gradients."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = (torch.nn.functional.normalize(randn(B, T, H, K), dim=-1) for _ in range(2))
    g, beta = -5 * torch.sigmoid(randn(B, T, H, K)), torch.sigmoid(randn(B, T, H))
    return (q, k, randn(B, T, H, K), g, beta, randn(B, H, K, K)), (randn(B, T, H, K), randn(B, H, K, K))


def kda_grads(fn, inputs, cotangents, device, heads=None):
    """(o, final state, gradients of q, k, v, g, beta and the initial state) of fn on the device, for the first
    `heads` heads (all by default)."""
    sl = slice(None, heads)
    leaves = [x[:, :, sl].to(device) for x in inputs[:5]] + [inputs[5][:, sl].to(device)]
    leaves = [x.detach().requires_grad_() for x in leaves]
    o, state = fn(*leaves[:5], leaves[5])
    do, dstate = cotangents[0][:, :, sl].to(device, o.dtype), cotangents[1][:, sl].to(device, state.dtype)
    return [o, state, *torch.autograd.grad((o, state), leaves, (do, dstate))]


KDA_HEAD_AXES = (2, 1, 2, 2, 2, 2, 2, 1)  # the heads' axis of o, the final state and the six gradients
KDA_BOUNDS = {  # max relative error over o, the final state and the six gradients, against the fp64 recurrence
    # glm5f's op computes in fp32 (v and beta rounded to bf16 are the oracle's inputs too): fp32 roundings over the
    # chunk's triangular solve and the chain of chunk states (measured 4e-6 on the CPU at T 1024, K 128); in bf16
    # the gradients of v and beta are bf16: one rounding (measured 2.3e-3)
    ("glm5f kda_op", "fp32"): 1e-4, ("glm5f kda_op", "bf16"): BF16,
    # fla's kernels keep their intermediates (w, u, the chunk states) in the inputs' dtype and multiply fp32 in TF32
    # (2^-11); q and k are rounded to bf16 in the bf16 layer (glm5f.kernels.kda.fla_kda): 16 roundings, as the model's bound
    ("fla chunk_kda", "fp32"): 16 * 2.0 ** -11, ("fla chunk_kda", "bf16"): 16 * BF16,
}


def untimed_autotune() -> None:
    """Triton's autotuners keep their first config without timing the others (so without compiling them): the device
    check's minutes do not cover fla's hundreds of configs (--fla-autotune times them all, as training does)."""
    from triton.runtime.autotuner import Autotuner
    Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]


def check_kda(rows, device, shapes, gen, steps):
    """glm5f.kernels.kda.kda (fla-core's chunk_kda on CUDA when installed) and glm5f's op (`kda_op`) in the dtypes GLM-5.3's
    KDA layer passes under --train.dtype float32 and bfloat16 (q, k, g in fp32; v and beta in the layer's dtype),
    against kda_recurrent in fp64 on the same rounded inputs: output, final state and every input gradient; and
    each side's forward + backward time."""
    from glm5f.kernels import kda as kda_module
    fla = device.startswith("cuda") and kda_module._fla_chunk_kda() is not None
    if not fla:
        print("    KDA: fla's chunk_kda skipped ("
              + ("no CUDA device" if not device.startswith("cuda") else "fla-core is not installed") + ")")

    def op(q, k, v, g, beta, h0):
        return kda_module.kda_op(q, k, v, g, beta, h0, None, q.shape[-1] ** -0.5, kda_module.CHUNK)[:2]

    def recurrent(q, k, v, g, beta, h0):
        return kda_module.kda_recurrent(q, k, v, g, beta, q.shape[-1] ** -0.5, h0)

    def kda(q, k, v, g, beta, h0):
        return kda_module.kda(q, k, v, g, beta, None, h0)

    sides = ([("fla chunk_kda", kda)] if fla else []) + [("glm5f kda_op", op)]
    for B, T, H, K, oracle_heads in shapes:
        inputs64, cotangents = kda_inputs(B, T, H, K, gen)
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            dtypes = (torch.float32, torch.float32, dtype, torch.float32, dtype, torch.float32)
            # what the layer passes, on the device once (the times are the op's), and the oracle's inputs
            inputs = [x.to(device, d) for x, d in zip(inputs64, dtypes)]
            ref = kda_grads(recurrent, [x.double() for x in inputs], [c.to(device) for c in cotangents], device,
                            oracle_heads)
            cotangents_fp32 = [c.to(device, torch.float32) for c in cotangents]  # o (in q's dtype) and the state
            setting = f"{dtype_name} B{B} T{T} H{H} K{K}"
            for name, fn in sides:
                try:
                    got = kda_grads(fn, inputs, cotangents_fp32, device)
                except Exception as e:  # fla's kernels failing to compile or launch is this check's finding
                    print(f"    {name} {setting}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
                    row(rows, f"KDA {name} vs fp64", setting, float("inf"), KDA_BOUNDS[name, dtype_name], ok=False)
                    continue
                err = max(rel(a.narrow(axis, 0, oracle_heads), b) for a, b, axis in zip(got, ref, KDA_HEAD_AXES))
                row(rows, f"KDA {name} vs fp64", setting + (f" ({oracle_heads} heads)" if oracle_heads < H else ""),
                    err, KDA_BOUNDS[name, dtype_name])
                seconds = median_time(lambda: kda_grads(fn, inputs, cotangents_fp32, device), device, steps)
                row(rows, "KDA fwd+bwd time", f"{name} {setting}", seconds, None, " s")
                del got


# ---- the whole model: bf16 on the device against fp64 on the CPU -------------------------------------------------

def loss_and_grads(params, cfg, ids):
    leaves = {k: t.detach().requires_grad_() for k, t in glm5f.flatten(params).items()
              if not glm5f.core.params.is_buffer(k)}
    tree = glm5f.core.params.unflatten({**glm5f.flatten(params), **leaves}, params)
    logits = glm5f.forward(tree, cfg, ids)
    grads = torch.autograd.grad(glm5f.causal_lm_loss(logits, ids), list(leaves.values()), allow_unused=True)
    return logits, {k: g for k, g in zip(leaves, grads) if g is not None}


def check_model(rows, device, size, gen):
    name, B, S = size
    cfg = model_cfg(name, S)
    params = glm5f.init_params(cfg, seed=0, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    ref_logits, ref_grads = loss_and_grads(params, cfg, ids)
    bf = {k: v.to(device, torch.bfloat16) for k, v in glm5f.flatten(params).items()}
    logits, grads = loss_and_grads(glm5f.core.params.unflatten(bf, params), cfg, ids.to(device))
    logits_err = float((logits.detach().cpu().double() - ref_logits.detach()).norm() / ref_logits.detach().norm())
    row(rows, "model logits vs CPU fp64", f"bf16 {name} B{B} S{S} (norm)", logits_err, 16 * BF16)
    num = sum(float((grads[k].cpu().double() - g).norm() ** 2) for k, g in ref_grads.items())
    den = sum(float(g.norm() ** 2) for g in ref_grads.values())
    row(rows, "model gradients vs CPU fp64", f"bf16 {name} B{B} S{S} (norm)", (num / den) ** 0.5, 16 * BF16)


# ---- training: bf16 on the device beside fp32 on the CPU; the device run's peak against --plan --------------------

def train_run(preset, steps, B, S, dtype, device, out):
    import tyro
    from configs import Config
    from train import train
    cfg = tyro.cli(Config, use_underscores=True, args=[
        "--model.preset", preset, "--data.type", "synthetic", "--data.batch_size", str(B), "--data.seq_len", str(S),
        "--train.steps", str(steps), "--train.dtype", dtype, "--train.device", device, "--checkpoint.dir", out,
        "--checkpoint.every", "0", "--eval.every", "0", "--train.log_every", str(max(1, steps // 5))])
    with contextlib.redirect_stdout(io.StringIO()):  # the runs' progress lines
        return cfg, [r["loss"] for r in train(cfg)]


def check_training(rows, device, size, out_dir):
    preset, steps, B, S = size
    _, ref = train_run(preset, steps, B, S, "float32", "cpu", os.path.join(out_dir, "cpu-fp32"))
    reset_peak(device)
    runtime = 0 if device.startswith("cuda") else process_rss_bytes()
    cfg, got = train_run(preset, steps, B, S, "bfloat16", device, os.path.join(out_dir, "device-bf16"))
    diff = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    row(rows, "bf16 loss curve vs CPU fp32", f"{preset} {steps} steps B{B} S{S}", diff, 4 * BF16,
        ok=len(got) == len(ref) == steps)
    planned = plan(glm5f.preset(preset), run_shape(cfg), runtime)["total_bytes"]
    measured = peak_bytes(device)
    row(rows, "peak memory / --plan", f"{preset} B{B} S{S} bf16", abs(measured / planned - 1), 0.25)
    print(f"    measured {measured / 2**30:.2f} GiB, planned {planned / 2**30:.2f} GiB; losses bf16 "
          f"{got[0]:.4f} -> {got[-1]:.4f}, fp32 {ref[0]:.4f} -> {ref[-1]:.4f}")


# ---- speed: tokens/s and MFU of a training step's forward + backward; the attention layer at long contexts --------

def median_time(fn, device, steps):
    fn()
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check_speed(rows, device, sizes, steps):
    from glm5f.train.loss import Step, step_grads
    from glm5f.parallel.layout import Layout
    # a CPU without bf16 vector instructions multiplies bf16 at ~1 GFLOP/s (minutes for the 2048^3 one): its peak
    # from a 512^3 matmul, as large as the CPU rows' own
    peak = matmul_peak_flops(device, torch.bfloat16, n=2048 if device.startswith("cuda") else 512)
    print(f"    bf16 matmul peak measured: {peak / 1e9:.1f} GFLOP/s")
    for name, B, S in sizes:
        cfg = model_cfg(name, S)
        params = glm5f.init_params(cfg, seed=0, dtype=torch.float32, device=device)
        ids = torch.randint(0, cfg.vocab_size, (B, S), device=device)
        batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S, device=device).expand(B, S)}
        step = Step(dtype=torch.bfloat16)
        seconds = median_time(lambda: step_grads(params, batch, cfg, Layout(device), step), device, steps)
        tokens_per_s = B * S / seconds
        mfu = tokens_per_s * flops_per_token(cfg, S) / peak
        row(rows, "tokens/s (fwd+bwd)", f"bf16 {name} B{B} S{S}", tokens_per_s, None)
        row(rows, "MFU of measured peak", f"bf16 {name} B{B} S{S}", mfu, None)
        del params


def check_attention(rows, device, lengths, steps):
    from glm5f.model.attention import attention
    cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "index_topk": 2048 if device.startswith("cuda") else 32,
                                       "max_position_embeddings": max(lengths)})
    p = glm5f.init_params(cfg, seed=0, dtype=torch.bfloat16, device=device)["model"]["layers"][0]["self_attn"]
    leaves = [t.requires_grad_() for k, t in glm5f.flatten(p).items() if not k.startswith("indexer")]
    for L in lengths:
        x = torch.randn(1, L, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        _, env = glm5f.make_env(cfg, {"input_ids": torch.zeros(1, L, dtype=torch.long, device=device)},
                                torch.bfloat16)

        def fwd_bwd():
            xg = x.requires_grad_()
            out = attention(p, xg, cfg, 0, env, None)[0]
            torch.autograd.grad(out.float().square().mean(), [xg, *leaves])
        reset_peak(device)
        seconds = median_time(fwd_bwd, device, steps)
        row(rows, "attention layer fwd+bwd", f"bf16 L{L} top-k {cfg.index_topk}", seconds, None, " s")
        row(rows, "attention layer peak", f"bf16 L{L} top-k {cfg.index_topk}", peak_bytes(device) / 2**30, None,
            " GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="directory for the training runs (default: a temporary one)")
    ap.add_argument("--fla-autotune", action="store_true",
                    help="let fla's autotuner compile and time all its configs (minutes); default: the first config")
    args = ap.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; pass --device cpu for the tiny CPU check",
              file=sys.stderr)
        return 2
    size, gen, rows = SIZES[kind], torch.Generator().manual_seed(0), []
    t0 = time.perf_counter()
    print(f"glm5f device check on {torch.cuda.get_device_name() if kind == 'cuda' else 'cpu'}")
    check_kernels(rows, args.device, size["kernel"], gen)
    check_kernel_fitness(rows, args.device)
    if kind == "cuda" and not args.fla_autotune:
        untimed_autotune()
    check_kda(rows, args.device, size["kda"], gen, 3 if kind == "cuda" else 1)
    check_model(rows, args.device, size["model"], gen)
    with tempfile.TemporaryDirectory() as tmp:
        check_training(rows, args.device, size["train"], args.out or tmp)
    check_speed(rows, args.device, size["speed"], 3)
    check_attention(rows, args.device, size["attention"], 2 if kind == "cuda" else 1)
    print(f"\n{'check':<30}{'setting':<36}{'value':>12}  {'bound':>9}  ok   ({time.perf_counter() - t0:.0f} s)")
    for check, setting, value, bound, unit, ok in rows:
        print(f"{check:<30}{setting:<36}{value:>12.4g}  {'' if bound is None else f'{bound:9.3g}':>9}  "
              f"{'yes' if ok else 'NO'}{unit and f'  ({unit.strip()})'}")
    failed = [r[0] for r in rows if not r[5]]
    print("DEVICE CHECK PASSED" if not failed else f"DEVICE CHECK FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
