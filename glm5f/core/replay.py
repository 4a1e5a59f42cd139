"""Routing and indexer replay: the optional batch keys "routing" and "indexer" that make a forward use the experts and
keys a rollout used, their shapes for a config, their check, and their conversion to and from a layer's selections.

Shape suffixes: B batch, S positions, M MoE layers, K experts per token, L indexer layers, T recorded keys (GLM-5) or
pools (GLM-5.3) per position.

The keys, both optional, cut with the tokens like every [B, S, ...] tensor of a batch (`env.split_tokens`):
- "routing" [B, S, M, K] (integer): for the token at each position, each MoE decoder layer's (in layer order, MTP
  layers excluded: `replay_slots`) K = num_experts_per_tok experts, ids in [0, n_routed_experts). A position and
  layer whose K entries are all -1 is not recorded: its router chooses.
- "indexer" [B, S, L, T] (integer): for the query at each position, each layer whose indexer selects (layer order:
  `replay_slots`) the keys it attends, counted as position_ids count (the key's position in its sequence, 0 .. the
  query's position), T = index_topk; for GLM-5.3's pooled indexer the pools it selects, pool g holding the sequence's
  tokens g * index_kpool .. (g + 1) * index_kpool - 1, T = index_topk // index_kpool (the query's own pool's tail is
  added as the indexer adds it). -1 fills unused slots, the recorded entries first; a position whose row is all -1
  attends the indexer's own choice. Positions that see no more keys than the top-k need no record.
Position ids count from 0 at each sequence's first token and step by one (as packed rows and padding give them).
"""

from __future__ import annotations

import torch

from glm5f.core.config import GLM5Config
from glm5f.core.layers import INDEXERS, layer_spec

REPLAY_KEYS = ("routing", "indexer")


def replay_slots(cfg: GLM5Config) -> dict[str, dict[int, int]]:
    """{"routing": {MoE layer: its slot along M}, "indexer": {layer whose indexer selects: its slot along L}}, the
    main decoder layers in layer order (MTP layers are not replayed)."""
    layers = range(cfg.num_hidden_layers)
    moe = [i for i in layers if layer_spec(cfg, i).mlp == "moe"]
    indexed = [i for i in layers if INDEXERS[layer_spec(cfg, i).indexer].selects]
    return {"routing": {layer: m for m, layer in enumerate(moe)},
            "indexer": {layer: j for j, layer in enumerate(indexed)}}


def pool_size(cfg: GLM5Config) -> int:
    """The keys one recorded indexer entry stands for: index_kpool with GLM-5.3's pooled indexer, else 1."""
    pooled = any(layer_spec(cfg, i).indexer == "pooled" for i in range(cfg.num_hidden_layers))
    return cfg.index_kpool if pooled else 1


