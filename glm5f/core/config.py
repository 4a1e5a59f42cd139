"""GLM5Config: the model's hyper-parameters, with Transformers' field names and meanings: `glm_moe_dsa` (GLM-5,
5.1, 5.2) and `glm5_next` (GLM-5.3: KDA and pooled-DSA layers, mHC streams, the SwiGLU clamp).

Also the named presets (`preset("glm5-tiny")`) and conversion to and from a Transformers config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPE = "glm_moe_dsa"
GLM53 = "glm5_next"  # GLM-5.3's Transformers model_type (its text model's config: "glm5_next_text")
MODEL_TYPES = (MODEL_TYPE, GLM53)

# Keys a Transformers config.json carries that say nothing about the network itself.
_HF_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "output_router_logits", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path", "layer_types", "head_dim",
    "qk_head_dim", "num_local_experts", "quantization_config", "auto_map", "tokenizer_class",
}
# ... and those a glm5_next text config carries beside (the router's aux loss weight is a --train flag here).
_HF_BOOKKEEPING_53 = (_HF_BOOKKEEPING - {"layer_types"}) | {"router_aux_loss_coef", "max_window_layers",
                                                            "base_config_key"}


def read_json(path: str, expected: str) -> dict:
    """The JSON object in file `path`; a ValueError naming the file and the `expected` content otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); expected "
                         f"{expected}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; expected {expected}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a JSON {type(obj).__name__}, expected {expected}")
    return obj


