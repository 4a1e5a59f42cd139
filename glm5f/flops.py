"""Model FLOPs of a GLM-5 config: what tokens/s becomes MFU with (the benches and bench/device_check.py), counted
from the config as the model defines it, independent of how a kernel computes it."""

from __future__ import annotations

from glm5f.config import GLM5Config


def flops_per_token(cfg: GLM5Config, seq: int, train: bool = True) -> float:
    """Model FLOPs per token of a causal sequence of `seq` tokens (2 per multiply-add): the forward, and with
    `train` the backward at twice the forward, except the indexer's (forward only: the LM loss gives it no
    gradient).

    Per layer: the MLA projections (q_a, q_b, kv_a, kv_b's key and value halves applied once per token, o_proj);
    attention per head over the keys each query attends (min(index_topk, visible keys) when the sequence is
    longer than index_topk, else every visible key), scores over nope + rope channels and values; the MLP (dense
    SwiGLU, or the router plus each routed and shared expert slot); the indexer of a full layer (wq_b, wk,
    weights_proj, and scores plus head weighting over every visible key). Then the LM head. Norms, rope, softmax
    and the MTP layers are not counted.
    """
    D, H, Q, R = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    N, P, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    I, J = cfg.index_n_heads, cfg.index_head_dim
    visible = (seq + 1) / 2  # mean keys a causal query sees
    sparse = sum(min(cfg.index_topk, s + 1) for s in range(seq)) / seq
    attended = sparse if seq > cfg.index_topk else visible
    macs, indexer_macs = 0.0, 0.0
    for layer in range(cfg.num_hidden_layers):
        macs += D * Q + Q * H * (N + P) + D * (R + P) + R * H * (N + V) + H * V * D
        macs += attended * H * (N + P + V)
        if cfg.indexer_types[layer] == "full":
            indexer_macs += Q * I * J + D * J + D * I + visible * I * (J + 1)
        if cfg.is_moe(layer):
            F = cfg.moe_intermediate_size
            macs += D * cfg.n_routed_experts + 3 * D * F * (cfg.num_experts_per_tok + cfg.n_shared_experts)
        else:
            macs += 3 * D * cfg.intermediate_size
    macs += D * cfg.vocab_size
    return 2 * ((3 if train else 1) * macs + indexer_macs)
