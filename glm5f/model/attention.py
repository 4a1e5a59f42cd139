"""MLA attention with DeepSeek Sparse Attention (DSA), in three parts: `select` picks the keys each query attends
(a full layer's lightning indexer and its top-k; a shared layer reuses the last full layer's), `mla_core` attends
over them (dense, or sparse through the glm5f.kernels.dsa op), and the indexer's training objective
(glm5f.model.indexer_loss) runs once per group of layers sharing a top-k.

Keys and values are never stored per head: a token's key/value source is its *latent* row, the normalised
compressed kv (kv_lora_rank) followed by the shared rope key (qk_rope_head_dim). The sparse path gathers each
query's top-k latent rows and attends in latent space (queries absorb kv_b's key half, outputs pass through its
value half), so no L x L score matrix is built. The dense path (all keys selected) expands latents per head.

Shape suffixes: B batch, S queries (this rank's), T keys (global), H heads, K top-k, R kv_lora_rank,
P qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim, C = R + P, Q q_lora_rank, I indexer heads, J index_head_dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from glm5f.model import indexer_loss
from glm5f.model import kpool
from glm5f.kernels import dsa as kernels
from glm5f.core import replay
from glm5f.core.config import GLM5Config
from glm5f.model.lora import merged
from glm5f.model.env import Env, Mask
from glm5f.core.layers import (INDEXERS, Indexer, Kind, LayerSpec, Leaf, LeafKind, layer_spec, linear_leaves,
                               norm_leaves)
from glm5f.core.ops import apply_rope, layer_norm, linear, rms_norm, wide, wide_dtype
from glm5f.parallel.layout import cp_position_list

LATENT_NORM_EPS = 1e-6  # GLM-5's q_a_layernorm and kv_a_layernorm use 1e-6, not rms_norm_eps (GLM-5.3's do)


def latent_norm_eps(cfg: GLM5Config) -> float:
    return cfg.rms_norm_eps if cfg.is_glm53 else LATENT_NORM_EPS


# ---- MLA projections ----------------------------------------------------------------------------------------------

def mla_project(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, env: Env):
    """Queries (nope and rotated parts, plus the q latent the indexer reuses) and this rank's latent rows."""
    eps = latent_norm_eps(cfg)
    q_BxSxQ = rms_norm(p["q_a_layernorm"]["weight"], linear(p["q_a_proj"], x_BxSxD), eps)
    q_BxSxHx_ = rearrange(linear(p["q_b_proj"], q_BxSxQ), "b s (h d) -> b s h d", d=cfg.qk_head_dim)
    q_nope_BxSxHxN, q_rot_BxSxHxP = q_BxSxHx_.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv_BxSxC = linear(p["kv_a_proj_with_mqa"], x_BxSxD)
    kv_BxSxR, k_rot_BxSxP = kv_BxSxC.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent_BxSxC = torch.cat([rms_norm(p["kv_a_layernorm"]["weight"], kv_BxSxR, eps),
                              apply_rope(k_rot_BxSxP, env.cos, env.sin)], dim=-1)
    return q_nope_BxSxHxN, apply_rope(q_rot_BxSxHxP, env.cos, env.sin), q_BxSxQ, latent_BxSxC


