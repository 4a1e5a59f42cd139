"""Small pure building blocks: norms, interleaved RoPE (default and yarn), linear layers and the SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from glm5f.core.config import GLM5Config, yarn_mscale


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or `dtype` when it is wider (fp64): the precision of what the reference computes in fp32."""
    return torch.promote_types(dtype, torch.float32)


def wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(wide_dtype(x.dtype))


# Every op that meets a weight computes in the wider of the weight's and the input's dtype and returns the input's
# dtype. Weights normally arrive in the activations' dtype and the casts do nothing; a run with
# --train.reduce_dtype float64 hands fp64 weights to fp32 activations, so every contraction with a weight (and so
# every weight-gradient sum over tokens) accumulates in fp64, and each result is rounded to fp32.

def linear(p: dict, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T (+ b) for a params dict {"weight": [out, in], optional "bias": [out]}; with a LoRA adapter beside
    the weight ("lora_A" [r, in], "lora_B" [out, r] and its spec "lora", see glm5f.model.lora), plus
    scale * (dropout(x) @ A^T) @ B^T, the [out, in] delta never formed."""
    w, b = p["weight"], p.get("bias")
    dt = torch.promote_types(x.dtype, w.dtype)
    y = F.linear(x.to(dt), w.to(dt), None if b is None else b.to(dt))
    if "lora_A" in p:
        h = adapter_input(p, x.to(dt))
        y = y + F.linear(F.linear(h, p["lora_A"].to(dt)), p["lora_B"].to(dt)) * p["lora"].scale
    return y.to(x.dtype)


def adapter_input(p: dict, x: torch.Tensor) -> torch.Tensor:
    """A LoRA adapter's input: x, through dropout (torch's global RNG) when its spec has one."""
    dropout = p["lora"].dropout
    return F.dropout(x, dropout) if dropout else x


def rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the scale, as the reference does."""
    x32 = wide(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)


def layer_norm(p: dict, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm with weight and bias (the DSA indexer's key norm)."""
    dt = torch.promote_types(x.dtype, p["weight"].dtype)
    return F.layer_norm(x.to(dt), (x.shape[-1],), p["weight"].to(dt), p["bias"].to(dt), eps).to(x.dtype)


def swiglu_mlp(p: dict, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), with `limit` (GLM-5.3's swiglu_limit) on the gate and up projections first."""
    return linear(p["down_proj"], swiglu(linear(p["gate_proj"], x), linear(p["up_proj"], x), limit))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit`, the gate clamped to at most limit and up to [-limit, limit] before (as
    GLM-5.3's reference clamps them: outside those ranges their gradients are zero)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


# ---- RoPE ---------------------------------------------------------------------------------------------------------

def rope_inv_freq(cfg: GLM5Config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim / 2], cos/sin scale) for the config's rope_type ("default" or "yarn")."""
    rope, dim = cfg.rope, cfg.qk_rope_head_dim
    base = rope["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    if rope["rope_type"] == "default":
        return 1.0 / (base ** exponents), 1.0
    # yarn: interpolate low frequencies, keep high ones, with a linear ramp between.
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** exponents
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, attention_factor


def rope_tables(cfg: GLM5Config, position_ids_BxS: torch.Tensor, dtype: torch.dtype):
    """cos and sin of each position's angles, [B, S, rope_dim / 2], in `dtype`."""
    inv_freq, scale = rope_inv_freq(cfg)
    angles = position_ids_BxS[..., None].float() * inv_freq.to(position_ids_BxS.device)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos_BxSxR: torch.Tensor, sin_BxSxR: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on x [B, S, ..., R*2]: pairs (x0, x1), (x2, x3), ... rotate by one angle each.

    The result is laid out [rotated evens, rotated odds] (as in the reference); queries and keys share the layout,
    so their dot products are those of the interleaved rotation.
    """
    extra = x.ndim - cos_BxSxR.ndim
    cos = cos_BxSxR.reshape(*cos_BxSxR.shape[:2], *([1] * extra), cos_BxSxR.shape[-1])
    sin = sin_BxSxR.reshape(cos.shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
