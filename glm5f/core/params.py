"""The parameter pytree: nested dicts (and a list of layers) whose paths are the checkpoint's key names.

`model.layers.3.self_attn.q_a_proj.weight` is `params["model"]["layers"][3]["self_attn"]["q_a_proj"]["weight"]`.
Routed experts are stacked on a leading expert axis: `mlp.experts.gate_proj.weight` is [E, moe_inter, hidden].
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from glm5f.core.config import GLM5Config
from glm5f.core.layers import Leaf, LeafKind, layer_params, leaf_rows, linear_leaves, norm_leaves
from glm5f.core.ops import wide_dtype


# The one table of what each leaf is, by path (re.search on "." + path; the first match wins): each layer kind's
# rows (`layers.leaf_rows`), then the LoRA factors'. Compute dtypes (`leaf_dtype`), the optimizer
# (`optim.leaf_rule`), sharding (`parallel.MESH_RULES` by axes), the memory plan and the checkpoint keys (`hf`:
# one key per routed expert) all read it. As in the reference, the router and the indexer's head stay fp32. Axes:
# vocab, embed (hidden size), heads (MLA heads), mlp (an MLP's hidden width), experts (routed experts, stacked
# [E, out, in]), router (one row per expert), q_lora / kv_lora (the latent ranks), latent (kv_lora + rope: a latent
# row), index_heads / index_dim (the indexer's), lora_rank (a LoRA adapter's rank: the rows below the table).
def leaf_kinds() -> list:
    """LEAF_KINDS: the (compiled pattern, LeafKind) rows of the kinds in `glm5f.core.layers`' tables as they stand."""
    return _compiled(tuple(leaf_rows()))


@functools.cache
def _compiled(rows: tuple) -> list:
    table = [(re.compile(pattern), kind) for pattern, kind in rows]
    return table + _adapter_rows(table)


def _adapter_rows(rows: list) -> list:
    """The LEAF_KINDS rows of LoRA factors (glm5f.model.lora), one pair per matrix row: `<module>.lora_A` [.., r, in]
    and `<module>.lora_B` [.., out, r] take the axes of their weight's dims, with "lora_rank" (never sharded) for
    r; trained by AdamW whatever their weight's rule."""
    out = []
    for pattern, kind in rows:
        if pattern.pattern.endswith(r"\.weight$") and len(kind.axes) >= 2:
            stem, (*lead, out_axis, in_axis) = pattern.pattern[:-len(r"\.weight$")], kind.axes
            out.append((re.compile(stem + r"\.lora_A$"), LeafKind((*lead, "lora_rank", in_axis))))
            out.append((re.compile(stem + r"\.lora_B$"), LeafKind((*lead, out_axis, "lora_rank"))))
    return out

MTP_COPIES = ("embed_tokens", "shared_head.head")  # an MTP layer's own embedding / head, where a checkpoint has them


def _mtp_layer(c: GLM5Config, i: int, copies: tuple[str, ...]) -> dict:
    """MTP layer `i` (>= num_hidden_layers): the norms of the token embedding and of the previous hidden state,
    their projection eh_proj [D, 2D] (embedding first), a full decoder layer, and the norm before the LM head.
    `copies` (names from MTP_COPIES) adds the layer's own embedding and head, as DeepSeek-V3 checkpoints hold."""
    D, V = c.hidden_size, c.vocab_size
    p = {**layer_params(c, i), "enorm": norm_leaves(D), "hnorm": norm_leaves(D), "eh_proj": linear_leaves(D, 2 * D),
         "shared_head": {"norm": norm_leaves(D)}}
    if "embed_tokens" in copies:
        p["embed_tokens"] = {"weight": Leaf((V, D), "normal")}
    if "shared_head.head" in copies:
        p["shared_head"]["head"] = {"weight": Leaf((V, D), "normal")}
    return p


def param_layout(c: GLM5Config, mtp_copies: tuple[str, ...] = ()) -> dict:
    """The tree of `Leaf` (shape and init) that every params tree of `c` has: the main layers, then the
    num_nextn_predict_layers MTP layers (with their own embedding / head copies named in `mtp_copies`)."""
    L = c.num_hidden_layers
    layers = [layer_params(c, i) for i in range(L)]
    layers += [_mtp_layer(c, L + d, mtp_copies) for d in range(c.num_nextn_predict_layers)]
    tree = {"model": {"embed_tokens": {"weight": Leaf((c.vocab_size, c.hidden_size), "normal")},
                      "layers": layers, "norm": norm_leaves(c.hidden_size)}}
    if not c.tie_word_embeddings:
        tree["lm_head"] = linear_leaves(c.vocab_size, c.hidden_size)
    return tree