def kv_b_heads(p: dict, cfg: GLM5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj (its LoRA adapter merged) split per head into its key half [H, N, R] and value half [H, V, R]."""
    w_Hx_xR = rearrange(merged(p["kv_b_proj"])["weight"], "(h d) r -> h d r", d=cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w_Hx_xR.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)


# ---- the lightning indexer ----------------------------------------------------------------------------------------

def indexer_keys(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, env: Env) -> torch.Tensor:
    """Index keys [B, S, J]: LayerNorm(wk x), rope on the first P dims (the indexer splits [rope, nope])."""
    k_BxSxJ = layer_norm(p["k_norm"], linear(p["wk"], x_BxSxD))
    k_rot, k_pass = k_BxSxJ.split([cfg.qk_rope_head_dim, cfg.index_head_dim - cfg.qk_rope_head_dim], dim=-1)
    return torch.cat([apply_rope(k_rot, env.cos, env.sin), k_pass], dim=-1)


def indexer_queries(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, cfg: GLM5Config, env: Env):
    """(index queries [B, S, I, J], roped and wide; head weights [B, S, I], wide, scaled by I^-0.5) from the
    layer's input and the q latent, computed once for the top-k and the indexer loss. Weights_proj computes in
    fp32 (fp64 in fp64 runs), as the reference does."""
    I, J, P = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_BxSxIxJ = rearrange(linear(ip["wq_b"], q_BxSxQ), "b s (i j) -> b s i j", j=J)
    q_rot, q_pass = q_BxSxIxJ.split([P, J - P], dim=-1)
    q_BxSxIxJ = wide(torch.cat([apply_rope(q_rot, env.cos, env.sin), q_pass], dim=-1))
    return q_BxSxIxJ, linear(ip["weights_proj"], wide(x_BxSxD)) * I ** -0.5


def indexer_topk(q_BxSxIxJ: torch.Tensor, w_BxSxI: torch.Tensor, keys_BxTxJ: torch.Tensor, mask: Mask,
                 k: int) -> torch.Tensor:
    """Top-k key indices [B, S, k] per query of the index scores sum_i w_i relu(q_i . key / sqrt(J)) under the
    mask, equal scores to the lower index (the `glm5f::indexer_topk` op). Masked keys score -inf; when a query
    has fewer than k visible keys the remaining picks are masked keys, which `Mask.at` reports as not allowed,
    so attention never uses them. The products q_i . key take q and the keys in q's dtype, summed in fp32 (fp64
    for fp64 inputs): half-precision q runs on CUDA's tensor cores (`index_queries_narrow`)."""
    return kernels.indexer_topk(q_BxSxIxJ, w_BxSxI, keys_BxTxJ.to(q_BxSxIxJ.dtype), mask.q_index, mask.key_valid,
                                mask.q_segment, mask.k_segment, mask.dense, mask.bias, k, mask.reach)


# ---- which keys each query attends -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """The keys each query attends, carried from a full layer to the shared layers after it: `topk` [B, S, K]
    (None: every key). With the indexer loss on, also what it needs: `student`, the full layer's index queries
    [B, S, I, J], head weights [B, S, I] and index keys [B, T, J], with their graph to the indexer's leaves;
    `targets`, per layer of the group so far, its detached absorbed queries [B, S, H, C] and latent rows
    [B, T, C] (O(S H C) each: the target distributions are made per query block in `indexer_loss.kl`).
    `allowed`: GLM-5.3's pooled selection says itself which of its token slots count (`kpool`), as does a replayed
    one (`replay.replayed`); `own`: under replay, the indexer's own selection, which its loss scores."""

    topk: torch.Tensor | None
    student: tuple | None = None
    targets: tuple = ()
    allowed: torch.Tensor | None = None  # [B, S, K]: which selections count (None: those the mask allows)
    pooling: indexer_loss.Pooling | None = None  # GLM-5.3: the student scores pools (`indexer_loss.Pooling`)
    own: torch.Tensor | None = None  # [B, S, K]: the indexer's own top-k where replay replaced `topk`


