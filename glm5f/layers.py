"""What layer i of a model is (`layer_spec`: its attention, indexer, MLP and residual kinds), and per kind what it
brings: its parameter layout and LEAF_KINDS rows, its decode cache, its FLOPs and its memory-plan buffers.

Each kind's function is looked up by the same name in `glm5f.model` (ATTENTION, MLP, RESIDUAL); everything else that
depends on a layer's kind asks `layer_spec` and the kind entries here, never the config's per-layer lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from glm5f import kda
from glm5f.config import GLM5Config
from glm5f.hyper import hc_leaves
from glm5f.kernels import INDEXER_QUERY_CHUNK_ELEMS, sparse_block_size
from glm5f.ops import wide_dtype


@dataclass(frozen=True)
class LayerSpec:
    """What a decoder layer is. attention: "mla_dsa" (MLA with DeepSeek sparse attention) or "kda" (GLM-5.3's Kimi
    delta attention). indexer: "full" (runs its own DSA indexer), "pooled" (its own GLM-5.3 pooled indexer,
    `glm5f.kpool`), "shared" (reuses the top-k of the last full layer) or "none" (no top-k). mlp: "dense" (SwiGLU)
    or "moe". residual: "plain" (pre-norm blocks added to one residual stream) or "hyper" (GLM-5.3's mHC
    streams, `glm5f.hyper`)."""

    attention: str = "mla_dsa"
    indexer: str = "full"
    mlp: str = "dense"
    residual: str = "plain"


def layer_spec(cfg: GLM5Config, layer: int) -> LayerSpec:
    """What layer `layer` of `cfg` is. MTP layers (layer >= num_hidden_layers) run their own indexer (they have no
    earlier layer to share) and have the last main layer's MLP kind (as in GLM-5 and DeepSeek-V3)."""
    indexer = "full" if layer >= cfg.num_hidden_layers else cfg.indexer_types[layer]
    mlp = "moe" if cfg.is_moe(layer) else "dense"
    if not cfg.is_glm53:
        return LayerSpec("mla_dsa", indexer, mlp, "plain")
    if cfg.layer_types[layer] == "linear_attention":
        return LayerSpec("kda", "none", mlp, "hyper")
    return LayerSpec("mla_dsa", "pooled" if indexer == "full" else indexer, mlp, "hyper")


OWN_INDEXERS = ("full", "pooled")  # the indexer kinds that select (and hold an indexer's parameters)


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


