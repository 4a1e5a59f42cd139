"""One MLA + DSA attention layer, forward + backward, glm5f against Transformers' GlmMoeDsaAttention (eager).

    python bench/attention.py --seq 8192 --topk 512             # both sides at 8K, then the ratios
    python bench/attention.py --sweep 2048,8192,32768 --side glm5f   # how glm5f grows with L at fixed top-k

Each side runs in its own subprocess (so each peak RSS is that side's alone) on the same weights and inputs:
the bench config (hidden 512, 8 heads, q_lora 256, kv_lora 128, nope 64, rope 32, v 64, indexer 16 x 64).
Prints seconds (median of --steps after one warm-up step), tokens/s, peak RSS, and for glm5f the indexer's share
(its top-k alone, timed in the same process). Transformers builds an L x L score matrix per head, so it is run
only up to --ref-max-seq.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import (BENCH_MODEL, add_run_flags, median_seconds, median_times, peak_memory_gb, run_child, run_flags,
                    serve_child, threads_of)

def run_side(side: str, seq: int, topk: int, steps: int, dtype: torch.dtype, device: str) -> dict:
    import glm5f
    from glm5f.model.attention import attention, indexer_keys, indexer_queries, indexer_topk, mla_project

    cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "index_topk": topk, "max_position_embeddings": max(seq, 4096)})
    params = glm5f.init_params(cfg, seed=0, dtype=dtype, device=device)
    p = params["model"]["layers"][0]["self_attn"]
    x = torch.randn(1, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    if side == "glm5f":
        _, ctx = glm5f.make_env(cfg, {"input_ids": torch.zeros(1, seq, dtype=torch.long, device=device)}, dtype)
        leaves = [t.requires_grad_() for k, t in glm5f.flatten(p).items() if not k.startswith("indexer")]

        def step():
            xg = x.detach().requires_grad_()
            out, _, _ = attention(p, xg, cfg, 0, ctx, None)
            torch.autograd.grad(out.float().square().mean(), [xg, *leaves])

        def indexer_only():
            with torch.no_grad():
                _, _, q_lat, _ = mla_project(p, x, cfg, ctx)
                indexer_topk(*indexer_queries(p["indexer"], x, q_lat, cfg, ctx), indexer_keys(p["indexer"], x, cfg, ctx),
                             ctx.mask, cfg.index_topk)
    else:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf
        from transformers import AutoConfig
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            glm5f.save_hf(d, cfg, params)
            hf_cfg = AutoConfig.from_pretrained(d)
        hf_cfg._attn_implementation = "eager"
        module = hf.GlmMoeDsaAttention(hf_cfg, 0).to(device, dtype)
        prefix = "model.layers.0.self_attn."
        state = {k[len(prefix):]: v for k, v in glm5f.hf_state_dict(params).items() if k.startswith(prefix)}
        module.load_state_dict(state, strict=True)
        module.train()
        rotary = hf.GlmMoeDsaRotaryEmbedding(hf_cfg).to(device)
        pos = torch.arange(seq, device=device)[None]
        cos_sin = rotary(x, pos)
        causal = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)[None, None]

        def step():
            module.zero_grad(set_to_none=True)
            xg = x.detach().requires_grad_()
            out = module(xg, cos_sin, causal, position_ids=pos)[0]
            out.float().square().mean().backward()

        indexer_only = None
    base = peak_memory_gb(device)
    times = median_times(step, steps, device)
    seconds = times["seconds"]
    out = {"side": side, "seq": seq, "topk": topk, **times, "tokens_per_s": seq / seconds,
           "peak_rss_gb": peak_memory_gb(device), "rss_before_gb": base}
    if indexer_only is not None:
        out["indexer_seconds"] = median_seconds(indexer_only, steps, device)
    return out


def child(args, side: str, seq: int) -> dict:
    return run_child(os.path.abspath(__file__), ["--child", side, "--seq", str(seq), "--topk", str(args.topk),
                                                 "--steps", str(args.steps), *run_flags(args)],
                     f"the {side} side at L={seq}")


def show(r: dict) -> str:
    split = ""
    if "indexer_seconds" in r:
        split = f"  (indexer {r['indexer_seconds']:.2f} s, attention {r['seconds'] - r['indexer_seconds']:.2f} s)"
    return (f"  {r['side']:12s} L={r['seq']:6d}  {r['seconds']:8.2f} s  {r['tokens_per_s']:9.0f} tok/s  "
            f"peak {r['peak_rss_gb']:6.2f} GB  (CPU time {r['cpu_seconds']:.2f} s){split}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--sweep", default="", help="comma-separated sequence lengths (overrides --seq)")
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--side", default="both", choices=["both", "glm5f", "transformers"])
    ap.add_argument("--ref-max-seq", type=int, default=8192, help="longest L the Transformers side runs at")
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, lambda a: run_side(a.child, a.seq, a.topk, a.steps, getattr(torch, a.dtype), a.device)):
        return
    seqs = [int(s) for s in args.sweep.split(",")] if args.sweep else [args.seq]
    print(f"one attention layer fwd+bwd, top-k {args.topk}, {args.dtype} on {args.device} "
          f"({threads_of(args)} threads), median of {args.steps}")
    rows = []
    for seq in seqs:
        ours = child(args, "glm5f", seq) if args.side in ("both", "glm5f") else None
        ref = (child(args, "transformers", seq)
               if args.side in ("both", "transformers") and seq <= args.ref_max_seq else None)
        for r in (ours, ref):
            if r:
                print(show(r), flush=True)
        if ours and ref:
            print(f"  ratio        L={seq:6d}  {ref['seconds'] / ours['seconds']:8.2f}x faster, "
                  f"{ours['peak_rss_gb'] / ref['peak_rss_gb']:.3f} of the peak memory  "
                  f"(CPU time {ref['cpu_seconds'] / ours['cpu_seconds']:.2f}x)", flush=True)
        rows.append(ours)
    if len(rows) > 1 and all(rows):
        a, b = rows[0], rows[-1]
        grow = b["seq"] / a["seq"]
        attn = lambda r: r["seconds"] - r["indexer_seconds"]  # noqa: E731
        print(f"  growth L {a['seq']} -> {b['seq']} ({grow:.0f}x): total {b['seconds'] / a['seconds']:.1f}x, "
              f"attention (non-indexer) {attn(b) / attn(a):.1f}x, indexer "
              f"{b['indexer_seconds'] / a['indexer_seconds']:.1f}x, peak memory "
              f"{b['peak_rss_gb'] / a['peak_rss_gb']:.1f}x")


if __name__ == "__main__":
    main()