def select(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, cfg: GLM5Config, layer: int, env: Env,
           num_keys: int) -> Selection:
    """A full layer's Selection: its indexer's top-k over the num_keys keys (None when index_topk covers them).
    The indexer is not differentiated by the language-model loss (as in the reference); with the indexer loss on
    it learns from that loss alone, its inputs detached. Where the batch records the layer's keys (`Env.indexer`),
    the queries with a record attend those (`replay.replayed`)."""
    train = env.objectives.indexer_loss != "off"
    # the index keys are gathered (and their gradients summed over queries and CP ranks) in wk's dtype
    key_dtype = torch.promote_types(x_BxSxD.dtype, ip["wk"]["weight"].dtype)
    with contextlib.nullcontext() if train else torch.no_grad():
        x_BxSxD, q_BxSxQ = x_BxSxD.detach(), q_BxSxQ.detach()
        keys_BxTxJ = env.keys(layer, "index_keys", indexer_keys(ip, x_BxSxD, cfg, env).to(key_dtype))
        q_BxSxIxJ, w_BxSxI = indexer_queries(ip, x_BxSxD, q_BxSxQ, cfg, env)
    topk = None
    if num_keys > cfg.index_topk:
        topk = indexer_topk(index_queries_narrow(q_BxSxIxJ.detach(), env.dtype), w_BxSxI.detach(),
                            keys_BxTxJ.detach(), env.mask, cfg.index_topk)
    student = (q_BxSxIxJ, w_BxSxI, keys_BxTxJ) if train else None
    recorded_BxSxK = env.indexer.get(layer)
    if topk is None or recorded_BxSxK is None:
        return Selection(topk, student)
    idx_BxSxK, allowed_BxSxK = replay.replayed(topk, recorded_BxSxK, env.mask.at)
    return Selection(idx_BxSxK, student, allowed=allowed_BxSxK, own=topk)


