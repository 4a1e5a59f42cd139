"""The GLM-5 network as pure functions of (params, inputs, cfg): decoder layer, forward, and the LM loss."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glm5f.attention import AttnContext, Mask, attention
from glm5f.config import GLM5Config
from glm5f.moe import ExpertsFn, expert_ffn, moe
from glm5f.ops import linear, rms_norm, rope_tables, swiglu_mlp, wide, wide_dtype

IGNORE_INDEX = -100
# gather(subtree, its dotted path) -> the subtree's weights for compute (FSDP: gathered from the stored shards)
GatherFn = Callable[[dict, str], dict]


def stored(tree: dict, prefix: str) -> dict:
    """The default GatherFn: the weights as they are."""
    return tree


def decoder_layer(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, ctx: AttnContext,
                  prev_topk: torch.Tensor | None, experts: ExpertsFn = expert_ffn):
    """Pre-norm attention and MLP (dense SwiGLU or MoE) with residuals.

    Returns (x [B, S, D], top-k indices for the next shared layer, aux): aux is a dict of this layer's extra
    outputs: "expert_idx" [N, K] for MoE layers (the experts each token chose); the indexer loss's sums when
    ctx.indexer_loss asks for them (see `attention`); "seq_aux_loss" (this rank's fp64 sum of the sequence-wise
    balance loss) when ctx.seq_aux asks for it.
    """
    x_norm_BxSxD = rms_norm(p["input_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
    a_BxSxD, topk, aux = attention(p["self_attn"], x_norm_BxSxD, cfg, layer, ctx, prev_topk)
    x_BxSxD = x_BxSxD + a_BxSxD
    h_BxSxD = rms_norm(p["post_attention_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
    if cfg.is_moe(layer):
        m_BxSxD, aux["expert_idx"], moe_aux = moe(p["mlp"], h_BxSxD, cfg, experts, ctx.seq_aux)
        aux.update(moe_aux)
    else:
        m_BxSxD = swiglu_mlp(p["mlp"], h_BxSxD)
    return x_BxSxD + m_BxSxD, topk, aux


def apply(params: dict, cfg: GLM5Config, input_ids_BxS: torch.Tensor, ctx: AttnContext, *,
          experts: ExpertsFn = expert_ffn, remat: bool = False, gather: GatherFn = stored):
    """(logits [B, S, V], aux) for inputs already checked and a prepared context. aux: "routes", the expert
    indices [N, K] of every MoE layer; "layers", each layer's aux dict (see `decoder_layer`); "hidden", the last
    layer's output [B, S, D] before the final norm. `remat` recomputes each decoder layer in the backward pass
    (activation checkpointing). `gather` turns each decoder layer's stored weights into compute weights as the
    layer starts (the other leaves are used as given): with `remat` the gathered layer is freed after its forward
    and gathered again for its backward, so one layer's full weights are alive at a time."""
    x_BxSxD = F.embedding(input_ids_BxS, params["model"]["embed_tokens"]["weight"]).to(ctx.dtype)
    return apply_embeds(params, cfg, x_BxSxD, ctx, experts=experts, remat=remat, gather=gather)


def apply_embeds(params: dict, cfg: GLM5Config, x_BxSxD: torch.Tensor, ctx: AttnContext, *,
                 experts: ExpertsFn = expert_ffn, remat: bool = False, gather: GatherFn = stored):
    """`apply` from input embeddings [B, S, D] instead of token ids."""
    def layer_fn(p_layer, x_BxSxD, i, topk):
        return decoder_layer(gather(p_layer, f"model.layers.{i}"), x_BxSxD, cfg, i, ctx, topk, experts)

    topk, layers = None, []
    for i, p_layer in enumerate(params["model"]["layers"][:cfg.num_hidden_layers]):
        if remat and torch.is_grad_enabled():
            x_BxSxD, topk, aux = checkpoint(layer_fn, p_layer, x_BxSxD, i, topk, use_reentrant=False)
        else:
            x_BxSxD, topk, aux = layer_fn(p_layer, x_BxSxD, i, topk)
        layers.append(aux)
    logits = lm_head(params, cfg, x_BxSxD)
    return logits, {"routes": [a["expert_idx"] for a in layers if "expert_idx" in a], "layers": layers,
                    "hidden": x_BxSxD}


