"""Log-probabilities of given tokens under the model, through the chunked LM head (the [tokens, vocab] logits are
never held whole): the quantity preference and policy-gradient objectives are made of.

Shape suffixes: B batch, S sequence, D hidden, N tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from glm5f.core.config import GLM5Config
from glm5f.model.env import make_env
from glm5f.model.head import HeadLosses, head_chunk_rows, shift_labels
from glm5f.model.lora import LoraSpec
from glm5f.model.tree import TreeBatch
from glm5f.model.decoder import hidden_states, input_batch, main_head
from glm5f.parallel.layout import Layout
from glm5f.core import IGNORE_INDEX


def head_logprobs(head: dict, x_BxSxD: torch.Tensor, targets_BxS: torch.Tensor, eps: float,
                  chunk_elems: int | None = None) -> torch.Tensor:
    """log p(targets[b, s]) [B, S] of hidden states x [B, S, D] through `head` (`model.main_head`), chunk by chunk
    (`loss.HeadLosses`); 0 where the target is IGNORE_INDEX. Differentiable in x and the head's weights; in fp32
    (fp64 for fp64 weights)."""
    B, S = targets_BxS.shape
    rows = head_chunk_rows(head["weight"].shape[0], chunk_elems)
    loss_N = HeadLosses.apply(x_BxSxD.flatten(0, 1), head["norm"], head["weight"], targets_BxS.flatten(), eps, rows)
    return -loss_N.view(B, S)


def token_logprobs(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   lora: LoraSpec | None = None, layout: Layout | None = None, dtype: torch.dtype | None = None,
                   routing: torch.Tensor | None = None, indexer: torch.Tensor | None = None) -> torch.Tensor:
    """log p(targets[b, s] | input_ids[b, :s+1]) [B, S]: the model's log-probability of each target token, 0 where
    a target is IGNORE_INDEX. targets default to the next token (`loss.shift_labels(input_ids)`: the last
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
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """log p [N] of each next-token pair of a tree batch (`glm5f.model.tree.TreeBatch`: the token at tb.src[n]
    predicts the one at tb.dst[n]), each equal to the log-probability that token has in every unshared sequence
    holding the pair (`token_logprobs` of that sequence alone). lora and dtype as `token_logprobs`'."""
    batch = input_batch(cfg, tb.input_ids)
    batch["tree"] = tb.tree
    spec = None if lora is None else dataclasses.replace(lora, dropout=0.0)
    dtype = dtype or params["model"]["embed_tokens"]["weight"].dtype
    local, env = make_env(cfg, batch, dtype, lora=spec)
    top = env.weights({**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}})
    compute = {**top, "model": {**top["model"], "layers": params["model"]["layers"]}}
    hidden_BxSxD, _ = hidden_states(compute, cfg, local["input_ids"], env)
    x_1xNxD = hidden_BxSxD.flatten(0, 1)[tb.src][None]
    return head_logprobs(main_head(compute, cfg), x_1xNxD, tb.targets[None], cfg.rms_norm_eps)[0]


__all__ = ["IGNORE_INDEX", "head_logprobs", "token_logprobs", "tree_logprobs"]