def index_queries_narrow(q_BxSxIxJ: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The index queries as the top-k's products take them: in the activations' `dtype` when it is a half type
    (bf16, fp16), else as they are. The cast loses nothing: q and the keys were computed in that dtype and only
    widened after (`indexer_queries`), so the CPU, which widens them again, scores the same fp32 bits, and CUDA's
    kernel multiplies them on tensor cores with fp32 sums (fp32 and fp64 runs keep their exact scores)."""
    return q_BxSxIxJ.to(dtype) if dtype in (torch.bfloat16, torch.float16) else q_BxSxIxJ


def select_pooled(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, cfg: GLM5Config, layer: int,
                  env: Env) -> Selection:
    """A GLM-5.3 DSA layer's Selection: the pooled indexer's tokens and which of them count (`kpool`). Not
    differentiated by the language-model loss, as in the reference; with the indexer loss on it learns from that
    loss alone (`indexer_loss.kl` with its `Pooling`, over its own selection), its inputs detached. Where the batch
    records the layer's pools (`Env.indexer`), the queries with a record attend those."""
    train = env.objectives.indexer_loss != "off"
    J, P = cfg.index_head_dim, cfg.index_kpool
    key_dtype = torch.promote_types(x_BxSxD.dtype, ip["wk"]["weight"].dtype)
    with contextlib.nullcontext() if train else torch.no_grad():
        x_BxSxD, q_BxSxQ = x_BxSxD.detach(), q_BxSxQ.detach()
        keys_BxTx_ = env.keys(layer, "index_keys", kpool.index_key_and_gate(ip, x_BxSxD).to(key_dtype))
        q_BxSxIxJ, w_BxSxI = kpool.index_queries(ip, x_BxSxD, q_BxSxQ)
        where = kpool.pools(env.mask, x_BxSxD.shape[0], P)
        keys_BxTxJ, gate_BxTxJ = keys_BxTx_.split([J, J], dim=-1)
        pooled_BxTxJ = kpool.pool_keys(keys_BxTxJ, gate_BxTxJ, ip["index_kpool_compress_ape"], where, P)
    args = (q_BxSxIxJ.detach(), w_BxSxI.detach(), pooled_BxTxJ.detach(), where, env.mask, cfg.index_topk, P,
            cfg.index_kpool_always_select_tail)
    recorded_BxSxG = env.indexer.get(layer)
    idx_BxSxW, allowed_BxSxW = kpool.pooled_selection(*args, recorded_BxSxG)
    if not train:
        return Selection(idx_BxSxW, allowed=allowed_BxSxW)
    own_BxSxW, own_allowed_BxSxW = (idx_BxSxW, allowed_BxSxW) if recorded_BxSxG is None else \
        kpool.pooled_selection(*args)
    pooling = indexer_loss.Pooling(P, min(cfg.index_topk // P, pooled_BxTxJ.shape[1]), kpool.candidates(env.mask, where),
                                   own_allowed_BxSxW)
    return Selection(idx_BxSxW, (q_BxSxIxJ, w_BxSxI, pooled_BxTxJ), allowed=allowed_BxSxW, pooling=pooling,
                     own=None if recorded_BxSxG is None else own_BxSxW)


# ---- the MLA core -------------------------------------------------------------------------------------------------

def mla_core(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
             topk_BxSxK: torch.Tensor | None, mask: Mask, cfg: GLM5Config, parts: int = 1,
             allowed_BxSxK: torch.Tensor | None = None, topk_dense: bool = True) -> torch.Tensor:
    """Attention of each query over its keys -> [B, S, H, V]: over every allowed key when no top-k narrows them
    (`dense_mla`), else over its selected keys (with `allowed_BxSxK`, over those it marks), in `parts` parts of
    the queries: per head over keys kv_b expands where that costs less (`topk_dense` and `dense_topk_pays`:
    `topk_dense_mla`), else over their latent rows (`sparse_mla`).

    With `parts` > 1 (`--train.query_parts`) each part holds the queries a CP rank of a `parts`-way CP run holds
    (`parallel.cp_positions`: chunks r and 2 parts - 1 - r) and runs alone: each query's output as a CP rank
    computes it, and each latent row's gradient summed over each part's queries apart, then added, as CP ranks sum
    theirs."""
    B, S = q_nope_BxSxHxN.shape[:2]
    T = latent_BxTxC.shape[1]
    if topk_BxSxK is None and S > 1:
        return dense_mla(p, q_nope_BxSxHxN, q_rot_BxSxHxP, latent_BxTxC, mask, cfg)
    if topk_BxSxK is None:  # one query (decoding) over at most index_topk keys: all of them
        topk_BxSxK = torch.arange(T, device=latent_BxTxC.device).expand(B, S, T)
    if parts > 1:
        if S % (2 * parts):
            raise ValueError(f"query_parts {parts} splits the queries into 2 x {parts} chunks as CP does; {S} "
                             f"queries do not divide by {2 * parts}")
        where = [cp_position_list(S, parts, r) for r in range(parts)]
        outs = []
        for held in where:
            i = torch.tensor(held, device=q_nope_BxSxHxN.device)
            outs.append(mla_core(p, q_nope_BxSxHxN[:, i], q_rot_BxSxHxP[:, i], latent_BxTxC, topk_BxSxK[:, i],
                                 mask.queries(held, i), cfg, 1, None if allowed_BxSxK is None else allowed_BxSxK[:, i],
                                 topk_dense))
        order = torch.tensor(sum(where, []), device=q_nope_BxSxHxN.device).argsort()
        return torch.cat(outs, dim=1)[:, order]
    if topk_dense and dense_topk_pays(cfg, q_nope_BxSxHxN, latent_BxTxC, topk_BxSxK.shape[-1], mask.dense is None):
        return topk_dense_mla(p, q_nope_BxSxHxN, q_rot_BxSxHxP, latent_BxTxC, topk_BxSxK, mask, cfg, allowed_BxSxK)
    return sparse_mla(p, q_nope_BxSxHxN, q_rot_BxSxHxP, latent_BxTxC, topk_BxSxK, mask, cfg, allowed_BxSxK)


SPARSE_GEMM_COST = 2.0  # the CPU time of one multiply-add in the sparse core's small GEMMs, in dense-GEMM units


def dense_topk_pays(cfg: GLM5Config, q_BxSxHxN: torch.Tensor, latent_BxTxC: torch.Tensor, K: int,
                    causal: bool) -> bool:
    """Whether `topk_dense_mla` costs this CPU less than `sparse_mla` for S queries over T keys, each attending K.

    Per head, the sparse core absorbs kv_b into every query and output (S R (N + V) multiply-adds) and attends K
    latent rows in the latent's widths (2 S K (C + R), each multiply-add of its small per-block GEMMs counted as
    `SPARSE_GEMM_COST` dense ones); the dense form expands every key through kv_b (T R (N + V)) and scores every
    key up to a block's last selection in the heads' widths (S t (N + P + V), t about T / 2 + 64 under a causal
    mask). The form with fewer counted multiply-adds runs (the timings behind the count: docs/performance.md,
    "Choices in the code"). Only on the CPU (CUDA runs the Triton sparse kernels) with the latent in
    the queries' dtype: a wider latent (fp64 sums) keeps the sparse core, whose row gradients are summed in it."""
    if (latent_BxTxC.device.type != "cpu" or latent_BxTxC.dtype != q_BxSxHxN.dtype
            or torch._C._are_functorch_transforms_active()):
        return False
    S, T = q_BxSxHxN.shape[1], latent_BxTxC.shape[1]
    R, N, P, V = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    seen = min(T, T / 2 + kernels.DENSE_BLOCK_QUERIES / 2) if causal else T
    dense = T * R * (N + V) + S * seen * (N + P + V)
    sparse = S * R * (N + V) + SPARSE_GEMM_COST * S * K * (R + P + R)
    return dense < sparse


def topk_dense_mla(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
                   idx_BxSxK: torch.Tensor, mask: Mask, cfg: GLM5Config,
                   allowed_BxSxK: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_mla`'s output [B, S, H, V] with keys and values per head (`expand_latent`, as `dense_mla`) and the
    top-k as a mask (`kernels.topk_attention`)."""
    q_BxSxHxD = torch.cat([q_nope_BxSxHxN, q_rot_BxSxHxP], dim=-1)
    explicit = allowed_BxSxK is not None
    if not explicit:
        allowed_BxSxK = mask.at(idx_BxSxK)
    k_BxHxTxD, v_BxHxTxV = (t.contiguous() for t in expand_latent(p, latent_BxTxC, cfg))  # (v: a view of kv_b's out)
    out_BxSxHxV = kernels.topk_attention(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK,
                                         mask.bias_at(idx_BxSxK), cfg.softmax_scale)
    if explicit:
        out_BxSxHxV = out_BxSxHxV * allowed_BxSxK.any(-1)[..., None, None]
    return out_BxSxHxV


def sparse_mla(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
               idx_BxSxK: torch.Tensor, mask: Mask, cfg: GLM5Config,
               allowed_BxSxK: torch.Tensor | None = None) -> torch.Tensor:
    """MLA over the selected keys, in latent space: q_nope absorbs W_k, the latent output passes W_v. -> [B,S,H,V]

    The contractions with kv_b compute in the latent's dtype (kv_b's; wider than the queries' under
    --train.reduce_dtype), attention itself in the queries'.
    """
    dt, act = latent_BxTxC.dtype, q_nope_BxSxHxN.dtype
    w_k_HxNxR, w_v_HxVxR = kv_b_heads(p, cfg)
    q_abs_BxSxHxR = torch.einsum("bshn,hnr->bshr", q_nope_BxSxHxN.to(dt), w_k_HxNxR.to(dt)).to(act)
    q_BxSxHxC = torch.cat([q_abs_BxSxHxR, q_rot_BxSxHxP], dim=-1)
    explicit = allowed_BxSxK is not None
    if not explicit:
        allowed_BxSxK = mask.at(idx_BxSxK)
    out_BxSxHxR = kernels.sparse_attention(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, cfg.softmax_scale,
                                           cfg.kv_lora_rank, mask.bias_at(idx_BxSxK))
    if explicit:
        out_BxSxHxR = out_BxSxHxR * allowed_BxSxK.any(-1)[..., None, None]
    return torch.einsum("bshr,hvr->bshv", out_BxSxHxR.to(dt), w_v_HxVxR.to(dt)).to(act)


def expand_latent(p: dict, latent_BxTxC: torch.Tensor, cfg: GLM5Config):
    """Per-head keys [B, H, T, N + P] and values [B, H, T, V] from latent rows (through kv_b_proj)."""
    N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_BxTxR, k_rot_BxTxP = latent_BxTxC.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv_BxHxTx_ = rearrange(linear(merged(p["kv_b_proj"]), kv_BxTxR), "b t (h d) -> b h t d", d=N + V)
    k_nope_BxHxTxN, v_BxHxTxV = kv_BxHxTx_.split([N, V], dim=-1)
    k_rot_BxHxTxP = k_rot_BxTxP[:, None].expand(-1, kv_BxHxTx_.shape[1], -1, -1)
    k_BxHxTx_ = torch.cat([k_nope_BxHxTxN, k_rot_BxHxTxP], dim=-1)
    return k_BxHxTx_, v_BxHxTxV


def dense_mla(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
              mask: Mask, cfg: GLM5Config, allowed_BxSxT: torch.Tensor | None = None) -> torch.Tensor:
    """MLA over all allowed keys (DSA with index_topk >= T), via scaled_dot_product_attention. -> [B, S, H, V]

    `allowed_BxSxT` overrides the mask (the masked-dense oracle of the sparse path passes its top-k set here).
    Computed in the latent's dtype (kv_b's), returned in the queries'.
    """
    k_BxHxTx_, v_BxHxTxV = expand_latent(p, latent_BxTxC, cfg)
    q_BxSxHx_ = torch.cat([q_nope_BxSxHxN, q_rot_BxSxHxP], dim=-1).to(latent_BxTxC.dtype)
    q_BxHxSx_ = rearrange(q_BxSxHx_, "b s h d -> b h s d")
    if allowed_BxSxT is None and mask.is_plain_causal and mask.bias is None:
        out = F.scaled_dot_product_attention(q_BxHxSx_, k_BxHxTx_, v_BxHxTxV, is_causal=True,
                                             scale=cfg.softmax_scale)
    else:
        allowed = mask.rows(0, q_BxHxSx_.shape[2]) if allowed_BxSxT is None else allowed_BxSxT
        additive = torch.zeros(allowed.shape, dtype=q_BxHxSx_.dtype, device=q_BxHxSx_.device)
        if mask.bias is not None:
            additive = additive + mask.bias
        additive = additive.masked_fill(~allowed, torch.finfo(q_BxHxSx_.dtype).min)
        out = F.scaled_dot_product_attention(q_BxHxSx_, k_BxHxTx_, v_BxHxTxV, attn_mask=additive[:, None],
                                             scale=cfg.softmax_scale)
    return rearrange(out, "b h s v -> b s h v").to(q_nope_BxSxHxN.dtype)


@torch.no_grad()
def target_queries(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor,
                   latent_BxTxC: torch.Tensor, cfg: GLM5Config) -> torch.Tensor:
    """The target's queries [B, S, H, C], absorbed into latent space as the sparse path computes them."""
    dt, act = latent_BxTxC.dtype, q_nope_BxSxHxN.dtype
    w_k_HxNxR, _ = kv_b_heads(p, cfg)
    q_abs_BxSxHxR = torch.einsum("bshn,hnr->bshr", q_nope_BxSxHxN.to(dt), w_k_HxNxR.detach().to(dt)).to(act)
    return torch.cat([q_abs_BxSxHxR, q_rot_BxSxHxP], dim=-1)


# ---- the attention block ------------------------------------------------------------------------------------------

def attention(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env, carry: Selection | None,
              kl_block_elems: int = indexer_loss.INDEXER_LOSS_BLOCK_ELEMS) -> tuple[torch.Tensor, Selection, dict]:
    """MLA + DSA for one layer -> (output [B, S, D], the Selection the next layer may reuse, aux). A layer whose
    indexer variant selects (`INDEXERS`: "full", GLM-5.3's "pooled") selects its own keys; a shared layer attends
    to `carry`'s. With env.objectives.indexer_loss on, the aux of a group's last layer (with target "own", every
    full layer) holds the indexer loss's fp64 sums "indexer_loss" and "indexer_recall" (`indexer_loss.kl`). With
    env.record, a selecting layer's aux holds the keys it attended, "selected_keys" [B, S, K] and
    "selected_allowed" (the Selection's `allowed`, None: those the mask allows), where it selected any."""
    q_nope, q_rot, q_BxSxQ, latent_BxSxC = mla_project(p, x_BxSxD, cfg, env)
    # the latent rows are gathered (and their gradients summed over queries and CP ranks) in kv_b's dtype
    latent_dtype = torch.promote_types(latent_BxSxC.dtype, p["kv_b_proj"]["weight"].dtype)
    latent_BxTxC = env.keys(layer, "latent", latent_BxSxC.to(latent_dtype))
    indexer = INDEXERS[layer_spec(cfg, layer).indexer]
    if indexer.selects:
        carry = indexer.select(p["indexer"], x_BxSxD, q_BxSxQ, cfg, layer, env, latent_BxTxC.shape[1])
    out_BxSxHxV = mla_core(p, q_nope, q_rot, latent_BxTxC, carry.topk, env.mask, cfg, env.query_parts,
                           carry.allowed, env.topk_dense)
    out_BxSxD = linear(p["o_proj"], rearrange(out_BxSxHxV, "b s h v -> b s (h v)"))
    aux = {}
    if env.record and indexer.selects and carry.topk is not None:
        aux = {"selected_keys": carry.topk, "selected_allowed": carry.allowed}
    if carry.student is None:
        return out_BxSxD, carry, aux
    target = (target_queries(p, q_nope.detach(), q_rot.detach(), latent_BxTxC.detach(), cfg), latent_BxTxC.detach())
    carry = dataclasses.replace(carry, targets=carry.targets + (target,))
    last = env.objectives.indexer_target == "own" or not INDEXERS[layer_spec(cfg, layer + 1).indexer].reuses
    if not last:
        return out_BxSxD, carry, aux
    loss, recall = indexer_loss.kl(*carry.student, carry.targets, carry.topk if carry.own is None else carry.own, cfg,
                                   env, kl_block_elems, carry.pooling)
    return (out_BxSxD, Selection(carry.topk, allowed=carry.allowed),
            {**aux, "indexer_loss": loss, "indexer_recall": recall})


# ---- the kind records: MLA + DSA and its indexer variants (glm5f.core.layers) ------------------------------------------

def _indexer_params(c: GLM5Config) -> dict:
    D = c.hidden_size
    return {"wq_b": linear_leaves(c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            "wk": linear_leaves(c.index_head_dim, D), "k_norm": norm_leaves(c.index_head_dim, bias=True),
            "weights_proj": linear_leaves(c.index_n_heads, D)}


def _pooled_indexer_params(c: GLM5Config) -> dict:
    """The full indexer's, and the pool keys' softmax: a term per position in the pool, a gate projection."""
    return {**_indexer_params(c), "index_kpool_compress_ape": Leaf((c.index_kpool, c.index_head_dim), "zeros"),
            "index_kpool_compress_gate": Leaf((c.index_head_dim, c.hidden_size), "ones")}


def _indexer_macs(c: GLM5Config, seq: int) -> float:
    """wq_b, wk, weights_proj, and scores plus head weighting over every visible key (forward only)."""
    D, Q, I, J = c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim
    return Q * I * J + D * J + D * I + (seq + 1) / 2 * I * (J + 1)


INDEXER_ROWS = (
    (r"\.indexer\.weights_proj\.weight$", LeafKind(("index_heads", "embed"), fp32=True, optim="indexer")),
    (r"\.indexer\.wq_b\.weight$", LeafKind(("index_heads", "q_lora"), optim="indexer")),
    (r"\.indexer\.wk\.weight$", LeafKind(("index_dim", "embed"), optim="indexer")),
    (r"\.indexer\.k_norm\.(weight|bias)$", LeafKind(("index_dim",), optim="indexer")),
)
# The indexer variants of an mla_dsa layer, by the names `layers.layer_spec` gives them.
INDEXER_KINDS = {
    "full": Indexer(select, params=_indexer_params, rows=INDEXER_ROWS, key_width=lambda c: c.index_head_dim,
                    macs=_indexer_macs),
    "pooled": Indexer(  # its keys carry their gate logits beside them; the pool keys sit at T positions, scored
        # like tokens, and the gate projection adds D J
        lambda ip, x, q, cfg, layer, env, num_keys: select_pooled(ip, x, q, cfg, layer, env),
        params=_pooled_indexer_params,
        rows=INDEXER_ROWS + (
            (r"\.indexer\.index_kpool_compress_ape$", LeafKind(("pool", "index_dim"), optim="indexer")),
            (r"\.indexer\.index_kpool_compress_gate$", LeafKind(("index_dim", "embed"), optim="indexer"))),
        key_width=lambda c: 2 * c.index_head_dim,
        macs=lambda c, seq: _indexer_macs(c, seq) + c.hidden_size * c.index_head_dim),
    "shared": Indexer(reuses=True),
    "none": Indexer(),
}


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
    indexer = INDEXERS[spec.indexer]
    if indexer.selects:
        p["indexer"] = indexer.params(c)
    return p


def _mla_dsa_cache(c: GLM5Config, spec: LayerSpec, batch: int, capacity: int, dtype: torch.dtype,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """"latent" [B, capacity, kv_lora_rank + qk_rope_head_dim]; with its own indexer "index_keys" [B, capacity,
    the indexer's key_width] (the names `Layout.keys` is called with)."""
    out = {"latent": torch.zeros(batch, capacity, c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype, device=device)}
    indexer = INDEXERS[spec.indexer]
    if indexer.selects:
        out["index_keys"] = torch.zeros(batch, capacity, indexer.key_width(c), dtype=dtype, device=device)
    return out


def _mla_dsa_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The MLA projections (q_a, q_b, kv_a, kv_b's key and value halves applied once per token, o_proj); attention
    per head over the keys each query attends (min(index_topk, visible keys) when the sequence is longer than
    index_topk, else every visible key), scores over nope + rope channels and values; the indexer variant's
    (forward only)."""
    D, H, Q, R = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    N, P, V = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    visible = (seq + 1) / 2  # mean keys a causal query sees
    K = c.index_topk  # a query at s attends min(K, s + 1) keys
    attended = (K * (K + 1) // 2 + (seq - K) * K) / seq if seq > K else visible
    macs = D * Q + Q * H * (N + P) + D * (R + P) + R * H * (N + V) + H * V * D + attended * H * (N + P + V)
    return macs, INDEXERS[spec.indexer].macs(c, seq)


def _mla_dsa_transient(c: GLM5Config, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                       weight: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes of the buffers inside glm5f.kernels.dsa ops, which a trace sees the outputs of only:
    in the forward the indexer's chunk of scores with its top-k keys, or the sparse core's block of gathered rows;
    in the backward the sparse core's latent and query gradients and its block."""
    a, w, lat = act.itemsize, wide_dtype(act).itemsize, torch.promote_types(act, weight).itemsize
    H, C, K = c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim, min(c.index_topk, T)
    sparse = T > c.index_topk and S > 1
    fwd, bwd = 0, 0
    if sparse and INDEXERS[spec.indexer].selects:
        rows = min(S, max(1, kernels.INDEXER_QUERY_CHUNK_ELEMS // max(1, B * c.index_n_heads * T)))
        fwd = B * T * c.index_head_dim * a + B * rows * c.index_n_heads * T * w + B * rows * T * (w + 1 + 4 + 8)
    if sparse:
        rows = min(S, kernels.sparse_block_size(B, K, C, H))
        fwd = max(fwd, B * rows * K * (C * a + 2 * H * w))
        bwd += B * T * C * lat + B * S * H * C * a + B * rows * K * (2 * C * a + 4 * H * w)
    return fwd, bwd


MLA_DSA = Kind(
    attention, _mla_dsa_params,
    rows=(
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
    macs=_mla_dsa_macs, transient=_mla_dsa_transient, cache=_mla_dsa_cache, indexed=True)