def lm_head(params: dict, cfg: GLM5Config, x_BxSxD: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of hidden states: the final norm, then the LM head (the embedding when tied)."""
    x_BxSxD = rms_norm(params["model"]["norm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
    head = params["model"]["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    return linear(head, x_BxSxD)


def mtp_apply(params: dict, cfg: GLM5Config, hidden_BxSxD: torch.Tensor, mtp_input_ids: list[torch.Tensor],
              ctx: AttnContext, *, experts: ExpertsFn = expert_ffn, remat: bool = False,
              gather: GatherFn = stored):
    """(logits [B, S, V] of each MTP depth, aux) from the main model's last hidden state (aux["hidden"] of
    `apply`, before the final norm) and each depth's input ids (`mtp_inputs`: depth d holds t_{i+d} at i).

    Depth d at position i: h = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h_i^{d-1})]) through its decoder layer
    (h^0 the main model's), then shared_head.norm and the LM head; it predicts t_{i+d+1}. aux: "routes", the
    expert indices of each MoE MTP layer; "layers", each MTP decoder layer's aux; "hidden", the last depth's output.
    """
    h_BxSxD, logits, routes, layers = hidden_BxSxD, [], [], []
    for d, ids_BxS in enumerate(mtp_input_ids[:cfg.num_nextn_predict_layers]):
        lg, h_BxSxD, aux = mtp_layer(params, cfg, d + 1, h_BxSxD, ids_BxS, ctx, experts=experts, remat=remat,
                                     gather=gather)
        logits.append(lg)
        layers.append(aux)
        if "expert_idx" in aux:
            routes.append(aux["expert_idx"])
    return logits, {"routes": routes, "layers": layers, "hidden": h_BxSxD}


def mtp_layer(params: dict, cfg: GLM5Config, depth: int, h_BxSxD: torch.Tensor, input_ids_BxS: torch.Tensor,
              ctx: AttnContext, *, experts: ExpertsFn = expert_ffn, remat: bool = False,
              gather: GatherFn = stored):
    """MTP depth `depth` (1-based): (logits [B, S, V], its output h^depth [B, S, D], the decoder layer's aux).
    The embedding and head are the main model's unless the layer holds its own copies (params.MTP_COPIES).
    `gather` as in `apply` (the whole MTP layer is gathered once, outside activation checkpointing)."""
    layer, eps = cfg.num_hidden_layers + depth - 1, cfg.rms_norm_eps
    p = gather(params["model"]["layers"][layer], f"model.layers.{layer}")
    embed = p.get("embed_tokens", params["model"]["embed_tokens"])["weight"]
    e_BxSxD = F.embedding(input_ids_BxS, embed).to(ctx.dtype)
    x_BxSxD = linear(p["eh_proj"], torch.cat([rms_norm(p["enorm"]["weight"], e_BxSxD, eps),
                                              rms_norm(p["hnorm"]["weight"], h_BxSxD, eps)], dim=-1))
    if remat and torch.is_grad_enabled():
        h_BxSxD, _, aux = checkpoint(decoder_layer, p, x_BxSxD, cfg, layer, ctx, None, experts, use_reentrant=False)
    else:
        h_BxSxD, _, aux = decoder_layer(p, x_BxSxD, cfg, layer, ctx, None, experts)
    head = p["shared_head"].get("head")
    if head is None:
        head = params["model"]["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    return linear(head, rms_norm(p["shared_head"]["norm"]["weight"], h_BxSxD, eps)), h_BxSxD, aux


def forward(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, V] of the causal LM, as `GlmMoeDsaForCausalLM` computes them.

    attention_mask: None (causal), 2D [B, S] padding mask (1 keep, 0 pad), or a 4D [B, 1, S, S] mask, boolean
    (True attends) or additive float (0 attends, dtype-min masks), used as given. position_ids [B, S] or [1, S]
    (default 0..S-1); with no attention_mask, positions that restart mark packed documents, and attention stays
    within each document.
    """
    check_input_ids(input_ids, cfg)
    ctx = make_context(cfg, input_ids.shape, attention_mask, position_ids,
                       params["model"]["embed_tokens"]["weight"].dtype, input_ids.device)
    logits, _ = apply(params, cfg, input_ids, ctx)
    return logits


def make_context(cfg: GLM5Config, shape_BxS, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, dtype: torch.dtype, device) -> AttnContext:
    """The attention context of a forward over [B, S] tokens (see `forward` for the mask and position rules)."""
    B, S = shape_BxS
    position_ids = default_positions(position_ids, B, S, device)
    cos, sin = rope_tables(cfg, position_ids, dtype)
    return AttnContext(cos, sin, make_mask(attention_mask, position_ids, B, S, device))


# ---- inputs -------------------------------------------------------------------------------------------------------

def check_input_ids(input_ids: torch.Tensor, cfg: GLM5Config) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), found ids in [{lo}, {hi}]: "
                             f"the tokenizer and the model config disagree on the vocabulary")


def default_positions(position_ids: torch.Tensor | None, B: int, S: int, device) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(S, device=device).expand(B, S)
    if position_ids.ndim != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be [{B}, {S}] or [1, {S}], got {tuple(position_ids.shape)}")
    return position_ids.expand(B, S)


