"""Whole-model forward + backward: glm5f against Transformers' GlmMoeDsaForCausalLM (eager), same weights and batch.

    python bench/forward_backward.py --batch 4 --seq 512            # the bench model (4 layers), index_topk 128
    python bench/forward_backward.py --batch 1 --seq 2048
    python bench/forward_backward.py --shape heads16-latent256        # 16 heads, kv_lora_rank 256 (common.SHAPES)
    python bench/forward_backward.py --shape experts64-top8           # 64 experts top-8, expert width 128
    python bench/forward_backward.py --threads 1 ...                  # each side on one thread (a shared CPU)
    python bench/forward_backward.py --threads 1 --profile ...        # and where each side's time goes
    python bench/forward_backward.py --preset glm5-scaled-moe --batch 2 --seq 512
    python bench/forward_backward.py --device cuda --dtype bfloat16 --side glm5f --batch 8 --seq 4096   # MFU

Each side runs in its own subprocess (peak memory is that side's alone). Prints the median seconds, tokens/s, peak
memory, the median CPU time of the side's process, the ratios, and each side's utilisation: model FLOPs of the step (bench/common.py `train_flops`, indexer
included) over its time over the matmul peak measured in the same run (an n^3 matmul in the same dtype).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from common import (add_model_flags, add_run_flags, matmul_peak_flops, median_times, model_config, model_flags,
                    peak_memory_gb, print_profile_split, profile_split, run_child, serve_child, threads_of,
                    train_flops)


def make_step(args):
    """One forward + backward of the side `args.child` ("glm5f" or "transformers") on the bench model and batch."""
    import glm5f
    dtype = getattr(torch, args.dtype)
    cfg = model_config(args)
    params = glm5f.init_params(cfg, seed=0, dtype=dtype, device=args.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    if args.child == "glm5f":
        leaves = [t.requires_grad_() for k, t in glm5f.flatten(params).items() if not glm5f.core.params.is_buffer(k)]

        def step():
            loss = glm5f.causal_lm_loss(glm5f.forward(params, cfg, ids), ids)
            torch.autograd.grad(loss, leaves, allow_unused=True)
    else:
        from transformers import AutoModelForCausalLM
        with tempfile.TemporaryDirectory() as d:
            glm5f.save_hf(d, cfg, params)
            del params  # the peak is the reference model's alone
            model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=dtype)
        model = model.to(args.device).train()

        def step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
    return step


def run_side(args) -> dict:
    step = make_step(args)
    res = {"side": args.child, **median_times(step, args.steps, args.device), "peak_gb": peak_memory_gb(args.device)}
    if args.profile:
        res["profile"] = [[f, k, t] for (f, k), t in profile_split(step).items()]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, "after one warm-up")
    ap.add_argument("--side", default="both", choices=["both", "glm5f", "transformers"])
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, profile one step of each side: op self time per family (CPU)")
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_peak_flops(args.device, dtype)
    cfg = model_config(args)
    flops = train_flops(cfg, args.batch, args.seq)
    tokens = args.batch * args.seq
    shape = f" {args.shape}" if args.preset == "bench" else ""
    print(f"{args.preset}{shape} B{args.batch}xS{args.seq} index_topk {cfg.index_topk}, {args.dtype} on {args.device} "
          f"({threads_of(args)} threads), median of {args.steps}; model {flops / 1e9:.1f} GFLOP per step, "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s (2048^3, this run)")
    flags = model_flags(args)
    sides = ["glm5f", "transformers"] if args.side == "both" else [args.side]
    here = os.path.abspath(__file__)
    res = {s: run_child(here, ["--child", s, *flags, *(["--profile"] if args.profile else [])], f"the {s} side")
           for s in sides}
    for s, r in res.items():
        print(f"  {s:12s} {r['seconds']:8.3f} s  {tokens / r['seconds']:9.0f} tok/s  peak {r['peak_gb']:6.2f} GB  "
              f"utilisation {flops / r['seconds'] / peak:6.1%}  (CPU time {r['cpu_seconds']:.3f} s)", flush=True)
    if len(res) == 2:
        a, b = res["glm5f"], res["transformers"]
        print(f"  ratio        {b['seconds'] / a['seconds']:8.2f}x faster, {a['peak_gb'] / b['peak_gb']:.3f} of the "
              f"peak memory  (CPU time {b['cpu_seconds'] / a['cpu_seconds']:.2f}x)")
    if args.profile:
        print("where a step's CPU time goes (op self time, s; one profiled step a side):")
        print_profile_split({s: {(f, k): t for f, k, t in r["profile"]} for s, r in res.items()},
                            {s: r["cpu_seconds"] for s, r in res.items()})


if __name__ == "__main__":
    main()
