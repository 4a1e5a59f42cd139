"""The DSA custom ops of glm5f.kernels against the attention.py functions they are to replace: equal results, time.

    python bench/sparse_ops.py --seq 4096 --topk 512     # one layer of the bench model (common.BENCH_MODEL)

Sparse MLA forward + backward (attention.sparse_attention vs glm5f::sparse_mla) and the indexer top-k from the
layer's input (attention.indexer_topk vs indexer_student + glm5f::indexer_topk), on the same inputs in one
process; prints the median seconds of --steps after a warm-up and whether the results are bitwise equal.
"""

from __future__ import annotations

import argparse

import torch

from common import BENCH_MODEL, median_seconds


def main(args) -> None:
    import glm5f
    from glm5f import attention as attn
    from glm5f import kernels
    from glm5f.model import make_context

    cfg = glm5f.preset("glm5-tiny", **{**BENCH_MODEL, "index_topk": args.topk,
                                       "max_position_embeddings": max(args.seq, 4096)})
    p = glm5f.init_params(cfg, seed=0)["model"]["layers"][0]["self_attn"]
    B, S, H, R, C = 1, args.seq, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, cfg.hidden_size, generator=g)
    q_lat = torch.randn(B, S, cfg.q_lora_rank, generator=g)
    ctx = make_context(cfg, (B, S), None, None, torch.float32, "cpu")
    mask = ctx.mask
    keys = attn.indexer_keys(p["indexer"], x, cfg, ctx)

    def old_indexer():
        return attn.indexer_topk(p["indexer"], x, q_lat, keys, cfg, ctx)

    def new_indexer():
        q, w = attn.indexer_student(p["indexer"], x, q_lat, cfg, ctx)
        return kernels.indexer_topk(q, w, keys, mask.q_index, mask.key_valid, mask.q_segment, mask.k_segment,
                                    mask.dense, mask.bias, min(cfg.index_topk, S))

    idx = old_indexer()
    allowed = mask.at(idx)
    q = torch.randn(B, S, H, C, generator=g)
    latent = torch.randn(B, S, C, generator=g)
    dout = torch.randn(B, S, H, R, generator=g)

    def sparse(fn):
        def step():
            qq, ll = q.detach().requires_grad_(), latent.detach().requires_grad_()
            out = fn(qq, ll, idx, allowed, cfg.softmax_scale, R)
            out.backward(dout)
            return out.detach(), qq.grad, ll.grad
        return step

    old_sparse, new_sparse = sparse(attn.sparse_attention), sparse(kernels.sparse_attention)
    print(f"L={S} top-k {idx.shape[-1]}, {H} heads, C={C}, indexer {cfg.index_n_heads} x {cfg.index_head_dim}, "
          f"fp32 on cpu, {torch.get_num_threads()} threads")
    for name, old, new in [("sparse MLA fwd+bwd", old_sparse, new_sparse), ("indexer top-k", old_indexer,
                                                                             new_indexer)]:
        a, b = old(), new()
        same = all(torch.equal(u, v) for u, v in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
        t_old, t_new = median_seconds(old, args.steps, "cpu"), median_seconds(new, args.steps, "cpu")
        print(f"  {name:20s} attention.py {t_old:8.3f} s   op {t_new:8.3f} s   op/old {t_new / t_old:5.2f}   "
              f"bitwise equal: {same}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    main(ap.parse_args())