@dataclass(frozen=True)
class GLM5Config:
    """Hyper-parameters of a GLM-5 (`glm_moe_dsa`) network: plain fields with Transformers' names, defaults the full
    GLM-5. Derived values are properties. Build one with `preset(name, ...)`, `GLM5Config.from_hf(...)` or
    `GLM5Config(**fields)`; the per-layer lists come from `layer_types(...)` when a schedule is given instead."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    # DeepSeek sparse attention (DSA): the lightning indexer and its top-k.
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    indexer_types: tuple[str, ...] = ("full",) * 78  # per layer: "full" runs the indexer, "shared" reuses the last
    # Mixture of experts.
    mlp_layer_types: tuple[str, ...] = ("dense",) * 3 + ("sparse",) * 75  # per layer: "dense" or "sparse" (MoE)
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # The rest.
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Multi-token-prediction (MTP) layers after the main ones: model.layers.{num_hidden_layers + d}. Trained by
    # the MTP loss and used as a speculative draft; `forward` (the main model's logits) never runs them.
    num_nextn_predict_layers: int = 0
    # MTP depths sharing one layer's parameters (GLM-5 trains 3): the one MTP layer applied mtp_shared_depths times,
    # depth d reading depth d-1's output and t_{i+d}. 0: each MTP layer is one depth. Needs num_nextn_predict_layers 1.
    mtp_shared_depths: int = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    # GLM-5.3 (model_type "glm5_next"); a glm_moe_dsa config keeps these at their defaults, which mean "absent".
    model_type: str = MODEL_TYPE
    layer_types: tuple[str, ...] = ()  # glm5_next, per layer: "linear_attention" (KDA) or "indexed_attention" (DSA)
    linear_num_heads: int = 64  # KDA heads and their q/k/v head dim
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4  # KDA's causal depthwise short convolution
    linear_lower_bound: float | None = -5.0  # KDA's forget gate: lower_bound * sigmoid(..), None: -exp(A) softplus
    hc_mult: int = 4  # mHC residual streams
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    swiglu_limit: float | None = None  # gate clamped to <= limit, up to [-limit, limit]; None: no clamp
    index_kpool: int = 1  # the indexer scores pools of this many keys (1: single keys, GLM-5)
    index_kpool_always_select_tail: bool = True  # a query also attends its own incomplete pool

    def __post_init__(self):
        _validate(self)

    # Derived values.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope(self) -> dict:
        """rope_parameters with their defaults filled in (rope_type, rope_theta, yarn's original length)."""
        rope = dict(self.rope_parameters)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", 10000.0)
        if rope["rope_type"] == "yarn":
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return rope

    @property
    def is_glm53(self) -> bool:
        return self.model_type == GLM53

    @property
    def softmax_scale(self) -> float:
        """MLA's softmax scale: qk_head_dim^-0.5, times the yarn mscale squared where `mscale_all_dim` is set
        (GLM-5.3 has no rope: no mscale)."""
        scale = self.qk_head_dim ** -0.5
        rope = self.rope
        if not self.is_glm53 and rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
            scale = scale * m * m
        return scale

    @property
    def mtp_depths(self) -> int:
        """The MTP depths a training step runs and a speculative step drafts: mtp_shared_depths through the one MTP
        layer, else one per MTP layer."""
        return self.mtp_shared_depths or self.num_nextn_predict_layers

    def mtp_layer(self, depth: int) -> int:
        """The index in model.layers of the layer MTP depth `depth` (1-based) runs."""
        return self.num_hidden_layers + (0 if self.mtp_shared_depths else depth - 1)

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is MoE by mlp_layer_types; MTP layers (layer >= num_hidden_layers) read the last
        main layer's entry. What a layer is, is `layers.layer_spec`'s to say; this reads the schedule it uses."""
        return self.mlp_layer_types[min(layer, self.num_hidden_layers - 1)] == "sparse"

    # Transformers interop.
    @classmethod
    def from_hf(cls, source: dict | str | os.PathLike) -> GLM5Config:
        """From a Transformers config: a dict, a config.json path, or a checkpoint directory holding one."""
        if not isinstance(source, dict):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path!r}: pass a checkpoint directory or a config.json")
            source = read_json(path, "a Transformers config.json (a JSON object of the model's fields)")
        d = dict(source)
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type in (GLM53, GLM53 + "_text"):
            d = _glm53_text_fields(d)
        elif model_type != MODEL_TYPE:
            raise ValueError(f"expected a config of model_type {MODEL_TYPE!r} (GLM-5) or {GLM53!r} (GLM-5.3), found "
                             f"{model_type!r}")
        else:
            d["model_type"] = MODEL_TYPE
            if set(d.pop("layer_types", None) or ()) - {"full_attention", "indexed_attention"}:
                raise ValueError(f"a {MODEL_TYPE} config's layer_types must all be attention layers, got "
                                 f"{sorted(set(source['layer_types']))}")
        if d.get("num_experts") is not None:
            d["n_routed_experts"] = d.pop("num_experts")
        rope = dict(d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {})
        if "rope_theta" in d:
            rope.setdefault("rope_theta", d.pop("rope_theta"))
        if d["model_type"] == MODEL_TYPE:  # GLM-5.3 has no rope
            d["rope_parameters"] = rope
        for name, value in FIXED.items():  # Transformers fields GLM-5 has one value of
            if name in d and (found := d.pop(name)) != value:
                raise ValueError(f"config has {name}={found!r}; GLM-5 (MLA, SwiGLU, no dropout) needs {value!r}")
        if "num_key_value_heads" in d and (found := d.pop("num_key_value_heads")) != d.get("num_attention_heads"):
            raise ValueError(f"MLA expands one latent into every head: num_key_value_heads must equal "
                             f"num_attention_heads ({d.get('num_attention_heads')}), got {found}")
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        d.update(layer_types(d.get("num_hidden_layers", cls.num_hidden_layers), **{
            k: d.pop(k) for k in SCHEDULE if k in d}))
        names = {f.name for f in dataclasses.fields(cls)}
        known = _HF_BOOKKEEPING_53 if d["model_type"] == GLM53 else _HF_BOOKKEEPING
        unknown = sorted(k for k in d if k not in names and k not in known)
        if unknown:
            raise ValueError(f"config has fields GLM5Config does not know: {unknown}. Remove them or check that "
                             f"this is a {d['model_type']} config")
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict[str, Any]:
        """A dict that `transformers.GlmMoeDsaConfig(**d)` (GLM-5) or `transformers.Glm5NextConfig(**d)` (GLM-5.3:
        the fields in its text_config, no vision_config: the caller adds one) and config.json accept."""
        d = dataclasses.asdict(self)
        d.update(FIXED, num_key_value_heads=self.num_attention_heads, indexer_types=list(self.indexer_types),
                 mlp_layer_types=list(self.mlp_layer_types), rope_parameters=self.rope, model_type=MODEL_TYPE,
                 architectures=["GlmMoeDsaForCausalLM"])
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        if not self.mtp_shared_depths:  # glm5f's own field, written only where it is used
            del d["mtp_shared_depths"]
        if not self.is_glm53:
            return {k: v for k, v in d.items() if k not in GLM53_ONLY}
        for name in ("rope_parameters", "mlp_bias", "num_nextn_predict_layers"):
            d.pop(name)
        text = {**d, "layer_types": list(self.layer_types), "model_type": GLM53 + "_text"}
        text.pop("architectures")
        return {"model_type": GLM53, "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings}


# The fields of a GLM-5 config; the others are GLM-5.3's (to_hf writes them for glm5_next only).
_GLM5_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_n_heads", "index_head_dim", "indexer_types", "mlp_layer_types", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
    "rope_parameters", "max_position_embeddings", "rms_norm_eps", "attention_bias", "tie_word_embeddings",
    "initializer_range", "num_nextn_predict_layers", "mtp_shared_depths", "pad_token_id", "bos_token_id",
    "eos_token_id"}

# Transformers' Glm5NextTextConfig defaults (the GLM-5.3-Flash text model): what a glm5_next config.json means by
# the fields it leaves out. `layer_types` and the schedules are derived as Transformers derives them.
GLM53_DEFAULTS: dict[str, Any] = dict(
    model_type=GLM53, vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=45, num_attention_heads=64, n_shared_experts=1, n_routed_experts=288,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0, v_head_dim=256,
    qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
    max_position_embeddings=1048576, initializer_range=0.02, rms_norm_eps=1e-5, pad_token_id=154820,
    bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, attention_bias=False, index_topk=2048,
    index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, index_kpool=16,
    index_kpool_always_select_tail=True)
GLM53_ONLY = {f.name for f in dataclasses.fields(GLM5Config)} - _GLM5_FIELDS - {"model_type"}
# glm5_next config keys about the vision tower and the multimodal tokens: not the text model's.
_GLM53_MULTIMODAL = {"vision_config", "image_token_id", "video_token_id", "image_start_token_id",
                     "image_end_token_id", "video_start_token_id", "video_end_token_id"}


# Fields that do not change what the model computes from token ids: the special token ids and the init scale.
NOT_MATH = ("pad_token_id", "bos_token_id", "eos_token_id", "initializer_range")


def math_differences(a: GLM5Config, b: GLM5Config) -> dict[str, tuple[Any, Any]]:
    """{field: (a's value, b's)} of the fields where configs `a` and `b` compute differently (`NOT_MATH` aside)."""
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(GLM5Config)
            if f.name not in NOT_MATH and getattr(a, f.name) != getattr(b, f.name)}


def glm53_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """Transformers' default GLM-5.3 schedule: every fourth layer (3, 7, ...) DSA, the others KDA."""
    return tuple("indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_hidden_layers))


def _glm53_text_fields(d: dict) -> dict:
    """A glm5_next config.json (its text_config with the top level's tie_word_embeddings, or the text fields at the
    top level of a flat one) as GLM5Config fields with Transformers' defaults for those left out; layer_types' "full_attention" read as
    "indexed_attention", a `linear_attn_config` dict as the linear_* fields. The MTP layer (Transformers has no
    forward for it) is not part of the model: num_nextn_predict_layers is dropped."""
    text = d.get("text_config")
    if isinstance(text, dict):  # the text fields live there; whether the head is tied, at the top (Transformers)
        d = {**text, **{k: d[k] for k in ("tie_word_embeddings",) if k in d}}
    d = {k: v for k, v in d.items() if k not in _GLM53_MULTIMODAL and k != "text_config"}
    linear = d.pop("linear_attn_config", None)
    if isinstance(linear, dict):
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                             ("linear_lower_bound", "gate_lower_bound")):
            if theirs in linear:
                d[ours] = linear[theirs]
        if linear.get("safe_gate", True) and d.get("linear_lower_bound", -5.0) is None:
            d["linear_lower_bound"] = -5.0
    d = {**GLM53_DEFAULTS, **d, "model_type": GLM53}
    d.pop("num_nextn_predict_layers", None)
    types = d.get("layer_types") or glm53_layer_types(d["num_hidden_layers"])
    d["layer_types"] = tuple("indexed_attention" if t == "full_attention" else t for t in types)
    return d


# Transformers fields that GLM-5 holds at one value (written by to_hf, checked by from_hf).
FIXED = {"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False}
# The schedules the per-layer lists are derived from when not given (Transformers' names; see `layer_types`).
SCHEDULE = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "mlp_layer_types",
            "first_k_dense_replace")


def layer_types(num_hidden_layers: int, *, indexer_types=None, index_topk_pattern: str | None = None,
                index_topk_freq: int = 1, index_skip_topk_offset: int = 2, mlp_layer_types=None,
                first_k_dense_replace: int = 3) -> dict[str, tuple[str, ...]]:
    """{"indexer_types", "mlp_layer_types"} of a model of num_hidden_layers layers, as Transformers derives them:
    indexer_types as given, else from index_topk_pattern ("FFSF": F full, S shared), else from the schedule
    index_topk_freq / index_skip_topk_offset; mlp_layer_types as given, else first_k_dense_replace dense layers
    then MoE."""
    n = num_hidden_layers
    if indexer_types is None and index_topk_pattern is not None:
        bad = set(index_topk_pattern) - {"F", "S"}
        if bad:
            raise ValueError(f"index_topk_pattern may hold only 'F' and 'S', found {sorted(bad)} in "
                             f"{index_topk_pattern!r}")
        if len(index_topk_pattern) != n:
            raise ValueError(f"index_topk_pattern {index_topk_pattern!r} has {len(index_topk_pattern)} letters for "
                             f"{n} layers: give one letter per layer (--model.index_topk_pattern)")
        indexer_types = [{"F": "full", "S": "shared"}[c] for c in index_topk_pattern]
    elif indexer_types is None:
        freq, offset = max(index_topk_freq, 1), index_skip_topk_offset
        indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if mlp_layer_types is None:
        k = min(first_k_dense_replace, n)
        mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
    return {"indexer_types": tuple(indexer_types), "mlp_layer_types": tuple(mlp_layer_types)}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_types(cfg: GLM5Config) -> None:
    wrong = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
            wrong.append(f"{f.name}={v!r} (expected int)")
        elif f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            wrong.append(f"{f.name}={v!r} (expected float)")
        elif f.type == "bool" and not isinstance(v, bool):
            wrong.append(f"{f.name}={v!r} (expected bool)")
        elif f.type == "tuple[str, ...]" and (isinstance(v, str) or not all(isinstance(x, str) for x in v)):
            wrong.append(f"{f.name}={v!r} (expected a sequence of strings)")
    if wrong:
        raise TypeError("GLM5Config fields of the wrong type: " + ", ".join(wrong))


def _validate(c: GLM5Config) -> None:
    _check_types(c)
    problems = []

    def need(ok: bool, msg: str):
        if not ok:
            problems.append(msg)

    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_topk",
                 "index_n_heads", "index_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                 "max_position_embeddings") + (() if c.is_glm53 else ("qk_rope_head_dim",)):
        need(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
    need(c.model_type in MODEL_TYPES, f"model_type must be one of {MODEL_TYPES}, got {c.model_type!r}")
    if c.is_glm53:
        _validate_glm53(c, need)
    else:
        for name in ("layer_types", "swiglu_limit", "index_kpool"):
            need(getattr(c, name) == GLM5_ABSENT[name], f"{name}={getattr(c, name)!r} is a GLM-5.3 field: set "
                                                        f"model_type={GLM53!r} for it (GLM-5 has {GLM5_ABSENT[name]!r})")
    need(c.num_nextn_predict_layers >= 0, f"num_nextn_predict_layers must be >= 0, got {c.num_nextn_predict_layers}")
    need(c.mtp_shared_depths >= 0, f"mtp_shared_depths must be >= 0, got {c.mtp_shared_depths}")
    need(not c.mtp_shared_depths or c.num_nextn_predict_layers == 1,
         f"mtp_shared_depths ({c.mtp_shared_depths}) applies one MTP layer several times: it needs "
         f"num_nextn_predict_layers 1, got {c.num_nextn_predict_layers}")
    need(c.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {c.n_shared_experts}")
    need(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even (RoPE rotates pairs), got {c.qk_rope_head_dim}")
    need(c.index_head_dim >= c.qk_rope_head_dim,
         f"index_head_dim ({c.index_head_dim}) must hold the rope part (qk_rope_head_dim={c.qk_rope_head_dim})")
    need(c.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {c.rms_norm_eps}")
    n = c.num_hidden_layers
    need(len(c.indexer_types) == n, f"indexer_types has {len(c.indexer_types)} entries for {n} layers (set one per "
                                    f"layer, e.g. with --model.index_topk_pattern)")
    need(set(c.indexer_types) <= {"full", "shared"}, f"indexer_types may hold 'full'/'shared', got {c.indexer_types}")
    kinds = c.layer_types if len(c.layer_types) == n else ("indexed_attention",) * n
    first_dsa = kinds.index("indexed_attention") if "indexed_attention" in kinds else None
    need(first_dsa is None or len(c.indexer_types) <= first_dsa or c.indexer_types[first_dsa] == "full",
         "the first layer's indexer must be 'full': a 'shared' layer reuses the top-k of an earlier full layer")
    need(len(c.mlp_layer_types) == n, f"mlp_layer_types has {len(c.mlp_layer_types)} entries for {n} layers (set "
                                      f"one per layer, e.g. with --model.first_k_dense_replace)")
    need(set(c.mlp_layer_types) <= {"dense", "sparse"}, f"mlp_layer_types may hold 'dense'/'sparse', "
                                                        f"got {c.mlp_layer_types}")
    if "sparse" in c.mlp_layer_types:
        E, G = c.n_routed_experts, c.n_group
        need(E % G == 0, f"n_routed_experts ({E}) must be divisible by n_group ({G})")
        need(c.topk_group <= G, f"topk_group ({c.topk_group}) must be <= n_group ({G})")
        if E % G == 0:
            need(G == 1 or E // G >= 2, f"group-limited routing scores a group by its top-2 experts: "
                                        f"n_routed_experts / n_group must be >= 2, got {E // G}")
            need(c.num_experts_per_tok <= c.topk_group * (E // G),
                 f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds the experts in the chosen groups "
                 f"(topk_group * n_routed_experts / n_group = {c.topk_group * (E // G)})")
    rope = c.rope
    need(rope["rope_type"] in ("default", "yarn"), f"rope_type must be 'default' or 'yarn', got {rope['rope_type']!r}")
    if rope["rope_type"] == "yarn":
        need(isinstance(rope.get("factor"), (int, float)) and rope["factor"] >= 1,
             f"yarn rope needs rope_parameters['factor'] >= 1, got {rope.get('factor')!r}")
    if problems:
        raise ValueError("invalid GLM5Config:\n  - " + "\n  - ".join(problems))


# The values of the GLM-5.3 fields that mean "absent" in a GLM-5 config.
GLM5_ABSENT = {"layer_types": (), "swiglu_limit": None, "index_kpool": 1}


# The attention kind (by its name in `glm5f.core.layers.ATTENTION`) that each GLM-5.3 layer_types entry selects.
ATTENTION_KINDS = {"linear_attention": "kda", "indexed_attention": "mla_dsa"}


def _validate_glm53(c: GLM5Config, need) -> None:
    n = c.num_hidden_layers
    need(c.qk_rope_head_dim == 0, f"GLM-5.3's attention has no rope: qk_rope_head_dim must be 0, got "
                                  f"{c.qk_rope_head_dim}")
    kinds = "/".join(repr(t) for t in ATTENTION_KINDS)
    need(len(c.layer_types) == n, f"layer_types has {len(c.layer_types)} entries for {n} layers (one per layer: "
                                  f"{kinds})")
    need(set(c.layer_types) <= set(ATTENTION_KINDS), f"layer_types may hold {kinds}, got {sorted(set(c.layer_types))}")
    for name in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters",
                 "index_kpool"):
        need(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
    need(c.hc_eps >= 0, f"hc_eps must be >= 0, got {c.hc_eps}")
    need(c.swiglu_limit is None or c.swiglu_limit > 0, f"swiglu_limit must be positive or None, got "
                                                       f"{c.swiglu_limit}")
    need(c.index_kpool <= 0 or c.index_topk % c.index_kpool == 0,
         f"index_topk ({c.index_topk}) must be divisible by index_kpool ({c.index_kpool}): it selects "
         f"index_topk / index_kpool pools")
    need(c.num_nextn_predict_layers == 0, "GLM-5.3's MTP layer is not trained here (Transformers has no forward "
                                          "for it; save_hf copies its tensors): num_nextn_predict_layers must be 0")
    if len(c.layer_types) == n and len(c.indexer_types) == n:
        for i in range(1, n):
            if c.layer_types[i] == "indexed_attention" and c.indexer_types[i] == "shared":
                need(c.layer_types[i - 1] == "indexed_attention",
                     f"layer {i} shares the top-k of the layer before it (indexer_types 'shared'), which is a "
                     f"{c.layer_types[i - 1]} layer: a shared DSA layer must directly follow a DSA layer")


# The sizes of the two scaled presets: a few hundred hidden units, four layers, DSA sparse below 64 keys.
_SCALED = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, moe_intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, index_topk=64, index_n_heads=16, index_head_dim=32, max_position_embeddings=4096)

# Presets: plain dicts of overrides on the defaults (the full GLM-5), looked up by name.
PRESETS: dict[str, dict[str, Any]] = {
    "glm5": {"num_nextn_predict_layers": 1},  # the release carries one MTP layer
    # MLA + DSA attention with dense SwiGLU MLPs only.
    "glm5-scaled-dense": dict(_SCALED, first_k_dense_replace=4, n_routed_experts=8, num_experts_per_tok=2),
    # Every GLM-5 part at a CPU-friendly size: a dense first layer, MoE with groups, shared-indexer layers.
    "glm5-scaled-moe": dict(_SCALED, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
                            num_experts_per_tok=4, n_group=4, topk_group=2, index_topk_pattern="FFSF"),
    # Toy size, every feature on: dense layer, MoE layers, a shared-indexer layer, index_topk << sequence.
    "glm5-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_topk=16, index_n_heads=4, index_head_dim=16,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, index_topk_pattern="FFS", max_position_embeddings=2048,
    ),
    # GLM-5.3-Flash's text model (Transformers' glm5_next defaults); its MTP layer is not trained here.
    "glm53": dict(GLM53_DEFAULTS),
    # GLM-5.3 at CPU bench size: three KDA layers and a DSA layer (the release's ratio), 16 pools of 8 selected.
    "glm53-scaled": dict(GLM53_DEFAULTS, **{**_SCALED, "qk_rope_head_dim": 0, "index_topk": 128,
                                            "max_position_embeddings": 65536}, index_kpool=8, layer_types=glm53_layer_types(4), first_k_dense_replace=1,
                         n_routed_experts=16, num_experts_per_tok=4, linear_num_heads=4, linear_head_dim=64,
                         pad_token_id=None, bos_token_id=0, eos_token_id=1),
    # Toy size, every GLM-5.3 part on: KDA and DSA layers, four mHC streams, a dense layer and MoE layers with
    # groups, the clamp, pools of 2 with the tail, index_topk << sequence.
    "glm53-tiny": dict(
        GLM53_DEFAULTS, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, layer_types=("linear_attention", "indexed_attention", "linear_attention",
                                          "indexed_attention"),
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_topk=8, index_kpool=2, index_n_heads=4, index_head_dim=16, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        linear_num_heads=2, linear_head_dim=16, max_position_embeddings=2048, pad_token_id=None, bos_token_id=0,
        eos_token_id=1,
    ),
}


def preset(name: str, **overrides) -> GLM5Config:
    """The named preset, with `overrides` applied to its fields; the per-layer lists are derived from the schedule
    (`layer_types`: index_topk_pattern, first_k_dense_replace, ...) for the resulting number of layers."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    schedule = {k: fields.pop(k) for k in SCHEDULE if k in fields}
    if "num_hidden_layers" in overrides and "index_topk_pattern" in schedule and "index_topk_pattern" not in overrides:
        del schedule["index_topk_pattern"]  # the preset's pattern is for its own depth: use the default schedule
    n = fields.get("num_hidden_layers", GLM5Config.num_hidden_layers)
    if fields.get("model_type") == GLM53 and ("layer_types" not in fields or (
            "num_hidden_layers" in overrides and "layer_types" not in overrides)):
        fields["layer_types"] = glm53_layer_types(n)  # the preset's schedule is for its own depth
    return GLM5Config(**fields, **layer_types(n, **schedule))