def mtp_copies(params: dict, cfg: GLM5Config) -> tuple[str, ...]:
    """Which of MTP_COPIES the MTP layers of `params` hold (as loaded from a checkpoint that has them)."""
    if not cfg.num_nextn_predict_layers:
        return ()
    flat = flatten(params)
    return tuple(name for name in MTP_COPIES if f"model.layers.{cfg.num_hidden_layers}.{name}.weight" in flat)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


@functools.lru_cache(maxsize=4096)
def leaf_kind(path: str) -> LeafKind:
    """The LEAF_KINDS entry of the leaf at dotted `path`."""
    kind = next((kind for pattern, kind in leaf_kinds() if pattern.search("." + path)), None)
    if kind is None:
        raise ValueError(f"no row of params.LEAF_KINDS matches the leaf {path}: add one naming its axes")
    return kind


def leaf_dtype(path: str, dtype: torch.dtype) -> torch.dtype:
    return wide_dtype(dtype) if leaf_kind(path).fp32 else dtype


def is_buffer(path: str) -> bool:
    return leaf_kind(path).optim == "balance"


# Leaves larger than this many elements draw their values in blocks of whole rows (dim 0), each block from its own
# generator, so a rank can make only the rows it keeps (`init_params`'s region) with at most one block extra.
INIT_BLOCK_ELEMS = 1 << 24
Region = Callable[[str, tuple[int, ...]], tuple[slice, ...]]


