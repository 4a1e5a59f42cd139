"""Log-probabilities of given tokens under the model, through the chunked LM head (the [tokens, vocab] logits are
never held whole): the quantity preference and policy-gradient objectives are made of.

Shape suffixes: B batch, S sequence, D hidden, N tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from glm5f.core.config import GLM5Config
from glm5f.model.env import make_env
from glm5f.model.head import head_token_losses, shift_labels
from glm5f.model.lora import LoraSpec
from glm5f.model.tree import TreeBatch
from glm5f.model.decoder import hidden_states, input_batch, main_head, mtp_layer
from glm5f.parallel.layout import Layout
from glm5f.core import IGNORE_INDEX


def head_logprobs(head: dict, x_BxSxD: torch.Tensor, targets_BxS: torch.Tensor, eps: float,
                  chunk_elems: int | None = None) -> torch.Tensor:
    """log p(targets[b, s]) [B, S] of hidden states x [B, S, D] through `head` (`model.main_head`), chunk by chunk
    (`head.HeadLosses`); 0 where the target is IGNORE_INDEX. Differentiable in x and the head's weights; in fp32
    (fp64 for fp64 weights)."""
    B, S = targets_BxS.shape
    return -head_token_losses(head, x_BxSxD, targets_BxS, eps, chunk_elems).view(B, S)


def token_logprobs(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   lora: LoraSpec | None = None, layout: Layout | None = None, dtype: torch.dtype | None = None,
                   routing: torch.Tensor | None = None, indexer: torch.Tensor | None = None) -> torch.Tensor:
    """log p(targets[b, s] | input_ids[b, :s+1]) [B, S]: the model's log-probability of each target token, 0 where
    a target is IGNORE_INDEX. targets default to the next token (`head.shift_labels(input_ids)`: the last
    position has none). attention_mask, position_ids, lora, routing and indexer (replayed experts and keys,
    `glm5f.core.replay`) as `glm5f.forward`'s; dtype: the activations' (the weights' by default). Under a `layout`
    (CP, dp_shard) the result is this rank's share of the rows and positions, as `env.make_env` cuts them; the targets are taken on whole sequences before the cut."""
    batch = input_batch(cfg, input_ids, attention_mask, position_ids, routing, indexer)
    if targets is None:
        targets = shift_labels(input_ids)
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets must be [batch, seq] = {list(input_ids.shape)} like input_ids, got "
                         f"{list(targets.shape)}")
    batch["targets"] = targets
    spec = None if lora is None else dataclasses.replace(lora, dropout=0.0)
    dtype = dtype or params["model"]["embed_tokens"]["weight"].dtype
    local, env = make_env(cfg, batch, dtype, layout, lora=spec)
    top = env.weights({**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}})
    compute = {**top, "model": {**top["model"], "layers": params["model"]["layers"]}}
    hidden_BxSxD, _ = hidden_states(compute, cfg, local["input_ids"], env)
    return head_logprobs(main_head(compute, cfg), hidden_BxSxD, local["targets"], cfg.rms_norm_eps)


def tree_logprobs(params: dict, cfg: GLM5Config, tb: TreeBatch, *, lora: LoraSpec | None = None,
                  dtype: torch.dtype | None = None, mtp_depths: int = 0) -> torch.Tensor:
    """log p [N] of each next-token pair of a tree batch (`glm5f.model.tree.TreeBatch`: the token at tb.src[n]
    predicts the one at tb.dst[n]), each equal to the log-probability that token has in every unshared sequence
    holding the pair (`token_logprobs` of that sequence alone). lora and dtype as `token_logprobs`'.

    With mtp_depths, [1 + mtp_depths, N]: row d > 0 the MTP depth d head's log-probability of the pair's dst
    token at the sequence position d before src (whose depth-d input is the token at src), 0 where src lies less
    than d tokens into its path. Depth d runs on the tree shifted by d (`Tree.shifted`): its node at src holds
    t_src as input and depth d - 1's state at src's predecessor, so every path's MTP terms are its unshared ones."""
    batch = input_batch(cfg, tb.input_ids)
    spec = None if lora is None else dataclasses.replace(lora, dropout=0.0)
    dtype = dtype or params["model"]["embed_tokens"]["weight"].dtype
    local, env = make_env(cfg, {**batch, "tree": tb.tree}, dtype, lora=spec)
    top = env.weights({**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}})
    compute = {**top, "model": {**top["model"], "layers": params["model"]["layers"]}}
    h_BxSxD, _ = hidden_states(compute, cfg, local["input_ids"], env)
    targets_N, eps = tb.targets, cfg.rms_norm_eps
    out = [head_logprobs(main_head(compute, cfg), h_BxSxD.flatten(0, 1)[tb.src][None], targets_N[None], eps)[0]]
    prev_BxSxD = tb.tree.prev.clamp(min=0)[..., None].expand(-1, -1, h_BxSxD.shape[-1])
    src_position_N = tb.tree.position.flatten()[tb.src]
    for d in range(1, mtp_depths + 1):
        _, env_d = make_env(cfg, {**batch, "tree": tb.tree.shifted(d)}, dtype, lora=spec)
        h_BxSxD, head, _ = mtp_layer(compute, cfg, d, h_BxSxD.gather(1, prev_BxSxD), local["input_ids"], env_d)
        t_N = torch.where(src_position_N >= d, targets_N, IGNORE_INDEX)
        out.append(head_logprobs(head, h_BxSxD.flatten(0, 1)[tb.src][None], t_N[None], eps)[0])
    return out[0] if mtp_depths == 0 else torch.stack(out)


__all__ = ["IGNORE_INDEX", "head_logprobs", "token_logprobs", "tree_logprobs"]
