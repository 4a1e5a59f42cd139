"""Forward + backward time of glm5f and of Transformers' GlmMoeDsaForCausalLM on the same weights and batch.

    python bench/forward_backward.py --preset glm5-scaled-moe --batch 2 --seq 512 --steps 5
    python bench/forward_backward.py --preset bench --batch 4 --seq 512 --topk 128   # the attention bench's model,
                                                                                     # 4 layers, 16 experts top-2

Both run in this process, alternating, after a warm-up; prints the median seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import glm5f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="glm5-scaled-moe")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=None, help="index_topk (default: the preset's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.preset == "bench":
        from attention import BENCH_MODEL  # bench/attention.py, beside this file
        cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "num_hidden_layers": 4, "index_topk": args.topk or 128,
                                           "max_position_embeddings": max(4096, args.seq)})
    else:
        cfg = glm5f.preset(args.preset, **({"index_topk": args.topk} if args.topk else {}))
    params = glm5f.init_params(cfg, seed=0, dtype=dtype, device=args.device)
    with tempfile.TemporaryDirectory() as d:
        glm5f.save_hf(d, cfg, params)
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=dtype).to(args.device)
    model.train()
    leaves = [t.requires_grad_() for k, t in glm5f.flatten(params).items() if glm5f.params.trainable(k)]
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device,
                        generator=torch.Generator().manual_seed(0)) if args.device == "cpu" else \
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)

    def ours():
        loss = glm5f.causal_lm_loss(glm5f.forward(params, cfg, ids), ids)
        torch.autograd.grad(loss, leaves, allow_unused=True)

    def reference():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    def timed(fn):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    ours(), reference()  # warm-up
    t_ours, t_ref = [], []
    for _ in range(args.steps):
        t_ours.append(timed(ours))
        t_ref.append(timed(reference))
    a, b = statistics.median(t_ours), statistics.median(t_ref)
    tokens = args.batch * args.seq
    print(f"{args.preset} batch={args.batch} seq={args.seq} index_topk={cfg.index_topk} {args.dtype} on "
          f"{args.device} ({torch.get_num_threads()} threads), median of {args.steps}:")
    print(f"  glm5f         {a:8.3f} s  {tokens / a:10.0f} tok/s")
    print(f"  transformers  {b:8.3f} s  {tokens / b:10.0f} tok/s")
    print(f"  speed-up      {b / a:8.2f}x")


if __name__ == "__main__":
    main()
