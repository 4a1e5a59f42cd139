"""Autoregressive decoding on an append-only cache: per layer the latent rows (compressed kv + rope key) and the
indexer keys. Prefill runs the prompt in one pass, then one token at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5f.attention import AttnContext, Mask
from glm5f.config import GLM5Config
from glm5f.model import apply, check_input_ids
from glm5f.ops import rope_tables


@dataclass
class Cache:
    """latent[layer]: [B, capacity, kv_lora_rank + qk_rope_head_dim]; index_keys[layer]: [B, capacity,
    index_head_dim] (None on shared-indexer layers); `length` positions are filled."""

    latent: list[torch.Tensor]
    index_keys: list[torch.Tensor | None]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.latent[0].shape[1]


def init_cache(cfg: GLM5Config, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Cache:
    latent = [torch.zeros(batch, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=device)
              for _ in range(cfg.num_hidden_layers)]
    keys = [torch.zeros(batch, capacity, cfg.index_head_dim, dtype=dtype, device=device)
            if cfg.has_indexer(i) else None for i in range(cfg.num_hidden_layers)]
    return Cache(latent, keys)


@torch.no_grad()
def extend(params: dict, cfg: GLM5Config, cache: Cache, input_ids_BxS: torch.Tensor, position_ids_BxS: torch.Tensor,
           key_valid_BxT: torch.Tensor | None = None) -> torch.Tensor:
    """Run S new tokens against the cache (appending their keys) and return their logits [B, S, V].

    key_valid_BxT: padding of every position so far including the new ones (None: no padding).
    """
    B, S = input_ids_BxS.shape
    start, stop = cache.length, cache.length + S
    if stop > cache.capacity:
        raise ValueError(f"cache holds {cache.capacity} positions; {start} used, {S} more asked for. "
                         f"Make the cache with a larger capacity")

    def collect(layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        buf = cache.latent[layer] if name == "latent" else cache.index_keys[layer]
        buf[:, start:stop] = local
        return buf[:, :stop]

    mask = Mask(torch.arange(start, stop, device=input_ids_BxS.device), stop,
                key_valid=None if key_valid_BxT is None else key_valid_BxT[:, :stop],
                q_index_host=torch.arange(start, stop))
    cos, sin = rope_tables(cfg, position_ids_BxS, cache.latent[0].dtype)
    logits, _ = apply(params, cfg, input_ids_BxS, AttnContext(cos, sin, mask, collect))
    cache.length = stop
    return logits


def sample(logits_BxV: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens [B]: argmax when temperature == 0, else sampled from softmax(logits / temperature) restricted
    to the smallest set of most likely tokens whose probability reaches top_p."""
    if temperature <= 0:
        return logits_BxV.argmax(-1)
    probs_BxV = torch.softmax(logits_BxV.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_BxV, order_BxV = probs_BxV.sort(dim=-1, descending=True)
        before_BxV = sorted_BxV.cumsum(-1) - sorted_BxV  # mass of the more likely tokens
        sorted_BxV = sorted_BxV.masked_fill(before_BxV >= top_p, 0)  # the most likely one always stays
        probs_BxV = torch.zeros_like(probs_BxV).scatter(-1, order_BxV, sorted_BxV)
    return torch.multinomial(probs_BxV, 1, generator=generator)[:, 0]


@torch.no_grad()
def stream(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, max_new_tokens: int, *,
           attention_mask: torch.Tensor | None = None, eos_token_id: int | None = None, temperature: float = 0.0,
           top_p: float = 1.0, generator: torch.Generator | None = None):
    """Yield the new tokens [B] one step at a time (see `generate`)."""
    check_input_ids(input_ids, cfg)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    B, S = input_ids.shape
    device = input_ids.device
    dtype = params["model"]["embed_tokens"]["weight"].dtype
    cache = init_cache(cfg, B, S + max_new_tokens, dtype, device)
    if attention_mask is None:
        valid = None
        positions = torch.arange(S, device=device).expand(B, S)
    else:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must be [{B}, {S}], got {tuple(attention_mask.shape)}")
        valid = torch.ones(B, S + max_new_tokens, dtype=torch.bool, device=device)
        valid[:, :S] = attention_mask.bool()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    next_pos = positions[:, -1:] + 1
    logits = extend(params, cfg, cache, input_ids, positions, valid)[:, -1]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        if eos_token_id is not None:
            token = torch.where(done, torch.full_like(token, eos_token_id), token)
            done = done | (token == eos_token_id)
        yield token
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        logits = extend(params, cfg, cache, token[:, None], next_pos, valid)[:, -1]
        next_pos = next_pos + 1


def generate(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, eos_token_id: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Prompt + up to max_new_tokens tokens [B, S + n]. Greedy when temperature == 0, else sampled (nucleus
    sampling with top_p < 1).

    attention_mask [B, S] marks left padding of the prompts (positions then count real tokens only). Rows that
    produced eos_token_id keep emitting it; decoding stops early once every row has.
    """
    new = stream(params, cfg, input_ids, max_new_tokens, attention_mask=attention_mask, eos_token_id=eos_token_id,
                 temperature=temperature, top_p=top_p, generator=generator)
    return torch.cat([input_ids] + [t[:, None] for t in new], dim=1)
