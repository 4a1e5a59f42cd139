"""One MoE layer (sigmoid router, routed experts grouped, one shared expert), forward + backward: glm5f's `moe`
against Transformers' GlmMoeDsaMoE, same weights and tokens.

    python bench/moe.py                                  # 64 experts top-8, 4096 tokens
    python bench/moe.py --experts 16 --top 2 --tokens 2048
    python bench/moe.py --threads 1                      # each side on one thread (a shared CPU)

Each side runs in its own subprocess; prints the median seconds, tokens/s, peak memory,
the median CPU time of the side's process and the ratios.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from common import BENCH_MODEL, add_run_flags, median_times, peak_memory_gb, run_child, run_flags, serve_child, threads_of


def run_side(args) -> dict:
    import glm5f
    from glm5f.model.moe import moe
    dtype = getattr(torch, args.dtype)
    cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "num_hidden_layers": 2, "n_routed_experts": args.experts,
                                        "num_experts_per_tok": args.top})
    params = glm5f.init_params(cfg, seed=0, dtype=dtype, device=args.device)
    x = torch.randn(1, args.tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(args.device, dtype)
    if args.child == "glm5f":
        p = params["model"]["layers"][1]["mlp"]
        _, env = glm5f.make_env(cfg, {"input_ids": torch.zeros(1, args.tokens, dtype=torch.long, device=args.device)},
                                dtype)
        leaves = [t.requires_grad_() for k, t in glm5f.flatten(p).items() if "correction_bias" not in k]

        def step():
            xg = x.detach().requires_grad_()
            out, _, _ = moe(p, xg, cfg, env)
            torch.autograd.grad(out.float().square().mean(), [xg, *leaves])
    else:
        from transformers import AutoModelForCausalLM
        with tempfile.TemporaryDirectory() as d:  # loaded as a model, so the checkpoint's expert format converts
            glm5f.save_hf(d, cfg, params)
            del params
            module = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).model.layers[1].mlp
        module = module.to(args.device).train()

        def step():
            module.zero_grad(set_to_none=True)
            xg = x.detach().requires_grad_()
            module(xg).float().square().mean().backward()
    return {"side": args.child, **median_times(step, args.steps, args.device), "peak_gb": peak_memory_gb(args.device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    flags = ["--experts", str(args.experts), "--top", str(args.top), "--tokens", str(args.tokens),
             "--steps", str(args.steps), *run_flags(args)]
    print(f"one MoE layer fwd+bwd, {args.experts} experts top-{args.top} + 1 shared, {args.tokens} tokens, "
          f"{args.dtype} on {args.device} ({threads_of(args)} threads), median of {args.steps}")
    here = os.path.abspath(__file__)
    res = {s: run_child(here, ["--child", s, *flags], f"the {s} side") for s in ("glm5f", "transformers")}
    for s, r in res.items():
        print(f"  {s:12s} {r['seconds']:8.3f} s  {args.tokens / r['seconds']:9.0f} tok/s  peak {r['peak_gb']:6.2f} GB  "
              f"(CPU time {r['cpu_seconds']:.3f} s)")
    a, b = res["glm5f"], res["transformers"]
    print(f"  ratio        {b['seconds'] / a['seconds']:8.2f}x faster, {a['peak_gb'] / b['peak_gb']:.3f} of the peak "
          f"memory  (CPU time {b['cpu_seconds'] / a['cpu_seconds']:.2f}x)")


if __name__ == "__main__":
    main()
