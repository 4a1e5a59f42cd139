"""LoRA against full fine-tuning: one training step (forward, backward, AdamW) of glm5-scaled-moe, each side in its
own subprocess, so each peak memory is that side's alone.

    python bench/lora.py                                   # rank 16 on the attention projections, batch 2 x 512
    python bench/lora.py --targets 'self_attn|mlp\\.'       # adapters on the dense, shared and routed experts too
    python bench/lora.py --device cuda --dtype bfloat16

Full fine-tuning keeps fp32 masters, gradients and AdamW moments of every parameter; LoRA keeps the base frozen in
--base-dtype (no gradient, no optimizer state) and trains the adapters in fp32. Prints the median step time, peak
memory and trained parameters of each side and the ratios.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import add_run_flags, median_seconds, peak_memory_gb, run_child, serve_child


def run_side(args) -> dict:
    import glm5f
    from glm5f.model import lora
    from glm5f.data import make_source
    from glm5f.train.loss import Step, device_step
    from glm5f.train.optim import adamw_init, adamw_update
    from glm5f.parallel.layout import Layout

    dtype = getattr(torch, args.dtype)
    master = torch.promote_types(dtype, torch.float32)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = glm5f.preset("glm5-scaled-moe", **overrides)
    batch = make_source("synthetic", vocab_size=cfg.vocab_size, batch_size=args.batch, seq_len=args.seq,
                        seed=0).next_batch()
    batch = {k: v.to(args.device) for k, v in batch.items()}
    layout = Layout(args.device)
    if args.child == "lora":
        spec = lora.LoraSpec(args.rank, alpha=args.rank, targets=args.targets)
        params = glm5f.init_params(cfg, 0, getattr(torch, args.base_dtype), args.device)
        trained = {p: t.to(args.device) for p, t in lora.init_adapters(params, spec, 0, master).items()}
        step = Step(dtype=dtype, lora=spec)
    else:
        params = glm5f.init_params(cfg, 0, master, args.device)
        trained, step = params, Step(dtype=dtype)
    state = adamw_init(trained, step.trained(lora.attach(params, trained) if step.lora else params))

    def one():
        nonlocal state
        model = lora.attach(params, trained) if step.lora else params
        _, grads, _ = device_step(model, batch, cfg, layout, step)
        _, state = adamw_update(trained, grads, state, 1e-4)

    seconds = median_seconds(one, args.steps, args.device)
    return {"side": args.child, "seconds": seconds, "peak_gb": peak_memory_gb(args.device),
            "trained": sum(t.numel() for t in state["mu"].values())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$")
    ap.add_argument("--base-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's decoder layers")
    ap.add_argument("--steps", type=int, default=3)
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    flags = ["--rank", str(args.rank), "--targets", args.targets, "--base-dtype", args.base_dtype, "--batch",
             str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--device", args.device,
             "--dtype", args.dtype, *(["--layers", str(args.layers)] if args.layers else [])]
    print(f"glm5-scaled-moe training step (fwd + bwd + AdamW), batch {args.batch} x {args.seq}, {args.dtype} on "
          f"{args.device} ({torch.get_num_threads()} threads), median of {args.steps}; LoRA rank {args.rank} "
          f"(base in {args.base_dtype}) on {args.targets!r}")
    here = os.path.abspath(__file__)
    res = {s: run_child(here, ["--child", s, *flags], f"the {s} side") for s in ("full", "lora")}
    for s, r in res.items():
        print(f"  {s:6s} {r['seconds']:8.3f} s/step  peak {r['peak_gb']:7.3f} GB  {r['trained']:>12,} trained "
              f"parameters")
    full, low = res["full"], res["lora"]
    print(f"  lora / full: {low['seconds'] / full['seconds']:.2f}x the step time, "
          f"{low['peak_gb'] / full['peak_gb']:.3f} of the peak memory, {low['trained'] / full['trained']:.5f} of the "
          f"trained parameters")


if __name__ == "__main__":
    main()