def packed_segments(position_ids_BxS: torch.Tensor) -> torch.Tensor | None:
    """Document ids [B, S] where positions do not step by one (a new packed document starts); None if every row
    is one document."""
    first = position_ids_BxS[:, :1] - 1
    seg = (torch.diff(position_ids_BxS, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((seg[:, -1] == 0).all()) else seg


def make_mask(attention_mask: torch.Tensor | None, position_ids_BxS: torch.Tensor, B: int, S: int, device) -> Mask:
    """The attention mask of a forward over S tokens (queries and keys are the same S positions)."""
    q_index, host = torch.arange(S, device=device), torch.arange(S)
    if attention_mask is None:
        seg = packed_segments(position_ids_BxS)
        return Mask(q_index, S, q_segment=seg, k_segment=seg, q_index_host=host)
    if attention_mask.ndim == 2:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"a 2D attention_mask must be [batch, seq] = [{B}, {S}], got "
                             f"{tuple(attention_mask.shape)}")
        return Mask(q_index, S, key_valid=attention_mask.to(device=device, dtype=torch.bool), q_index_host=host)
    if attention_mask.ndim == 4:
        if attention_mask.shape[0] not in (1, B) or tuple(attention_mask.shape[2:]) != (S, S):
            raise ValueError(f"a 4D attention_mask must be [{B}, 1, {S}, {S}], got {tuple(attention_mask.shape)}")
        return dense_mask(attention_mask.to(device), q_index)
    raise ValueError(f"attention_mask must be 2D [batch, seq] or 4D [batch, 1, seq, seq], got "
                     f"{attention_mask.ndim}D {tuple(attention_mask.shape)}")


def dense_mask(mask_Bx1xSxT: torch.Tensor, q_index: torch.Tensor) -> Mask:
    """A Mask from a 4D mask [B, 1, S, T] of the queries q_index (S of them): boolean (True attends) or additive
    float (0 attends, the dtype's minimum masks, other values are added to the scores)."""
    m = mask_Bx1xSxT[:, 0]
    if m.dtype == torch.bool:
        return Mask(q_index, m.shape[-1], dense=m)
    if not m.dtype.is_floating_point:
        raise ValueError(f"a 4D attention_mask must be bool or float (additive), got {m.dtype}")
    allowed = m > torch.finfo(m.dtype).min / 2
    bias = m.float().masked_fill(~allowed, 0.0)
    return Mask(q_index, m.shape[-1], dense=allowed, bias=bias if bool(bias.ne(0).any()) else None)


# ---- loss ---------------------------------------------------------------------------------------------------------

def shift_labels(labels_BxS: torch.Tensor) -> torch.Tensor:
    """targets [B, S]: the label of the next token at each position; the last position gets IGNORE_INDEX."""
    return F.pad(labels_BxS[:, 1:], (0, 1), value=IGNORE_INDEX)


def mtp_inputs(input_ids_BxS: torch.Tensor, depth: int) -> torch.Tensor:
    """Input ids [B, S] of MTP depth `depth` (>= 1): t_{i+depth} at position i, 0 past the end (ignored there)."""
    return F.pad(input_ids_BxS[:, depth:], (0, depth), value=0)


def mtp_targets(labels_BxS: torch.Tensor, depth: int, position_ids_BxS: torch.Tensor | None = None,
                valid_BxS: torch.Tensor | None = None) -> torch.Tensor:
    """Targets [B, S] of MTP depth `depth` (>= 1): the label of t_{i+depth+1} at position i, IGNORE_INDEX where
    that is past the end, in another packed document than i (documents start where position_ids do not step by
    one), or where i, i+depth or i+depth+1 is padding (valid_BxS 0). Taken on whole sequences, as shift_labels."""
    B, S = labels_BxS.shape
    k = depth + 1
    out = torch.full_like(labels_BxS, IGNORE_INDEX)
    if k >= S:
        return out
    keep = torch.ones(B, S - k, dtype=torch.bool, device=labels_BxS.device)
    if position_ids_BxS is not None:
        pos = position_ids_BxS.expand(B, S)
        seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        keep &= seg[:, k:] == seg[:, :-k]
    if valid_BxS is not None:
        v = valid_BxS.bool()
        keep &= v[:, :-k] & v[:, depth:S - 1] & v[:, k:]
    out[:, :-k] = torch.where(keep, labels_BxS[:, k:], IGNORE_INDEX)
    return out


def cross_entropy_sum(logits_BxSxV: torch.Tensor, targets_BxS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 token cross-entropies, number of targets != IGNORE_INDEX), for token-weighted means.

    The sum is taken in fp64, so a loss summed over ranks or micro-batches does not depend on how the tokens were
    split (the gradient is the same as of an fp32 sum).
    """
    loss_N = F.cross_entropy(wide(logits_BxSxV.flatten(0, 1)), targets_BxS.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
    return loss_N.sum(dtype=torch.float64), (targets_BxS != IGNORE_INDEX).sum()


def causal_lm_loss(logits_BxSxV: torch.Tensor, labels_BxS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: labels shifted by one, IGNORE_INDEX (-100) skipped (0 if none is left)."""
    if labels_BxS.shape != logits_BxSxV.shape[:2]:
        raise ValueError(f"labels must be [batch, seq] = {list(logits_BxSxV.shape[:2])}, got {list(labels_BxS.shape)}")
    total, count = cross_entropy_sum(logits_BxSxV, shift_labels(labels_BxS))
    return (total / count.clamp(min=1)).to(wide_dtype(logits_BxSxV.dtype))
