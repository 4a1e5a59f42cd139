"""What layer i of a model is (`layer_spec`: the names of its attention, indexer, MLP and residual kinds) and the
tables of kind records (`Kind`, `Indexer`) that say what each kind brings: its function, parameters, rows, cache.

Each kind's module defines its record (attention.py: mla_dsa and the indexer variants; kda_layer.py: kda; moe.py:
moe; hyper.py: hyper; model.py: dense and plain), and `glm5f.model.decoder` enters them in the tables below, once, as the
package is imported. Whatever depends on a layer's kind asks `layer_spec` and these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from glm5f.core.config import ATTENTION_KINDS, GLM5Config


@dataclass(frozen=True)
class LayerSpec:
    """What a decoder layer is, by the names of its kinds in the tables below. attention: "mla_dsa" (MLA with
    DeepSeek sparse attention) or "kda" (GLM-5.3's Kimi delta attention). indexer: "full" (runs its own DSA
    indexer), "pooled" (its own GLM-5.3 pooled indexer, `glm5f.model.kpool`), "shared" (reuses the top-k of the last
    full layer) or "none" (an attention kind without an indexer). mlp: "dense" (SwiGLU) or "moe". residual:
    "plain" (pre-norm blocks added to one residual stream) or "hyper" (GLM-5.3's mHC streams, `glm5f.model.hyper`)."""

    attention: str = "mla_dsa"
    indexer: str = "full"
    mlp: str = "dense"
    residual: str = "plain"


def layer_spec(cfg: GLM5Config, layer: int) -> LayerSpec:
    """What layer `layer` of `cfg` is: GLM-5.3's attention kind by its layer_types entry (`config.ATTENTION_KINDS`),
    GLM-5's mla_dsa. MTP layers (layer >= num_hidden_layers) run their own indexer (they have no earlier layer to
    share) and have the last main layer's MLP kind (as in GLM-5 and DeepSeek-V3)."""
    indexer = "full" if layer >= cfg.num_hidden_layers else cfg.indexer_types[layer]
    mlp = "moe" if cfg.is_moe(layer) else "dense"
    if not cfg.is_glm53:
        return LayerSpec("mla_dsa", indexer, mlp, "plain")
    attention = "mla_dsa" if layer >= cfg.num_hidden_layers else ATTENTION_KINDS[cfg.layer_types[layer]]
    if not ATTENTION[attention].indexed:
        indexer = "none"
    return LayerSpec(attention, "pooled" if indexer == "full" else indexer, mlp, "hyper")


# ---- the parameter layout ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    init: str  # "normal" | "zeros" | "ones"


@dataclass(frozen=True)
class LeafKind:
    """What a leaf is. axes: the logical axis of each of its dims, which `parallel.MESH_RULES` maps to mesh
    axes (fused dims are named by their outer axis: q_b_proj's (heads x head dim) rows are "heads"). fp32: kept in
    fp32 (fp64 in fp64 runs) whatever the compute dtype. optim: the label `optim.leaf_rule` reads: "adamw"
    (AdamW whatever the optimizer: weight decay on matrices, none on 1-D leaves), "hidden" (a hidden layer's
    matrix, routed experts one matrix each: Muon's under --optim.name muon, else AdamW's), "indexer" (AdamW while
    the indexer loss trains it, else frozen) or "balance" (a buffer with its own update rule, no gradient).
    parts: Muon Split, the config fields naming the rows of each head's block in order (of the whole leaf when its
    rows are not "heads"): each part is orthogonalised on its own (`optim.muon_blocks`)."""

    axes: tuple[str, ...]
    fp32: bool = False
    optim: str = "adamw"
    parts: tuple[str, ...] = ()


def linear_leaves(out_features: int, in_features: int, bias: bool = False) -> dict:
    p = {"weight": Leaf((out_features, in_features), "normal")}
    if bias:
        p["bias"] = Leaf((out_features,), "zeros")
    return p


def norm_leaves(n: int, bias: bool = False) -> dict:
    p = {"weight": Leaf((n,), "ones")}
    if bias:
        p["bias"] = Leaf((n,), "zeros")
    return p


def swiglu_leaves(hidden: int, inter: int) -> dict:
    return {"gate_proj": linear_leaves(inter, hidden), "up_proj": linear_leaves(inter, hidden),
            "down_proj": linear_leaves(hidden, inter)}


# ---- the kind records ----------------------------------------------------------------------------------------------

def no_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    return 0.0, 0.0


def no_transient(c: GLM5Config, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                 weight: torch.dtype) -> tuple[int, int]:
    return 0, 0


@dataclass(frozen=True)
class Kind:
    """One kind of a layer's part: its function and all that depends on it.

    fn: attention(p, x, cfg, layer, env, carry) -> (out, carry, aux); mlp(p, x, cfg, layer, env) -> (out, aux);
    residual(p, x, cfg, layer, env, carry, attention fn, mlp fn) -> (x, carry, aux). params(cfg, spec): its Leaf
    tree (under "self_attn", "mlp", or the layer itself for a residual). rows: its (pattern, LeafKind) rows of
    `params.leaf_kinds()`. macs(cfg, spec, seq): (multiply-adds per token the backward also runs, forward-only ones)
    for `glm5f.core.flops`. transient(cfg, spec, B, S, T, act dtype, weight dtype): the (forward, backward) bytes of
    buffers inside custom ops that the memory plan cannot trace. cache(cfg, spec, B, capacity, dtype, device): its
    decode cache, {name: buffer}, None where it keeps none. recurrent: that cache is a state the layer carries from
    call to call (`Env.state`), not rows per position. cp: whether it runs under context parallelism (the memory
    plan's search tries cp > 1 only where every layer's kinds do). indexed (attention): it runs an indexer variant
    (`INDEXERS`), else its layers' indexer is "none". experts (MLP): it holds routed experts (the plan tries ep >
    1). enter(x, cfg), leave(x) (residual): what the model's residual streams are made from the embeddings, and
    the last layer's hidden state from them (None: the stream itself).
    """

    fn: Callable
    params: Callable[[GLM5Config, LayerSpec], dict]
    rows: tuple = ()
    macs: Callable[[GLM5Config, LayerSpec, int], tuple[float, float]] = no_macs
    transient: Callable = no_transient
    cache: Callable | None = None
    recurrent: bool = False
    cp: bool = True
    indexed: bool = False
    experts: bool = False
    enter: Callable | None = None
    leave: Callable | None = None


@dataclass(frozen=True)
class Indexer:
    """One indexer variant of an indexed attention kind (mla_dsa). select(ip, x, q latent, cfg, layer, env, num
    keys) -> the layer's `attention.Selection` from the indexer params `ip`, None for a variant that selects
    nothing itself (its layer holds no indexer params). reuses: the layer attends to the Selection the layer before
    passed on. params(cfg): its Leaf tree (under "self_attn.indexer"); rows: its LEAF_KINDS rows; key_width: the
    channels of a key it caches per position ("index_keys"); macs(cfg, seq): its forward-only multiply-adds per
    token."""

    select: Callable | None = None
    reuses: bool = False
    params: Callable[[GLM5Config], dict] | None = None
    rows: tuple = ()
    key_width: Callable[[GLM5Config], int] | None = None
    macs: Callable[[GLM5Config, int], float] = lambda c, seq: 0.0

    @property
    def selects(self) -> bool:
        """Whether the layer selects its own keys (and holds an indexer's parameters)."""
        return self.select is not None


# The tables, by the names LayerSpec holds ("moe" before "dense": its experts' rows are more specific than the dense
# projections'). `glm5f.model.decoder` enters every kind's record.
ATTENTION: dict[str, Kind] = {}
INDEXERS: dict[str, Indexer] = {}
MLP: dict[str, Kind] = {}
RESIDUAL: dict[str, Kind] = {}

# The leaves outside the decoder layers' kinds: embedding, head, the MTP projection, and every norm scale.
MODEL_ROWS = (
    (r"\.(embed_tokens|lm_head|head)\.weight$", LeafKind(("vocab", "embed"))),
    # [D, 2D]: the MTP layer's embedding and hidden state
    (r"\.eh_proj\.weight$", LeafKind(("embed", "embed"), optim="hidden")),
    (r"norm\.weight$", LeafKind(("embed",))),
)


def kinds(spec: LayerSpec) -> tuple[Kind, Kind, Kind]:
    """The (attention, MLP, residual) kinds of a layer."""
    return ATTENTION[spec.attention], MLP[spec.mlp], RESIDUAL[spec.residual]


def leaf_rows() -> list[tuple[str, LeafKind]]:
    """Every kind's LEAF_KINDS rows, then the model's (the first match wins: MLP, indexer, attention, residual,
    model; a row two kinds share is listed once)."""
    tables = (MLP, INDEXERS, ATTENTION, RESIDUAL)
    return list(dict.fromkeys(row for table in tables for kind in table.values() for row in kind.rows)) + \
        list(MODEL_ROWS)


def layer_params(cfg: GLM5Config, layer: int) -> dict:
    """The Leaf tree of decoder layer `layer`: its attention under "self_attn", its MLP under "mlp", its residual's
    leaves (the plain residual's two norms)."""
    spec = layer_spec(cfg, layer)
    attention, mlp, residual = kinds(spec)
    return {"self_attn": attention.params(cfg, spec), "mlp": mlp.params(cfg, spec), **residual.params(cfg, spec)}


def layer_cache(cfg: GLM5Config, layer: int, batch: int, capacity: int, dtype: torch.dtype,
                device: torch.device | str) -> dict[str, torch.Tensor]:
    """Decode cache buffers of layer `layer`, by name, from each of its kinds that keeps one."""
    spec = layer_spec(cfg, layer)
    out = {}
    for kind in kinds(spec):
        if kind.cache is not None:
            out.update(kind.cache(cfg, spec, batch, capacity, dtype, device))
    return out


def carries_state(cfg: GLM5Config, layer: int) -> bool:
    """Whether layer `layer`'s decode cache is a recurrent state (a kind with `recurrent`)."""
    return any(kind.recurrent for kind in kinds(layer_spec(cfg, layer)))
