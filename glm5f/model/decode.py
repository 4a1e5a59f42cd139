"""Autoregressive decoding on a cache: per layer its kinds' buffers (`layers.layer_cache`: the latent rows and the
indexer keys appended per position, KDA's recurrent state carried). Prefill runs the prompt in one pass (once per
group of decodes that share it, `expand_cache`), then one token at a time, or (draft="mtp") the MTP layers propose
tokens that the main model verifies in one pass (self-speculative decoding, exact greedy output)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from glm5f.core import replay
from glm5f.core.config import GLM5Config
from glm5f.model.env import Env, Mask, make_env
from glm5f.core.layers import carries_state, layer_cache
from glm5f.model.head import mtp_inputs
from glm5f.model.decoder import apply, check_input_ids, head_logits, mtp_layer
from glm5f.core.ops import rope_tables
from glm5f.parallel.layout import Layout

Eos = int | tuple[int, ...] | None | str  # an eos id, several, None (never stop) or "config" (cfg.eos_token_id)


@dataclass
class Cache:
    """layers[layer]: that layer's buffers by name (`layers.layer_cache`; MLA + DSA: "latent" [B, capacity,
    kv_lora_rank + qk_rope_head_dim], with its own indexer "index_keys" [B, capacity, index_head_dim]; KDA: its
    recurrent state and short-convolution inputs), in `dtype` on `device`; `length` positions are filled.
    recurrent[layer]: that layer's buffers are a state carried from call to call, which holds all `length`
    positions and cannot drop any."""

    layers: list[dict[str, torch.Tensor]]
    capacity: int
    dtype: torch.dtype
    device: torch.device
    recurrent: tuple[bool, ...] = ()
    length: int = 0
    state_length: int = 0  # the positions the recurrent states hold


def init_cache(cfg: GLM5Config, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Cache:
    layers = range(cfg.num_hidden_layers)
    return Cache([layer_cache(cfg, i, batch, capacity, dtype, device) for i in layers], capacity, dtype,
                 torch.device(device), tuple(carries_state(cfg, i) for i in layers))


def expand_cache(cache: Cache, rows_R: torch.Tensor) -> Cache:
    """A cache of R rows, its row r a copy of `cache`'s row rows_R[r] (e.g. each prompt's prefill copied to the
    rows of its group), length and state kept. Every buffer of every layer is copied: the rule is that a kind's
    cache buffer holds the rows on dim 0 (`layers.layer_cache`); a buffer whose dim 0 is not the cache's row count
    is refused, so a kind that lays a buffer out otherwise fails here instead of decoding from another row."""
    dim0 = [buf.shape[0] for layer in cache.layers for buf in layer.values()]
    rows = max(set(dim0), key=dim0.count)  # the cache's rows: what (nearly) every buffer holds on dim 0
    odd = [f"layer {i} {name!r} {list(buf.shape)}" for i, layer in enumerate(cache.layers)
           for name, buf in layer.items() if buf.shape[0] != rows]
    if odd:
        raise ValueError(f"a cache buffer must hold the cache's {rows} rows on dim 0, but {', '.join(odd)} does "
                         f"not; lay the kind's buffers out [rows, ...] (its Kind.cache)")
    index_R = rows_R.to(device=cache.device, dtype=torch.long)
    layers = [{name: buf.index_select(0, index_R) for name, buf in layer.items()} for layer in cache.layers]
    return replace(cache, layers=layers)


class CacheLayout(Layout):
    """One process decoding: a layer's keys over all positions are its new keys appended to the cache at
    positions start:stop, read back with the ones before."""

    def __init__(self, cache: Cache, start: int, stop: int):
        super().__init__(cache.device)
        self.cache, self.start, self.stop = cache, start, stop

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        buf = self.cache.layers[layer][name]
        buf[:, self.start:self.stop] = local
        return buf[:, :self.stop]

    def state(self, layer: int) -> dict[str, torch.Tensor] | None:
        return self.cache.layers[layer] if self.cache.recurrent[layer] else None


@torch.no_grad()
def extend(params: dict, cfg: GLM5Config, cache: Cache, input_ids_BxS: torch.Tensor, position_ids_BxS: torch.Tensor,
           key_valid_BxT: torch.Tensor | None = None, *, with_hidden: bool = False, record: bool = False):
    """Run S new tokens against the cache (appending their keys) and return their logits [B, S, V] (and the
    last layer's hidden states [B, S, D] before the final norm with `with_hidden`; then with `record` the routing
    and indexer selections of the S positions, {"routing": [B, S, M, K], "indexer": [B, S, L, T]} in the replay
    batch keys' format, `replay.record`).

    key_valid_BxT: padding of every position so far including the new ones (None: no padding). Setting
    `cache.length` back drops the last positions (they are overwritten by the next extend), in a model without
    recurrent layers (KDA's state holds every position so far).
    """
    B, S = input_ids_BxS.shape
    start, stop = cache.length, cache.length + S
    if stop > cache.capacity:
        raise ValueError(f"cache holds {cache.capacity} positions; {start} used, {S} more asked for. "
                         f"Make the cache with a larger capacity")
    if any(cache.recurrent) and start != cache.state_length:
        raise ValueError(f"the cache's recurrent states (KDA layers) hold {cache.state_length} positions and cannot "
                         f"drop any, but cache.length was set to {start}: decode such a model forward only")

    mask = Mask(torch.arange(start, stop, device=input_ids_BxS.device), stop,
                key_valid=None if key_valid_BxT is None else key_valid_BxT[:, :stop],
                q_index_host=range(start, stop))
    cos, sin = rope_tables(cfg, position_ids_BxS, cache.dtype)
    env = Env(cos, sin, mask, CacheLayout(cache, start, stop), record=record)
    logits, aux = apply(params, cfg, input_ids_BxS, env)
    cache.length = cache.state_length = stop
    out = (logits,) + ((aux["hidden"],) if with_hidden else ()) + \
        ((replay.record(aux, cfg, mask, position_ids_BxS),) if record else ())
    return out if len(out) > 1 else logits


def sample(logits_BxV: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
    """Next tokens [B]: argmax when temperature == 0, else sampled from softmax(logits / temperature) restricted
    to the smallest set of most likely tokens whose probability reaches top_p. `generator`: one for all rows, or a
    list of G, the i-th drawing the i-th of G equal runs of rows."""
    if isinstance(generator, list):
        n = len(logits_BxV) // len(generator)
        return torch.cat([sample(logits_BxV[i * n:(i + 1) * n], temperature, top_p, g)
                          for i, g in enumerate(generator)])
    if temperature <= 0:
        return logits_BxV.argmax(-1)
    probs_BxV = torch.softmax(logits_BxV.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_BxV, order_BxV = probs_BxV.sort(dim=-1, descending=True)
        before_BxV = sorted_BxV.cumsum(-1) - sorted_BxV  # mass of the more likely tokens
        sorted_BxV = sorted_BxV.masked_fill(before_BxV >= top_p, 0)  # the most likely one always stays
        probs_BxV = torch.zeros_like(probs_BxV).scatter(-1, order_BxV, sorted_BxV)
    return torch.multinomial(probs_BxV, 1, generator=generator)[:, 0]


def stop_ids(cfg: GLM5Config, eos_token_id: Eos, device: torch.device) -> torch.Tensor | None:
    """The ids [E] decoding stops at: `eos_token_id`'s (an id or a tuple of ids), with "config" the config's
    eos_token_id; None when there is none."""
    if isinstance(eos_token_id, str):
        if eos_token_id != "config":
            raise ValueError(f"eos_token_id must be an id, a tuple of ids, None (never stop) or 'config' (the "
                             f"config's eos_token_id), got {eos_token_id!r}")
        eos_token_id = cfg.eos_token_id
    if eos_token_id is None:
        return None
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


@torch.no_grad()
def stream(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, max_new_tokens: int, *,
           attention_mask: torch.Tensor | None = None, eos_token_id: Eos = "config", temperature: float = 0.0,
           top_p: float = 1.0, generator: torch.Generator | list[torch.Generator] | None = None,
           with_logits: bool = False, record: bool = False, group: int = 1):
    """Yield the new tokens [B] one step at a time (see `generate`); with `with_logits`, each with the logits
    [B, V] it was chosen from; with `record`, then the routing and indexer selections of the positions run to choose
    it (`extend`: the prompt's S positions for the first token, the previous token's one after), as tuples.
    Concatenated along dim 1 they are the "routing" and "indexer" replay keys (`glm5f.core.replay`) of the prompt and
    completion but its last token; with left padding, a row's keys count from its first real token.

    group: each prompt row is decoded `group` times, as rows b * group .. (b + 1) * group - 1 of the B * group the
    steps yield: the prompt is run once, and its cache (`expand_cache`), last logits and record are copied to its
    group's rows before the first token is sampled from them. The steps are those of a call with each prompt row
    repeated `group` times (input_ids.repeat_interleave(group, 0)): the same draws of the same `generator` over
    the same rows, so the same tokens wherever the prompt's logits come out equal from B rows and from B * group
    (a batch's size may change rounding); only the prompt's compute and activations are B rows."""
    if group < 1:
        raise ValueError(f"group must be >= 1 (decodes per prompt row), got {group}")
    valid, positions = prompt_positions(input_ids, cfg, attention_mask, max_new_tokens)
    eos = stop_ids(cfg, eos_token_id, input_ids.device)
    B, S = input_ids.shape
    cache = init_cache(cfg, B, S + max_new_tokens, params["model"]["embed_tokens"]["weight"].dtype, input_ids.device)

    def run(cache, ids_BxS, positions_BxS, valid):  # (the last position's logits [B, V], the positions' record)
        out = extend(params, cfg, cache, ids_BxS, positions_BxS, valid, record=record)
        logits_BxSxV, seen = out if record else (out, None)
        return logits_BxSxV[:, -1], seen

    logits, seen = run(cache, input_ids, positions[:, :S], valid)
    if group > 1:  # the prompt's cache, logits, record, padding and positions copied to its group's rows
        rows_R = torch.arange(B, device=input_ids.device).repeat_interleave(group)
        cache, logits, positions = expand_cache(cache, rows_R), logits[rows_R], positions[rows_R]
        valid = None if valid is None else valid[rows_R]
        seen = None if seen is None else {k: v[rows_R] for k, v in seen.items()}
        B = B * group
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    token = None
    for step in range(max_new_tokens):
        new = sample(logits, temperature, top_p, generator)
        if eos is not None:  # a row that is done repeats the eos it emitted
            new = new if token is None else torch.where(done, token, new)
            done = done | torch.isin(new, eos)
        token = new
        out = (token,) + ((logits,) if with_logits else ()) + ((seen,) if record else ())
        yield out if len(out) > 1 else token
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        logits, seen = run(cache, token[:, None], positions[:, S + step:S + step + 1], valid)


def prompt_positions(input_ids: torch.Tensor, cfg: GLM5Config, attention_mask: torch.Tensor | None,
                     max_new_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(valid [B, S + max_new_tokens]: the left padding of the prompts, None without any; positions [B, S +
    max_new_tokens]: the prompt's real tokens counted from 0, the new tokens after them), the prompt checked."""
    check_input_ids(input_ids, cfg)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    B, S = input_ids.shape
    capacity, device = S + max_new_tokens, input_ids.device
    if attention_mask is None:
        return None, torch.arange(capacity, device=device).expand(B, capacity)
    if tuple(attention_mask.shape) != (B, S):
        raise ValueError(f"attention_mask must be [{B}, {S}], got {tuple(attention_mask.shape)}")
    valid = torch.ones(B, capacity, dtype=torch.bool, device=device)
    valid[:, :S] = attention_mask.bool()
    prompt_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return valid, torch.cat([prompt_pos, prompt_pos[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)], 1)


def generate(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, eos_token_id: Eos = "config",
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
             draft: str | None = None, stats: dict | None = None) -> torch.Tensor:
    """Prompt + up to max_new_tokens tokens [B, S + n]. Greedy when temperature == 0, else sampled (nucleus
    sampling with top_p < 1).

    attention_mask [B, S] marks left padding of the prompts (positions then count real tokens only). Decoding
    stops at eos_token_id: by default ("config") the config's cfg.eos_token_id, as Transformers' generate does;
    an id or a tuple of ids; None never stops (always max_new_tokens new tokens). A row that produced an eos keeps
    emitting it; decoding stops early once every row has.

    draft="mtp" (greedy only): the MTP layers draft cfg.mtp_depths tokens per step (one per MTP layer, or
    mtp_shared_depths through the one shared layer), the main model checks them in one pass; the output is the
    greedy one. A `stats` dict is filled with "proposed" and "accepted" draft tokens (summed over rows),
    "acceptance_rate" (accepted / proposed; 0.0 if none was), "steps" (main-model passes after the prompt's)
    and "tokens_per_step" (new tokens per such pass: 1 + the accepted drafts).
    """
    if draft is not None:
        if draft != "mtp":
            raise ValueError(f"draft must be None or 'mtp', got {draft!r}")
        if temperature > 0:
            raise ValueError(f"draft='mtp' verifies greedy tokens only: pass temperature=0, got {temperature}")
        new = speculative(params, cfg, input_ids, max_new_tokens, attention_mask=attention_mask,
                          eos_token_id=eos_token_id, stats=stats)
        return torch.cat([input_ids, new], dim=1)
    new = stream(params, cfg, input_ids, max_new_tokens, attention_mask=attention_mask, eos_token_id=eos_token_id,
                 temperature=temperature, top_p=top_p, generator=generator)
    return torch.cat([input_ids] + [t[:, None] for t in new], dim=1)


def mtp_propose(params: dict, cfg: GLM5Config, tokens_BxM: torch.Tensor, hidden_BxNxD: torch.Tensor,
                positions_BxN: torch.Tensor, valid_BxN: torch.Tensor | None, n: int) -> torch.Tensor:
    """Draft tokens [B, n] following tokens_BxM, from the MTP depths 1..n run over the N = M - 1 positions whose
    main hidden states hidden_BxNxD are known (recomputed in full each time: simple, not fast). Depth d at the
    last position predicts token M - 1 + d from the tokens so far and the drafts of the depths before it."""
    N = hidden_BxNxD.shape[1]
    batch = {"input_ids": tokens_BxM[:, :N], "position_ids": positions_BxN}
    if valid_BxN is not None:
        batch["attention_mask"] = valid_BxN
    _, env = make_env(cfg, batch, hidden_BxNxD.dtype)
    seq_BxT, h_BxNxD = tokens_BxM, hidden_BxNxD
    for d in range(1, n + 1):
        h_BxNxD, head, _ = mtp_layer(params, cfg, d, h_BxNxD, mtp_inputs(seq_BxT, d)[:, :N], env)
        logits_BxV = head_logits(head, h_BxNxD[:, -1], cfg.rms_norm_eps)
        seq_BxT = torch.cat([seq_BxT, logits_BxV.argmax(-1, keepdim=True)], dim=1)
    return seq_BxT[:, tokens_BxM.shape[1]:]


@torch.no_grad()
def speculative(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, max_new_tokens: int, *,
                attention_mask: torch.Tensor | None = None, eos_token_id: Eos = "config",
                stats: dict | None = None) -> torch.Tensor:
    """The greedy new tokens [B, n] by self-speculative decoding (see `generate`, draft="mtp").

    Each step the MTP layers draft k tokens after the last one, the main model runs the last token and the
    drafts against the cache, and the leading drafts that equal its greedy choices (in every row) are kept with
    its next token; the cache drops the rest. So each step adds 1 to k + 1 tokens, all of them greedy."""
    valid, positions = prompt_positions(input_ids, cfg, attention_mask, max_new_tokens)
    eos = stop_ids(cfg, eos_token_id, input_ids.device)
    depths, layers = cfg.mtp_depths, cfg.num_nextn_predict_layers
    if depths < 1 or len(params["model"]["layers"]) < cfg.num_hidden_layers + layers:
        raise ValueError(f"draft='mtp' needs MTP layers: the config has num_nextn_predict_layers={layers} and the "
                         f"params {len(params['model']['layers']) - cfg.num_hidden_layers} past the main layers")
    B, S = input_ids.shape
    device, dtype = input_ids.device, params["model"]["embed_tokens"]["weight"].dtype
    capacity = S + max_new_tokens
    proposed = accepted = steps = 0
    tokens = input_ids
    if max_new_tokens:
        cache = init_cache(cfg, B, capacity, dtype, device)
        logits, hidden = extend(params, cfg, cache, input_ids, positions[:, :S], valid, with_hidden=True)
        tokens = torch.cat([input_ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    while tokens.shape[1] - S < max_new_tokens:
        if eos is not None and bool(torch.isin(tokens[:, S:], eos).any(-1).all()):
            break
        M = tokens.shape[1]  # the cache and `hidden` hold positions 0..M-2; token M-1 is not run yet
        k = min(depths, S + max_new_tokens - M - 1)
        drafts = mtp_propose(params, cfg, tokens, hidden, positions[:, :M - 1],
                             None if valid is None else valid[:, :M - 1], k)
        logits, new_hidden = extend(params, cfg, cache, torch.cat([tokens[:, -1:], drafts], dim=1),
                                    positions[:, M - 1:M + k], valid, with_hidden=True)
        greedy = logits.argmax(-1)  # [B, k + 1]: the main model's token after each of them
        a = int((drafts == greedy[:, :k]).long().cumprod(-1).sum(-1).min()) if k else 0
        tokens = torch.cat([tokens, greedy[:, :a + 1]], dim=1)
        hidden = torch.cat([hidden, new_hidden[:, :a + 1]], dim=1)
        cache.length = M + a  # keep token M-1 and the a accepted drafts
        proposed, accepted, steps = proposed + B * k, accepted + B * a, steps + 1
    if stats is not None:
        stats.update(proposed=proposed, accepted=accepted, acceptance_rate=accepted / proposed if proposed else 0.0,
                     steps=steps, tokens_per_step=(steps + accepted / B) / steps if steps else 0.0)
    new = tokens[:, S:]
    if eos is not None and new.shape[1]:  # as `stream`: a row's eos repeats once emitted, stop when all did
        done = torch.isin(new, eos).long().cummax(-1).values.bool()
        first = done.long().argmax(-1, keepdim=True)  # each row's first eos (0 in a row without one: unused)
        after = torch.cat([torch.zeros_like(done[:, :1]), done[:, :-1]], dim=1)
        new = torch.where(after, new.gather(1, first), new)
        all_done = done.all(0)
        if bool(all_done.any()):
            new = new[:, :int(all_done.nonzero()[0]) + 1]
    return new
