"""The one place that maps glm5f's parameter paths to Transformers checkpoint keys, and GLM-5.3's text model to
its place in `Glm5NextForConditionalGeneration` (under model.language_model).

Paths and keys are equal, except that our stacked routed experts `mlp.experts.{gate,up,down}_proj.weight` [E, ...]
are written per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the GLM-5 release layout) and read from that
layout or from the fused one (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from glm5f.core.config import GLM5Config
from glm5f.core.params import abstract_params, describe_mismatch, flatten, leaf_kind

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
HF_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # Transformers' names (GLM-5.3's too)


def expert_leaf(path: str) -> tuple[str, str] | None:
    """(prefix "….mlp.experts", projection name) of a stacked routed-expert leaf (LEAF_KINDS axes "experts", ...)."""
    if leaf_kind(path).axes[0] != "experts":
        return None
    prefix, proj, _ = path.rsplit(".", 2)
    return prefix, proj


def hf_keys(path: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The checkpoint keys of one of our leaves, each with its expert index (None: the whole leaf)."""
    m = expert_leaf(path)
    if not m:
        return [(path, None)]
    prefix, proj = m
    return [(f"{prefix}.{e}.{proj}.weight", e) for e in range(shape[0])]


def hf_state_dict(params: dict, *, fused_experts: bool = False, cfg: GLM5Config | None = None
                  ) -> dict[str, torch.Tensor]:
    """Our params as checkpoint tensors: per expert (default), or fused as Transformers holds them in memory.

    The per-expert tensors are views of the stacked leaves; differentiable, so a Transformers module driven by
    `torch.func.functional_call(model, hf_state_dict(params, fused_experts=True), ...)` yields gradients for our
    leaves. For GLM-5.3 (`cfg`), the keys are those of Glm5NextForConditionalGeneration: the text model's under
    model.language_model, and with fused_experts its in-memory names (`_glm53_in_memory`).
    """
    if cfg is not None and cfg.is_glm53:
        out = {checkpoint_key(cfg, k): t for k, t in hf_state_dict(params, fused_experts=fused_experts).items()}
        return _glm53_in_memory(out) if fused_experts else out
    out = {}
    for path, t in flatten(params).items():
        m = expert_leaf(path)
        if not fused_experts or not m:
            out.update((key, t if e is None else t[e]) for key, e in hf_keys(path, tuple(t.shape)))
            continue
        prefix, proj = m
        if proj == "down_proj":
            out[f"{prefix}.down_proj"] = t
        elif proj == "up_proj":
            out[f"{prefix}.gate_up_proj"] = torch.cat([out.pop(f"{prefix}.gate_proj"), t], dim=1)
        else:
            out[f"{prefix}.gate_proj"] = t  # joined with up_proj (which follows in tree order)
    return out


def load_plan(cfg: GLM5Config, inv: dict, copies: tuple[str, ...] = ()) -> tuple[dict[str, list], list[str]]:
    """{checkpoint key: [(our path, expert index or None, row slice or None)]} and the keys of layers past the
    config's (MTP layers it does not count); raises one error listing every missing, unexpected and misshapen
    tensor."""
    want = {p: tuple(t.shape) for p, t in flatten(abstract_params(cfg, torch.float32, copies)).items()}
    plan, missing, wrong, known = {}, [], [], set()

    def expect(key: str, shape: tuple, target):
        known.add(key)
        if key not in inv:
            missing.append(key)
        elif inv[key][1] != shape:
            wrong.append(f"{key}: expected {list(shape)}, found {list(inv[key][1])}")
        else:
            plan.setdefault(key, []).append(target)

    fused_done = set()
    for path, shape in want.items():
        m = expert_leaf(path)
        if not m:
            expect(path, shape, (path, None, None))
            continue
        prefix, proj = m
        E = shape[0]
        if f"{prefix}.0.{proj}.weight" in inv or f"{prefix}.gate_up_proj" not in inv:
            for e in range(E):
                expect(f"{prefix}.{e}.{proj}.weight", shape[1:], (path, e, None))
        elif proj == "down_proj":
            expect(f"{prefix}.down_proj", shape, (path, None, None))
        elif prefix not in fused_done:
            fused_done.add(prefix)
            F_ = shape[1]
            gate_path, up_path = f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"
            expect(f"{prefix}.gate_up_proj", (E, 2 * F_, shape[2]), (gate_path, None, slice(0, F_)))
            if f"{prefix}.gate_up_proj" in plan:
                plan[f"{prefix}.gate_up_proj"].append((up_path, None, slice(F_, 2 * F_)))
    mtp, unexpected = [], []
    for key in inv.keys() - known:
        layer = LAYER_KEY.match(key)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            mtp.append(key)
        else:
            unexpected.append(key)
    if missing or unexpected or wrong:
        raise ValueError("checkpoint does not match its config.json:\n" +
                         describe_mismatch(sorted(missing), sorted(unexpected), sorted(wrong)) +
                         "\nNothing was loaded. Check that config.json belongs to these weights.")
    return plan, sorted(mtp)