def _mla_dsa_params(c: GLM5Config, spec: LayerSpec) -> dict:
    H, D = c.num_attention_heads, c.hidden_size
    p = {
        "q_a_proj": linear_leaves(c.q_lora_rank, D, c.attention_bias),
        "q_a_layernorm": norm_leaves(c.q_lora_rank),
        "q_b_proj": linear_leaves(H * c.qk_head_dim, c.q_lora_rank),
        "kv_a_proj_with_mqa": linear_leaves(c.kv_lora_rank + c.qk_rope_head_dim, D, c.attention_bias),
        "kv_a_layernorm": norm_leaves(c.kv_lora_rank),
        "kv_b_proj": linear_leaves(H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "o_proj": linear_leaves(D, H * c.v_head_dim, c.attention_bias),
    }
    if spec.indexer in OWN_INDEXERS:
        p["indexer"] = {
            "wq_b": linear_leaves(c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            "wk": linear_leaves(c.index_head_dim, D),
            "k_norm": norm_leaves(c.index_head_dim, bias=True),
            "weights_proj": linear_leaves(c.index_n_heads, D),
        }
    if spec.indexer == "pooled":  # the pool keys' softmax: a term per position in the pool, a gate projection
        p["indexer"]["index_kpool_compress_ape"] = Leaf((c.index_kpool, c.index_head_dim), "zeros")
        p["indexer"]["index_kpool_compress_gate"] = Leaf((c.index_head_dim, D), "ones")
    return p


def _kda_params(c: GLM5Config, spec: LayerSpec) -> dict:
    """A KDA layer's self_attn as its checkpoint names it (`kda.kda_attention`): q, k, v projections [H d, D] and
    their depthwise short convolutions [H d, 1, kernel], the forget gate (f_a [d, D], f_b [H d, d], dt_bias [H d],
    A_log [H]), beta's b_proj [H, D], the output gate (g_a, g_b), the per-head o_norm [d] and o_proj [D, H d]."""
    H, K, D = c.linear_num_heads, c.linear_head_dim, c.hidden_size
    p = {f"{n}_proj": linear_leaves(H * K, D) for n in "qkv"}
    p.update({f"{n}_conv1d": {"weight": Leaf((H * K, 1, c.linear_conv_kernel_dim), "normal")} for n in "qkv"})
    p.update(f_a_proj=linear_leaves(K, D), f_b_proj=linear_leaves(H * K, K), dt_bias=Leaf((H * K,), "zeros"),
             A_log=Leaf((H,), "zeros"), b_proj=linear_leaves(H, D), g_a_proj=linear_leaves(K, D),
             g_b_proj=linear_leaves(H * K, K), o_norm=norm_leaves(K), o_proj=linear_leaves(D, H * K))
    return p


def _moe_params(c: GLM5Config, spec: LayerSpec) -> dict:
    E, D, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    p = {
        "gate": {"weight": Leaf((E, D), "normal"), "e_score_correction_bias": Leaf((E,), "zeros")},
        "experts": {"gate_proj": {"weight": Leaf((E, I, D), "normal")},
                    "up_proj": {"weight": Leaf((E, I, D), "normal")},
                    "down_proj": {"weight": Leaf((E, D, I), "normal")}},
    }
    if c.n_shared_experts:
        p["shared_experts"] = swiglu_leaves(D, I * c.n_shared_experts)
    return p


# ---- the decode cache ----------------------------------------------------------------------------------------------

def _mla_dsa_cache(c: GLM5Config, spec: LayerSpec, batch: int, capacity: int, dtype: torch.dtype,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """"latent" [B, capacity, kv_lora_rank + qk_rope_head_dim]; with its own indexer "index_keys" [B, capacity,
    index_head_dim] (the names `Layout.keys` is called with; a pooled indexer's keys carry their gate logits
    beside them, 2 index_head_dim)."""
    out = {"latent": torch.zeros(batch, capacity, c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype, device=device)}
    if spec.indexer in OWN_INDEXERS:
        width = c.index_head_dim * (2 if spec.indexer == "pooled" else 1)
        out["index_keys"] = torch.zeros(batch, capacity, width, dtype=dtype, device=device)
    return out


def _kda_cache(c: GLM5Config, spec: LayerSpec, batch: int, capacity: int, dtype: torch.dtype,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """The state `kda.kda_attention_step` carries (not per position: it holds the tokens so far, whatever the
    capacity): "recurrent" [B, H, d_k, d_v] the delta rule's state in the wider of fp32 and dtype, "conv_q",
    "conv_k", "conv_v" [B, kernel - 1, H d] each short convolution's last inputs."""
    H, K, W = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    out = {"recurrent": torch.zeros(batch, H, K, K, dtype=wide_dtype(dtype), device=device)}
    out.update({f"conv_{n}": torch.zeros(batch, W - 1, H * K, dtype=dtype, device=device) for n in "qkv"})
    return out


# ---- FLOPs ---------------------------------------------------------------------------------------------------------

def _mla_dsa_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The MLA projections (q_a, q_b, kv_a, kv_b's key and value halves applied once per token, o_proj); attention
    per head over the keys each query attends (min(index_topk, visible keys) when the sequence is longer than
    index_topk, else every visible key), scores over nope + rope channels and values; the indexer of a full layer
    (wq_b, wk, weights_proj, and scores plus head weighting over every visible key: forward only)."""
    D, H, Q, R = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    N, P, V = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    I, J = c.index_n_heads, c.index_head_dim
    visible = (seq + 1) / 2  # mean keys a causal query sees
    K = c.index_topk  # a query at s attends min(K, s + 1) keys
    attended = (K * (K + 1) // 2 + (seq - K) * K) / seq if seq > K else visible
    macs = D * Q + Q * H * (N + P) + D * (R + P) + R * H * (N + V) + H * V * D + attended * H * (N + P + V)
    indexer = Q * I * J + D * J + D * I + visible * I * (J + 1) if spec.indexer in OWN_INDEXERS else 0.0
    if spec.indexer == "pooled":  # the gate projection; the pool keys sit at T positions, scored like tokens
        indexer += D * J
    return macs, indexer


def _kda_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The projections (q, k, v, forget gate, beta, output gate, o_proj), the short convolutions and the delta
    rule per head as the chunked form computes it (`kda.CHUNK`-token chunks: the state's read and update, 4 d^2,
    and the causal half of the chunk's scores and values, CHUNK d)."""
    H, K, D = c.linear_num_heads, c.linear_head_dim, c.hidden_size
    proj = 4 * D * H * K + 2 * (D * K + K * H * K) + D * H
    return proj + 3 * H * K * c.linear_conv_kernel_dim + H * (4 * K * K + kda.CHUNK * K), 0.0


def _kda_transient(c: GLM5Config, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                   weight: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes inside the `glm5f::kda` op: its block workspace (`kda.workspace_bytes`), and in the
    backward the gradients of q, k, v and g it returns ([B, S, H, d] each in the wider of fp32 and act). Under CP
    (S < T) the values carry d_k more columns (`kda.kda_attention_cp`)."""
    H, K = c.linear_num_heads, c.linear_head_dim
    V = K if S == T else 2 * K
    fwd, bwd = kda.workspace_bytes(B, S, H, K, V, act)
    return fwd, bwd + B * S * H * (3 * K + V) * wide_dtype(act).itemsize


def _hyper_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """Both hyper-connections: the mixing weights' projection of the N streams, the collapse, the expansion."""
    N, D = c.hc_mult, c.hidden_size
    return 2 * ((2 + N) * N * N * D + N * D + N * (N + 1) * D), 0.0


def _moe_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The router and each routed and shared expert slot."""
    D, F = c.hidden_size, c.moe_intermediate_size
    return D * c.n_routed_experts + 3 * D * F * (c.num_experts_per_tok + c.n_shared_experts), 0.0


# ---- the memory plan -----------------------------------------------------------------------------------------------

def _mla_dsa_transient(c: GLM5Config, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                       weight: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes of the buffers inside glm5f.kernels ops, which a trace sees the outputs of only:
    in the forward the indexer's chunk of scores with its top-k keys, or the sparse core's block of gathered rows;
    in the backward the sparse core's latent and query gradients and its block."""
    a, w, lat = act.itemsize, wide_dtype(act).itemsize, torch.promote_types(act, weight).itemsize
    H, C, K = c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim, min(c.index_topk, T)
    sparse = T > c.index_topk and S > 1
    fwd, bwd = 0, 0
    if sparse and spec.indexer in OWN_INDEXERS:
        rows = min(S, max(1, INDEXER_QUERY_CHUNK_ELEMS // max(1, B * c.index_n_heads * T)))
        fwd = B * T * c.index_head_dim * a + B * rows * c.index_n_heads * T * w + B * rows * T * (w + 1 + 4 + 8)
    if sparse:
        rows = min(S, sparse_block_size(B, K, C, H))
        fwd = max(fwd, B * rows * K * (C * a + 2 * H * w))
        bwd += B * T * C * lat + B * S * H * C * a + B * rows * K * (2 * C * a + 4 * H * w)
    return fwd, bwd


# ---- the kinds -----------------------------------------------------------------------------------------------------

def _no_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    return 0.0, 0.0


def _no_transient(c: GLM5Config, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                  weight: torch.dtype) -> tuple[int, int]:
    return 0, 0


@dataclass(frozen=True)
class Kind:
    """One kind of a layer's part (its function is the entry of the same name in glm5f.model).

    params(cfg, spec): its Leaf tree (under "self_attn", "mlp", or the layer itself for a residual). rows: its
    (pattern, LeafKind) rows of `params.LEAF_KINDS`. macs(cfg, spec, seq): (multiply-adds per token the backward
    also runs, forward-only ones) for `glm5f.flops`. transient(cfg, spec, B, S, T, act dtype, weight dtype): the
    (forward, backward) bytes of buffers inside custom ops that the memory plan cannot trace. cache(cfg, spec, B,
    capacity, dtype, device): its decode cache, {name: buffer}, None where it keeps none. recurrent: that cache is a
    state the layer carries from call to call (`Env.state`), not rows per position. cp: whether it runs under
    context parallelism (the memory plan's search tries cp > 1 only where every layer's kinds do).
    """

    params: Callable[[GLM5Config, LayerSpec], dict]
    rows: tuple = ()
    macs: Callable[[GLM5Config, LayerSpec, int], tuple[float, float]] = _no_macs
    transient: Callable = _no_transient
    cache: Callable | None = None
    recurrent: bool = False
    cp: bool = True


ATTENTION = {
    "mla_dsa": Kind(
        _mla_dsa_params,
        rows=(
            (r"\.indexer\.weights_proj\.weight$", LeafKind(("index_heads", "embed"), fp32=True, optim="indexer")),
            (r"\.indexer\.index_kpool_compress_ape$", LeafKind(("pool", "index_dim"), optim="indexer")),
            (r"\.indexer\.index_kpool_compress_gate$", LeafKind(("index_dim", "embed"), optim="indexer")),
            (r"\.indexer\.wq_b\.weight$", LeafKind(("index_heads", "q_lora"), optim="indexer")),
            (r"\.indexer\.wk\.weight$", LeafKind(("index_dim", "embed"), optim="indexer")),
            (r"\.indexer\.k_norm\.(weight|bias)$", LeafKind(("index_dim",), optim="indexer")),
            (r"\.q_a_proj\.weight$", LeafKind(("q_lora", "embed"), optim="hidden")),
            (r"\.(q_a_proj\.bias|q_a_layernorm\.weight)$", LeafKind(("q_lora",))),
            (r"\.q_b_proj\.weight$", LeafKind(("heads", "q_lora"), optim="hidden",
                                               parts=("qk_nope_head_dim", "qk_rope_head_dim"))),
            (r"\.kv_a_proj_with_mqa\.weight$", LeafKind(("latent", "embed"), optim="hidden",
                                                         parts=("kv_lora_rank", "qk_rope_head_dim"))),
            (r"\.kv_a_proj_with_mqa\.bias$", LeafKind(("latent",))),
            (r"\.kv_a_layernorm\.weight$", LeafKind(("kv_lora",))),
            (r"\.kv_b_proj\.weight$", LeafKind(("heads", "kv_lora"), optim="hidden",
                                                parts=("qk_nope_head_dim", "v_head_dim"))),
            (r"\.o_proj\.weight$", LeafKind(("embed", "heads"), optim="hidden")),
            (r"\.o_proj\.bias$", LeafKind(("embed",))),
        ),
        macs=_mla_dsa_macs, transient=_mla_dsa_transient, cache=_mla_dsa_cache),
    "kda": Kind(
        _kda_params,
        rows=(  # as in the reference, the convolutions and the decay's parameters stay fp32
            (r"\.self_attn\.[qkv]_proj\.weight$", LeafKind(("linear_heads", "embed"))),
            (r"\.self_attn\.[qkv]_conv1d\.weight$", LeafKind(("linear_heads", "conv", "conv"), fp32=True)),
            (r"\.self_attn\.[fg]_a_proj\.weight$", LeafKind(("linear_dim", "embed"))),
            (r"\.self_attn\.[fg]_b_proj\.weight$", LeafKind(("linear_heads", "linear_dim"))),
            (r"\.self_attn\.(dt_bias|A_log)$", LeafKind(("linear_heads",), fp32=True)),
            (r"\.self_attn\.b_proj\.weight$", LeafKind(("linear_heads", "embed"))),
            (r"\.self_attn\.o_norm\.weight$", LeafKind(("linear_dim",))),
        ),
        macs=_kda_macs, transient=_kda_transient, cache=_kda_cache, recurrent=True),
}
MLP = {  # "moe" first: its experts' rows are more specific than the dense projections'
    "moe": Kind(
        _moe_params,
        rows=(
            (r"\.mlp\.gate\.e_score_correction_bias$", LeafKind(("router",), fp32=True, optim="balance")),
            (r"\.mlp\.gate\.weight$", LeafKind(("router", "embed"), fp32=True)),
            (r"\.experts\.(gate|up)_proj\.weight$", LeafKind(("experts", "mlp", "embed"), optim="hidden")),
            (r"\.experts\.down_proj\.weight$", LeafKind(("experts", "embed", "mlp"), optim="hidden")),
        ),
        macs=_moe_macs),
    "dense": Kind(
        lambda c, spec: swiglu_leaves(c.hidden_size, c.intermediate_size),
        rows=((r"\.(gate|up)_proj\.weight$", LeafKind(("mlp", "embed"), optim="hidden")),
              (r"\.down_proj\.weight$", LeafKind(("embed", "mlp"), optim="hidden"))),
        macs=lambda c, spec, seq: (3 * c.hidden_size * c.intermediate_size, 0.0)),
}
RESIDUAL = {
    "plain": Kind(lambda c, spec: {"input_layernorm": norm_leaves(c.hidden_size),
                                   "post_attention_layernorm": norm_leaves(c.hidden_size)}),
    "hyper": Kind(  # the two norms and both hyper-connections (their base and scale fp32, as in the reference)
        lambda c, spec: {"input_layernorm": norm_leaves(c.hidden_size),
                         "post_attention_layernorm": norm_leaves(c.hidden_size), **hc_leaves(c, Leaf)},
        rows=((r"\.hc_(attn|ffn)_fn$", LeafKind(("hc", "embed"))),
              (r"\.hc_(attn|ffn)_(base|scale)$", LeafKind(("hc",), fp32=True))),
        macs=_hyper_macs),
}
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
    """Every kind's LEAF_KINDS rows, then the model's (the first match wins: MLP, attention, residual, model)."""
    return [row for table in (MLP, ATTENTION, RESIDUAL) for kind in table.values() for row in kind.rows] + \
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
