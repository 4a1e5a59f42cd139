"""LoRA adapters: low-rank factors kept in their own pytree beside the frozen base params.

An adapted weight W [out, in] (routed experts: [E, out, in]) gets A [r, in] and B [out, r] ([E, r, in] and
[E, out, r]); its layer computes x W^T + scale * (x A^T) B^T, scale = alpha / rank. B starts at zero, so a fresh
adapter changes nothing. The adapter tree is flat, {dotted path: tensor}, with paths `<module>.lora_A` and
`<module>.lora_B` beside the module's `<module>.weight`; `attach` puts them into the params tree for a forward.

Where weights are used: the Env's `weights` (cast, FSDP gather) `bind`s the run's spec beside each adapter, and
ops.linear and moe.expert_linear add the adapter's product unmerged; kv_b_proj, which MLA reads as a matrix
(absorbed into queries, or expanding latents), is read `merged` (W + delta, no dropout).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from glm5f.core.ops import wide_dtype
from glm5f.parallel.layout import full_tensor
from glm5f.core.params import flatten

# GLM-5's LoRA recipe: the attention projections, MLA's and (GLM-5.3) KDA's q, k, v and o (the DSA indexer's own
# projections and KDA's gates are not adapted unless --lora.targets names them).
DEFAULT_TARGETS = r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_proj|k_proj|v_proj)$"
# Weights that are not linear projections of activations: never adapted (KDA's depthwise short convolutions
# neither: [H d, 1, kernel], no matrix).
NOT_ADAPTABLE = re.compile(r"(embed_tokens|lm_head|shared_head\.head|mlp\.gate|_conv1d)$")


@dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha (scale = alpha / r), dropout on the adapters' input, targets: a regex (re.search) over the
    module paths of the weights to adapt, e.g. `model.layers.3.self_attn.q_b_proj` or `model.layers.3.mlp.experts.
    gate_proj`."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_modules(params: dict, targets: str) -> dict[str, tuple[int, ...]]:
    """{module path: weight shape} of the weights `targets` selects, in tree order; an error when it selects none."""
    pattern = re.compile(targets)
    found = {}
    for path, t in flatten(params).items():
        module, _, name = path.rpartition(".")
        if name == "weight" and t.ndim in (2, 3) and not NOT_ADAPTABLE.search(module) and pattern.search(module):
            found[module] = tuple(t.shape)
    if not found:
        raise ValueError(f"--lora.targets {targets!r} matches no adaptable weight; it is matched (re.search) against "
                         f"module paths such as 'model.layers.0.self_attn.q_b_proj' or "
                         f"'model.layers.1.mlp.experts.gate_proj'")
    return found


def adapter_shapes(params: dict, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """{"<module>.lora_A": (.., r, in), "<module>.lora_B": (.., out, r)} for the weights spec.targets selects
    (`params` may be abstract: meta tensors)."""
    if spec.rank < 1:
        raise ValueError(f"--lora.rank must be at least 1, got {spec.rank}")
    shapes = {}
    for module, (*experts, out_features, in_features) in target_modules(params, spec.targets).items():
        shapes[f"{module}.lora_A"] = (*experts, spec.rank, in_features)
        shapes[f"{module}.lora_B"] = (*experts, out_features, spec.rank)
    return shapes


def init_adapters(params: dict, spec: LoraSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Fresh adapters for the weights of `params` that spec.targets selects: A uniform in +-1/sqrt(in) (the
    Kaiming-uniform bound PEFT draws from), B zeros. Each A draws from a generator seeded by (seed, path)."""
    adapters = {}
    for path, shape in adapter_shapes(params, spec).items():
        if path.endswith(".lora_B"):
            adapters[path] = torch.zeros(shape, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
        a = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
        adapters[path] = (a * (1.0 / math.sqrt(shape[-1]))).to(dtype)  # the Kaiming-uniform bound
    return adapters


def nest(flat: dict) -> dict:
    """The nested tree of a {dotted path: leaf} dict (keys that are all digits become lists, as params' layers)."""
    root: dict = {}
    for path, leaf in flat.items():
        *keys, last = path.split(".")
        node = root
        for k in keys:
            node = node.setdefault(k, {})
        node[last] = leaf

    def lists(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}
    return lists(root)


def attach(params: dict, adapters: dict) -> dict:
    """The params tree with each adapter leaf beside its module's weight (`<module>` gets "lora_A", "lora_B")."""
    if not adapters:
        return params
    return nest({**flatten(params), **adapters})


ADAPTER_LEAVES = ("lora_A", "lora_B")


def is_adapter(path: str) -> bool:
    """Whether the leaf at dotted `path` is a LoRA factor."""
    return path.rpartition(".")[2] in ADAPTER_LEAVES


def bind(tree, spec: LoraSpec | None):
    """The compute tree with `spec` (its scale and dropout) beside each adapter's factors, under "lora", for the
    layers (ops.linear, moe.expert_linear) to read; a ValueError when the tree holds adapters and spec is None."""
    if isinstance(tree, list):
        return [bind(t, spec) for t in tree]
    if not isinstance(tree, dict):
        return tree
    if "lora_A" in tree:
        if spec is None:
            raise ValueError("the params hold LoRA adapters (lora_A / lora_B) but no LoraSpec was given: pass the "
                             "spec they were trained with (checkpoint.load_adapters returns it)")
        return {**tree, "lora": spec}
    return {k: bind(v, spec) for k, v in tree.items()}


def merged(p: dict) -> dict:
    """A module's compute params with its adapter merged: {"weight": W + scale * B @ A (added in fp32, in W's
    dtype), "bias" if any}; the module's params as they are without one."""
    if "lora_A" not in p:
        return p
    w = p["weight"]
    out = {k: v for k, v in p.items() if k not in (*ADAPTER_LEAVES, "lora")}
    out["weight"] = (w.to(wide_dtype(w.dtype)) + delta(p["lora_A"], p["lora_B"], p["lora"].scale)).to(w.dtype)
    return out


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * B @ A in fp32 (fp64 for fp64 factors): the change an adapter makes to its weight."""
    dt = wide_dtype(torch.promote_types(a.dtype, b.dtype))
    return (b.to(dt) @ a.to(dt)) * scale


def merge(params: dict, adapters: dict, spec: LoraSpec) -> dict:
    """The base params with every adapter merged into its weight (W + scale * B @ A in fp32, cast to W's dtype).
    Sharded (DTensor) leaves of a parallel run: each adapter is gathered whole and its delta laid out as its
    weight (collective: every rank calls it)."""
    flat = flatten(params)
    for module in dict.fromkeys(p.rpartition(".")[0] for p in adapters):  # one order on every rank
        w = flat[f"{module}.weight"]
        d = delta(full_tensor(adapters[f"{module}.lora_A"]), full_tensor(adapters[f"{module}.lora_B"]), spec.scale)
        if isinstance(w, DTensor):
            d = distribute_tensor(d.to(w.device), w.device_mesh, w.placements)
        flat[f"{module}.weight"] = (w.to(wide_dtype(w.dtype)) + d).to(w.dtype)
    return nest(flat)