def replay_shapes(cfg: GLM5Config) -> dict[str, tuple[int, int]]:
    """{"routing": (M, K), "indexer": (L, T)}: the trailing dims of the batch keys for `cfg` (see the module doc)."""
    slots = replay_slots(cfg)
    return {"routing": (len(slots["routing"]), cfg.num_experts_per_tok),
            "indexer": (len(slots["indexer"]), cfg.index_topk // pool_size(cfg))}


def check_shapes(batch: dict, cfg: GLM5Config) -> None:
    """The replay keys' shapes and dtypes against input_ids [B, S] (or [S]) and `cfg`, without reading values."""
    lead = tuple(batch["input_ids"].shape)
    for name, tail in replay_shapes(cfg).items():
        t = batch.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"replay key {name!r} must be an integer tensor {(*lead, *tail)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != (*lead, *tail):
            what = "(MoE layers, experts per token)" if name == "routing" else "(indexer layers, selections)"
            raise ValueError(f"replay key {name!r} must be {(*lead, *tail)} (input_ids' dims, then {what} of this "
                             f"model: glm5f.core.replay.replay_shapes), got {tuple(t.shape)}")


def check_replay(batch: dict, cfg: GLM5Config) -> None:
    """Raise a one-line ValueError unless the batch's replay keys fit `cfg`: shapes as `replay_shapes` (leading dims
    input_ids' [B, S] or [S]); expert ids in [0, n_routed_experts), each position and layer all recorded or all -1;
    recorded keys (pools) -1 or a key (a complete pool) at or before the query's position (position_ids when the batch
    holds them, else 0..S-1). Values may be tensors or anything torch.as_tensor takes."""
    batch = {k: torch.as_tensor(v) if k in ("input_ids", "position_ids", *REPLAY_KEYS) and v is not None else v
             for k, v in batch.items()}
    check_shapes(batch, cfg)
    routing = batch.get("routing")
    if routing is not None and routing.numel():
        E = cfg.n_routed_experts
        lo, hi = int(routing.min()), int(routing.max())
        if lo < -1 or hi >= E:
            bad = routing[(routing < -1) | (routing >= E)][0]
            raise ValueError(f"replay key 'routing' holds expert id {int(bad)}: ids must lie in [0, "
                             f"n_routed_experts={E}) (-1: not recorded)")
        recorded = routing >= 0
        if bool((recorded.any(-1) != recorded.all(-1)).any()):
            raise ValueError("replay key 'routing' has a position and layer with some of its experts -1: record all "
                             f"{cfg.num_experts_per_tok} experts of a position and layer, or none (all -1)")
    indexer = batch.get("indexer")
    if indexer is not None and indexer.numel():
        S = batch["input_ids"].shape[-1]
        pos = batch.get("position_ids")
        pos = torch.arange(S) if pos is None else pos.expand(batch["input_ids"].shape)
        P = pool_size(cfg)
        last = (pos[..., None, None] + 1) // P - 1  # the last complete pool (key, with P = 1) a query sees
        bad = (indexer < -1) | (indexer > last)
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            what = "key position" if P == 1 else f"pool id (pools of {P} keys)"
            raise ValueError(f"replay key 'indexer' holds {what} {int(indexer[tuple(at)])} at {tuple(at)} beyond its "
                             f"query's position {int(pos.expand_as(indexer[..., 0, 0])[tuple(at[:-2])])}: "
                             f"record keys 0..the query's position (-1: unused)")


def key_rows(indexer_BxSxLxT: torch.Tensor, q_index_S: torch.Tensor, position_ids_BxS: torch.Tensor,
             cfg: GLM5Config) -> torch.Tensor:
    """The recorded keys as the rows a layer's top-k holds [B, S, L, T]: each key's (pool's last key's) index along
    the keys, q_index - position + key (pool g: g * index_kpool + index_kpool - 1); -1 stays -1."""
    P = pool_size(cfg)
    start_BxS = q_index_S.to(position_ids_BxS.device)[None] - position_ids_BxS  # each query's sequence start
    rows = start_BxS[..., None, None] + indexer_BxSxLxT * P + (P - 1)
    return torch.where(indexer_BxSxLxT >= 0, rows, -1)


def replayed(own_BxSxK: torch.Tensor, recorded_BxSxK: torch.Tensor, allowed_at) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [B, S, K], allowed [B, S, K]) a layer attends under replay: the recorded rows (`key_rows`) where a query
    has a record, its own top-k elsewhere; `allowed_at(idx)` says which keys its mask allows (`Env.mask.at`), and a
    recorded slot of -1 is not allowed. A record wider than the own top-k (fewer keys than selections) keeps its
    leading entries."""
    recorded_BxSxK = recorded_BxSxK[..., :own_BxSxK.shape[-1]]
    has_BxS = (recorded_BxSxK >= 0).any(-1)
    idx_BxSxK = torch.where(has_BxS[..., None], recorded_BxSxK.clamp(min=0), own_BxSxK)
    return idx_BxSxK, allowed_at(idx_BxSxK) & (~has_BxS[..., None] | (recorded_BxSxK >= 0))


def recorded_keys(idx_BxSxK: torch.Tensor, allowed_BxSxK: torch.Tensor, q_index_S: torch.Tensor,
                  position_ids_BxS: torch.Tensor, cfg: GLM5Config) -> torch.Tensor:
    """A selection (a layer's top-k rows and which of them count; GLM-5.3: its pooled selection, pools' tokens in
    order then its tail) as the "indexer" entries of one layer [B, S, T], the inverse of `key_rows`."""
    P, T = pool_size(cfg), replay_shapes(cfg)["indexer"][1]
    ends, ok = idx_BxSxK[..., P - 1:T * P:P], allowed_BxSxK[..., P - 1:T * P:P]
    start_BxS = q_index_S.to(position_ids_BxS.device)[None] - position_ids_BxS
    out = torch.where(ok, (ends - start_BxS[..., None] - (P - 1)) // P, -1)
    return torch.nn.functional.pad(out, (0, T - out.shape[-1]), value=-1)


def record(aux: dict, cfg: GLM5Config, mask, position_ids_BxS: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"routing": [B, S, M, K], "indexer": [B, S, L, T]} of a forward's aux (`model.apply` under an Env with
    `record`), in the batch keys' format; a layer that selected no keys (every key within the top-k) records -1."""
    B, S = position_ids_BxS.shape
    slots, T = replay_slots(cfg), replay_shapes(cfg)["indexer"][1]
    layers = aux["layers"]
    routing = [layers[i]["expert_idx"].view(B, S, -1) for i in slots["routing"]]
    indexer = []
    for i in slots["indexer"]:
        a = layers[i]
        if "selected_keys" not in a:
            indexer.append(position_ids_BxS.new_full((B, S, T), -1))
            continue
        allowed = a["selected_allowed"] if a["selected_allowed"] is not None else mask.at(a["selected_keys"])
        indexer.append(recorded_keys(a["selected_keys"], allowed, mask.q_index, position_ids_BxS, cfg))
    K = cfg.num_experts_per_tok
    return {"routing": torch.stack(routing, 2) if routing else position_ids_BxS.new_zeros(B, S, 0, K),
            "indexer": torch.stack(indexer, 2) if indexer else position_ids_BxS.new_zeros(B, S, 0, T)}