def summarize_keys(keys: list[str]) -> list[str]:
    """Collapse expert indices: model.layers.78.mlp.experts.{0..255}.up_proj.weight."""
    groups = defaultdict(list)
    for k in keys:
        m = re.match(r"^(.*\.experts\.)(\d+)(\..*)$", k)
        if m:
            groups[(m.group(1), m.group(3))].append(int(m.group(2)))
        else:
            groups[(k, None)] = []
    out = []
    for (head, tail), ids in sorted(groups.items()):
        out.append(head if tail is None else f"{head}{{{min(ids)}..{max(ids)}}}{tail}")
    return out

# ---- GLM-5.3 (Glm5NextForConditionalGeneration) ---------------------------------------------------------------
# Our paths are the text model's checkpoint keys without its `language_model.` level: `model.layers.3.hc_attn_fn`
# is the checkpoint's `model.language_model.layers.3.hc_attn_fn` (`lm_head.weight` is the same). The checkpoint's
# other tensors (the vision tower `model.visual.*`, the MTP layer `model.language_model.layers.{L}.*`, which
# Transformers has no forward for) are not trained here; save_hf copies them from its `source` checkpoint.
_GLM53_TEXT = "model.language_model."
GLM53_RENAMES = [(re.compile(a), b) for a, b in [  # checkpoint key -> Transformers' parameter (its conversion)
    (r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b", r".self_attn.forget_gate.\1"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
]]


def checkpoint_key(cfg: GLM5Config, path: str) -> str:
    """The checkpoint key of our path `path` (GLM-5: the same)."""
    if cfg.is_glm53 and path.startswith("model."):
        return _GLM53_TEXT + path[len("model."):]
    return path


def text_model_keys(cfg: GLM5Config, inv: dict) -> tuple[dict, list[str]]:
    """(inventory by our paths, the keys that are not the text model's) of a checkpoint's inventory. A GLM-5.3
    checkpoint's text model lies under model.language_model (a text-only one's may lie under model)."""
    if not cfg.is_glm53:
        return inv, []
    prefix = _GLM53_TEXT if any(k.startswith(_GLM53_TEXT) for k in inv) else "model."
    ours, carried = {}, []
    for key, entry in inv.items():
        layer = re.match(re.escape(prefix) + r"layers\.(\d+)\.", key)
        if key == "lm_head.weight" or (key.startswith(prefix) and not (layer and int(layer.group(1)) >=
                                                                       cfg.num_hidden_layers)
                                       and not key.startswith("model.visual.")):
            ours["model." + key[len(prefix):] if key.startswith(prefix) else key] = entry
        else:
            carried.append(key)
    return ours, carried


def _glm53_in_memory(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a GLM-5.3 text model (fused experts) as Transformers' model names them after its
    conversion mapping: forget_gate.*, {attn,ffn}_hc.*, and conv1d.weight, the q, k and v convolutions stacked."""
    out = {}
    for key, t in sd.items():
        conv = re.match(r"^(.*\.self_attn\.)([qkv])_conv1d\.weight$", key)
        if conv:
            if conv.group(2) == "v":
                out[conv.group(1) + "conv1d.weight"] = torch.cat(
                    [sd[f"{conv.group(1)}{n}_conv1d.weight"] for n in "qkv"], dim=0)
            continue
        for pattern, repl in GLM53_RENAMES:
            key = pattern.sub(repl, key)
        out[key] = t
    return out


def module_name(cfg: GLM5Config, path: str) -> str:
    """The name Transformers' model of `cfg` gives our module (or parameter) path `path`: GLM-5's is the same;
    GLM-5.3's lies under model.language_model, the forget gate's projections under `forget_gate`."""
    if not cfg.is_glm53:
        return path
    path = checkpoint_key(cfg, path)
    for pattern, repl in GLM53_RENAMES:
        path = pattern.sub(repl, path)
    return path

