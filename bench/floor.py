"""The floor of a CPU step: the GEMMs both sides must run (linear layers and experts, forward and backward) timed
alone, against glm5f's and Transformers' whole step in the same invocation: the largest ratio any glm5f could reach.

    python bench/floor.py --threads 1 --batch 4 --seq 512             # whole model (bench/forward_backward.py's)
    python bench/floor.py --threads 1 --shape heads16-latent256
    python bench/floor.py --threads 1 --moe                           # one MoE layer (bench/moe.py's), 64 experts top-8

The floor counts every linear layer's GEMMs (x W^T; and dx, dW where the layer is trained: the indexer's run
forward only, under no_grad on both sides) and the routed experts' grouped GEMMs with even counts, the faster of
gate and up apart (glm5f's) or fused (Transformers'); not kv_b_proj (attention: Transformers expands the latent
through it, glm5f absorbs it into queries and outputs), nor attention, the indexer's scores, norms, the loss.
Any implementation runs at least these GEMMs, so Transformers' step time over the floor bounds the ratio. The MoE
layer's floor adds the gathers, weighted sums and SwiGLU any torch implementation runs (`routing_ops`), and prints
the best utilisation: the layer's model FLOPs over the floor's time over the 2048^3 sgemm peak (on CPU time, at
one thread the core's own rate; and on wall time).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from common import (BENCH_MODEL, add_model_flags, add_run_flags, matmul_peak_flops, median_times, model_config,
                    model_flags, run_child, run_flags, threads_of)

HERE = os.path.dirname(os.path.abspath(__file__))


def linear_gemms(N: int, out_dim: int, in_dim: int, trained: bool) -> list:
    """The GEMMs of a linear layer [out, in] over N tokens: y = x W^T; with `trained` also dx = dy W, dW = dy^T x."""
    x, w, dy = torch.randn(N, in_dim), torch.randn(out_dim, in_dim), torch.randn(N, out_dim)
    gemms = [lambda: x @ w.T]
    if trained:
        gemms += [lambda: dy @ w, lambda: dy.T @ x]
    return gemms


def expert_gemms(M: int, E: int, D: int, F_: int, fused: bool) -> list:
    """The grouped GEMMs of E SwiGLU experts over M routed rows in even groups, forward and backward: gate and up
    apart (two [E, F, D] weights) or fused (one [E, 2F, D]), then down [E, D, F]."""
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (M // E)
    x, h, dy = torch.randn(M, D), torch.randn(M, F_), torch.randn(M, D)
    w_down = torch.randn(E, D, F_)
    ups = [torch.randn(E, 2 * F_, D)] if fused else [torch.randn(E, F_, D), torch.randn(E, F_, D)]
    gemms = [lambda: F.grouped_mm(h, w_down.transpose(-1, -2), offs=offs),  # down forward
             lambda: F.grouped_mm(dy, w_down, offs=offs),  # dh
             lambda: F.grouped_mm(dy.T, h, offs=offs)]  # dW_down
    for w in ups:
        dg = torch.randn(M, w.shape[1])
        gemms += [lambda w=w: F.grouped_mm(x, w.transpose(-1, -2), offs=offs),
                  lambda w=w, dg=dg: F.grouped_mm(dg, w, offs=offs),
                  lambda w=w, dg=dg: F.grouped_mm(dg.T, x, offs=offs)]
    return gemms


def routing_ops(N: int, K: int, D: int, F_: int, F_shared: int) -> list:
    """The element-wise and gather work of a MoE layer in torch ops, forward and backward: each token's rows
    gathered for its K experts and their outputs weighted and summed back (index_select, mul, index_add_), SwiGLU
    over the routed rows and the shared expert's (silu, mul; silu_backward, mul), the routing weights' gradient."""
    M = N * K
    tok_M = torch.arange(M) // K
    x, y, dout = torch.randn(N, D), torch.randn(M, D), torch.randn(N, D)
    w_M = torch.rand(M)

    def backward():  # the rows' gradient, the weights' gradient, the tokens' gradient summed over their rows
        dy_MxD = dout.index_select(0, tok_M)
        (dy_MxD * y).sum(-1)
        torch.zeros(N, D).index_add_(0, tok_M, dy_MxD.mul_(w_M[:, None]))

    ops = [lambda: x.index_select(0, tok_M), lambda: torch.zeros(N, D).index_add_(0, tok_M, y * w_M[:, None]),
           backward]
    for rows, width in ((M, F_), (N, F_shared)):
        g, u, dh = torch.randn(rows, width), torch.randn(rows, width), torch.randn(rows, width)
        ops += [lambda g=g, u=u: F.silu(g) * u, lambda g=g, u=u, dh=dh: torch.ops.aten.silu_backward(dh * u, g),
                lambda g=g, dh=dh: dh * F.silu(g)]
    return ops


def cpu_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n^3 fp32 matmul on process CPU time, best of `reps` (on one thread: the core's own rate, what
    other work on a shared machine does not change)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / min(median_times(lambda: a @ b, 1, "cpu")["cpu_seconds"] for _ in range(reps))


def timed(gemms: list, steps: int) -> dict:
    def run():
        for g in gemms:
            g()
    return median_times(run, steps, "cpu")


def model_gemms(cfg, N: int) -> tuple[list, list, tuple]:
    """(the linear layers' GEMMs, the expert GEMMs apart, the expert GEMMs fused) of one step over N tokens."""
    import glm5f
    params = glm5f.init_params(cfg, seed=0, device="meta")
    linears, apart, fused = [], [], []
    for k, t in glm5f.flatten(params).items():
        if t.ndim == 3 and k.endswith("experts.gate_proj.weight"):
            E, F_, D = t.shape
            apart += expert_gemms(N * cfg.num_experts_per_tok, E, D, F_, fused=False)
            fused += expert_gemms(N * cfg.num_experts_per_tok, E, D, F_, fused=True)
        elif t.ndim == 2 and k.endswith(".weight") and "embed_tokens" not in k and "kv_b_proj" not in k:
            linears += linear_gemms(N, *t.shape, trained=".indexer." not in k)
    return linears, apart, fused


def report(what: str, sides: dict, floor: dict, threads: int) -> None:
    """Both sides' step and the floor, wall and CPU time, and the ratios they bound."""
    print(f"  {what}")
    for s, r in sides.items():
        print(f"  {s:28s} {r['seconds']:8.3f} s  (CPU time {r['cpu_seconds']:.3f} s)")
    print(f"  {'floor (shared GEMMs alone)':28s} {floor['seconds']:8.3f} s  (CPU time {floor['cpu_seconds']:.3f} s)")
    a, b = sides["glm5f"], sides["transformers"]
    for key, name in (("seconds", "wall"), ("cpu_seconds", "CPU time")):
        print(f"  {name:9s} glm5f {b[key] / a[key]:.2f}x Transformers; any implementation at most "
              f"{b[key] / floor[key]:.2f}x (Transformers / floor); the floor is {floor[key] / a[key]:.0%} of glm5f's")
    if threads != 1:
        print("  (more than one thread: the CPU-time figures add the threads' time)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, "after one warm-up")
    ap.add_argument("--moe", action="store_true", help="one MoE layer (bench/moe.py) instead of the whole model")
    ap.add_argument("--experts", type=int, default=64, help="--moe: routed experts")
    ap.add_argument("--top", type=int, default=8, help="--moe: experts per token")
    ap.add_argument("--tokens", type=int, default=4096, help="--moe: tokens")
    add_run_flags(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peak, cpu_peak = matmul_peak_flops("cpu", torch.float32), cpu_peak_flops()
    if args.moe:
        import glm5f
        cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "num_hidden_layers": 2, "n_routed_experts": args.experts,
                                            "num_experts_per_tok": args.top})
        N, D, F_, E, K = args.tokens, cfg.hidden_size, cfg.moe_intermediate_size, args.experts, args.top
        flags = ["--experts", str(E), "--top", str(K), "--tokens", str(N), "--steps", str(args.steps), *run_flags(args)]
        sides = {s: run_child(os.path.join(HERE, "moe.py"), ["--child", s, *flags], f"the {s} side")
                 for s in ("glm5f", "transformers")}
        shared = (linear_gemms(N, E, D, True) + linear_gemms(N, F_ * cfg.n_shared_experts, D, True) * 2
                  + linear_gemms(N, D, F_ * cfg.n_shared_experts, True))
        apart = timed(shared + expert_gemms(N * K, E, D, F_, fused=False), args.steps)
        fused = timed(shared + expert_gemms(N * K, E, D, F_, fused=True), args.steps)
        gemms = min(apart, fused, key=lambda r: r["cpu_seconds"])
        routing = timed(routing_ops(N, K, D, F_, F_ * cfg.n_shared_experts), args.steps)
        floor = {k: gemms[k] + routing[k] for k in gemms}
        flops = 3 * 2 * N * D * (K * 3 * F_ + 3 * F_ * cfg.n_shared_experts + E)
        print(f"one MoE layer fwd+bwd, {E} experts top-{K} + {cfg.n_shared_experts} shared, {N} tokens, float32 "
              f"({threads_of(args)} threads), median of {args.steps}; {flops / 1e9:.1f} GFLOP (router, experts, "
              f"shared expert), sgemm peak {peak / 1e9:.1f} GFLOP/s wall, {cpu_peak / 1e9:.1f} on CPU time (2048^3)")
        print(f"  floor: GEMMs with the experts' gate and up apart {apart['cpu_seconds']:.3f} s, fused "
              f"{fused['cpu_seconds']:.3f} s (with the router and shared expert), + gathers, sums and SwiGLU "
              f"{routing['cpu_seconds']:.3f} s CPU time")
        report("MoE layer", sides, floor, threads_of(args))
        print(f"  floor of the GEMMs alone: any implementation at most "
              f"{sides['transformers']['cpu_seconds'] / gemms['cpu_seconds']:.2f}x Transformers (CPU time)")
        for s, r in {**sides, "GEMMs alone": gemms, "floor": floor}.items():
            print(f"  utilisation {s:12s} {flops / r['cpu_seconds'] / cpu_peak:6.1%} of the sgemm peak (CPU time; "
                  f"wall {flops / r['seconds'] / peak:.1%})")
        return
    cfg = model_config(args)
    N = args.batch * args.seq
    flags = model_flags(args)
    sides = {s: run_child(os.path.join(HERE, "forward_backward.py"), ["--child", s, *flags], f"the {s} side")
             for s in ("glm5f", "transformers")}
    linears, apart, fused = model_gemms(cfg, N)
    lin = timed(linears, args.steps)
    experts = min(timed(apart, args.steps), timed(fused, args.steps), key=lambda r: r["cpu_seconds"]) if apart else \
        {"seconds": 0.0, "cpu_seconds": 0.0}
    floor = {k: lin[k] + experts[k] for k in lin}
    shape = f" {args.shape}" if args.preset == "bench" else ""
    print(f"{args.preset}{shape} B{args.batch}xS{args.seq} index_topk {cfg.index_topk}, float32 "
          f"({threads_of(args)} threads), median of {args.steps}; sgemm peak {peak / 1e9:.1f} GFLOP/s")
    print(f"  floor: linear layers' GEMMs {lin['cpu_seconds']:.3f} s + expert GEMMs {experts['cpu_seconds']:.3f} s "
          f"CPU time")
    report("whole model forward + backward", sides, floor, threads_of(args))


if __name__ == "__main__":
    main()