def region_of(region: Region | None, path: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The part `region` names of the leaf at `path` (all of it for None), as one slice(start, stop) per dim."""
    where = region(path, shape) if region else (slice(None),) * len(shape)
    bounds = [sl.indices(n)[:2] for sl, n in zip(where, shape)]
    return tuple(slice(start, max(start, stop)) for start, stop in bounds)


def init_params(cfg: GLM5Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None, region: Region | None = None) -> dict:
    """Fresh parameters: N(0, initializer_range) for matrices, ones for norm scales, zeros for biases.

    Each leaf draws from its own generator seeded by (seed, path), so a leaf's values do not depend on which other
    leaves exist or on the order they are made in; a leaf of more than INIT_BLOCK_ELEMS elements draws each block
    of rows from a generator seeded by (seed, path, block). `region(path, shape)`, if given, names the part of each
    leaf to make (one slice per dim, e.g. a rank's shard): the result holds only those parts, equal to the same
    parts of the whole init, and never more than one block of a leaf beyond them is allocated.
    """
    def make(path: str, leaf: Leaf) -> torch.Tensor:
        dt = leaf_dtype(path, dtype)
        where = region_of(region, path, tuple(leaf.shape))
        shape = tuple(sl.stop - sl.start for sl in where)
        if leaf.init in ("ones", "zeros"):
            return (torch.ones if leaf.init == "ones" else torch.zeros)(shape, dtype=dt, device=device)
        x = _normal_rows(path, tuple(leaf.shape), where, seed) * cfg.initializer_range
        if path == "model.embed_tokens.weight" and cfg.pad_token_id is not None:
            if where[0].start <= cfg.pad_token_id < where[0].stop:
                x[cfg.pad_token_id - where[0].start] = 0
        return x.to(device=device, dtype=dt)

    return map_with_path(make, param_layout(cfg), is_leaf=_is_leaf)


def _normal_rows(path: str, shape: tuple[int, ...], where: tuple[slice, ...], seed: int) -> torch.Tensor:
    """The part `where` (`region_of`) of a leaf's N(0, 1) values (fp32), made block of rows by block of rows."""
    base = seed * 1_000_003 + zlib.crc32(path.encode())
    if not shape:
        return torch.randn((), generator=torch.Generator().manual_seed(base))
    rows = max(1, INIT_BLOCK_ELEMS // max(1, math.prod(shape[1:])))
    lo, hi = where[0].start, where[0].stop
    parts = []
    for b in range(lo // rows, -(-hi // rows)):
        start = b * rows
        block_shape = (min(rows, shape[0] - start), *shape[1:])
        # the first block keeps the whole leaf's seed: leaves of one block draw as they always have
        gen = torch.Generator().manual_seed(base if b == 0 else base + zlib.crc32(f"{path}#{b}".encode()))
        block = torch.randn(block_shape, generator=gen, dtype=torch.float32)
        parts.append(block[(slice(max(lo, start) - start, min(hi, start + rows) - start), *where[1:])])
    if not parts:  # no rows here (an uneven shard's empty end)
        return torch.empty((0, *shape[1:]))[(slice(None), *where[1:])]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def abstract_params(cfg: GLM5Config, dtype: torch.dtype = torch.float32, mtp_copies: tuple[str, ...] = ()) -> dict:
    """The params tree as meta tensors: shapes and dtypes only, no memory (the full GLM-5 fits)."""
    return map_with_path(lambda path, leaf: torch.empty(leaf.shape, dtype=leaf_dtype(path, dtype), device="meta"),
                         param_layout(cfg, mtp_copies), is_leaf=_is_leaf)


def param_count(cfg: GLM5Config, *, include_buffers: bool = False, include_mtp: bool = True) -> int:
    """Number of trained parameters (the router's correction bias is a buffer and is not counted), with the MTP
    layers unless include_mtp=False."""
    cfg = cfg if include_mtp else dataclasses.replace(cfg, num_nextn_predict_layers=0)
    flat = flatten(param_layout(cfg), is_leaf=_is_leaf)
    return sum(math.prod(leaf.shape) for path, leaf in flat.items() if include_buffers or not is_buffer(path))


# ---- paths --------------------------------------------------------------------------------------------------------

def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{dotted path: leaf} in tree order, e.g. {"model.layers.0.mlp.gate_proj.weight": tensor, ...}."""
    leaves, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {path_str(kp): leaf for kp, leaf in leaves}


def unflatten(flat: dict[str, Any], like: Any) -> Any:
    """The tree of `like` with its leaves taken from `flat` by path."""
    spec = pytree.tree_structure(like)
    paths = [path_str(kp) for kp, _ in pytree.tree_flatten_with_path(like)[0]]
    return pytree.tree_unflatten([flat[p] for p in paths], spec)


def map_with_path(fn: Callable[[str, Any], Any], tree: Any, *rest: Any, is_leaf=None) -> Any:
    """tree_map where `fn` also receives each leaf's dotted path."""
    return pytree.tree_map_with_path(lambda kp, *xs: fn(path_str(kp), *xs), tree, *rest, is_leaf=is_leaf)


def path_str(key_path) -> str:
    parts = []
    for k in key_path:
        if isinstance(k, pytree.MappingKey):
            parts.append(str(k.key))
        elif isinstance(k, pytree.SequenceKey):
            parts.append(str(k.idx))
        else:
            raise TypeError(f"params trees hold only dicts and lists, found {k!r}")
    return ".".join(parts)


def check_params(params: dict, cfg: GLM5Config) -> None:
    """Raise one error listing every missing, unexpected or misshapen leaf of `params` for `cfg`."""
    layout = param_layout(cfg, mtp_copies(params, cfg))
    want = {p: leaf.shape for p, leaf in flatten(layout, is_leaf=_is_leaf).items()}
    have = {p: tuple(t.shape) for p, t in flatten(params).items()}
    missing = sorted(want.keys() - have.keys())
    unexpected = sorted(have.keys() - want.keys())
    wrong = sorted(f"{p}: expected {list(want[p])}, found {list(have[p])}"
                   for p in want.keys() & have.keys() if want[p] != have[p])
    if missing or unexpected or wrong:
        raise ValueError(describe_mismatch(missing, unexpected, wrong) +
                         "\nThe params do not match the config: build them with init_params(cfg) or load_hf(path).")


def describe_mismatch(missing: list[str], unexpected: list[str], wrong: list[str], limit: int = 40) -> str:
    lines = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = items[:limit] + ([f"... and {len(items) - limit} more"] if len(items) > limit else [])
            lines.append(f"{len(items)} {title}:\n    " + "\n    ".join(shown))
    return "\n".join(lines)

