"""LoRA adapters in PEFT's adapter format (adapter_config.json + adapter_model.safetensors), keyed as PEFT keys
them on the modules and parameters of Transformers' model."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections import defaultdict

import torch

from glm5f.core.config import GLM5Config
from glm5f.ckpt.hf import io
from glm5f.ckpt.hf.export_dir import PEFT_FILES, check_export_dir, write_dir, write_marker
from glm5f.ckpt.hf.keys import HF_LAYER_KEY, LAYER_KEY, expert_leaf, module_name
from glm5f.model.lora import NOT_ADAPTABLE, LoraSpec
from glm5f.core.params import abstract_params, flatten

# PEFT keys an adapter by the Transformers module it wraps: `base_model.model.<module>.lora_A.weight` [r, in] and
# `….lora_B.weight` [out, r]. Transformers holds the routed experts as parameters (`gate_up_proj` [E, 2F, D],
# `down_proj` [E, D, F]), which PEFT adapts through `target_parameters`: per parameter one lora_A [E * r, in]
# (row e * r + k: expert e's row k) and one lora_B [out, r * E] (column k * E + e: expert e's column k). glm5f's
# separate gate and up adapters become one of rank 2r on gate_up_proj (A stacked, B block-diagonal: the same
# product) with alpha doubled (the same scale). Both parameters live on one module, wrapped twice (gate_up_proj
# inside): gate_up_proj's keys gain `base_layer.` where down_proj is adapted too.
# The dense and shared-expert MLPs' gate_proj / up_proj / down_proj are adapted as parameters too
# (`….gate_proj.weight`, the same keys and shapes): PEFT moves those names out of `target_modules` onto the routed
# experts (its conversion of adapters written for Transformers 4), but leaves `target_parameters` as written.

_PEFT_PREFIX = "base_model.model."
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _peft_targets(cfg: GLM5Config) -> dict[str, tuple[str, str]]:
    """{Transformers module or parameter name: (glm5f weight path, "module" | "parameter")} for every weight PEFT
    can adapt in Transformers' model of `cfg` (routed experts: `….experts.gate_up_proj` and `….experts.down_proj`,
    both naming the gate leaf's path's prefix; MTP layers are not in Transformers' model; nor are the KDA short
    convolutions, which are no linear maps, `lora.NOT_ADAPTABLE`)."""
    out = {}
    for path, t in flatten(abstract_params(cfg, torch.float32)).items():
        module, _, name = path.rpartition(".")
        layer = LAYER_KEY.match(path)
        if name != "weight" or t.ndim not in (2, 3) or (layer and int(layer.group(1)) >= cfg.num_hidden_layers) or \
                NOT_ADAPTABLE.search(module):
            continue
        m = expert_leaf(path)
        if m:
            out[module_name(cfg, f"{m[0]}.{'down_proj' if m[1] == 'down_proj' else 'gate_up_proj'}")] = \
                (path, "parameter")
        elif module.rpartition(".")[2] in _MLP_NAMES:
            out[module_name(cfg, path)] = (path, "parameter")
        else:
            out[module_name(cfg, module)] = (path, "module")
    return out


def _compact(names: list[str], universe: set[str], shadowed: tuple[str, ...] = ()) -> list[str]:
    """`names` as PEFT matches them (a name selects every module or parameter that ends with "." + it): one
    layer-free suffix (`self_attn.q_a_proj`) for a name adapted in every layer that has it, else the full names
    (always for the suffixes in `shadowed`, which other modules of Transformers' model end with too)."""
    by_suffix: dict[str, set[str]] = defaultdict(set)
    for n in universe:
        m = HF_LAYER_KEY.match(n)
        by_suffix[n[m.end():] if m else n].add(n)
    out = []
    for suffix, members in sorted(by_suffix.items()):
        chosen = members & set(names)
        if chosen == members and HF_LAYER_KEY.match(next(iter(members))) and suffix not in shadowed:
            out.append(suffix)
        else:
            out.extend(sorted(chosen))
    return out


def peft_adapter(cfg: GLM5Config, adapters: dict, spec: LoraSpec, base_model_name_or_path: str | None = None,
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors keyed as PEFT saves them, adapter_config.json) of glm5f adapters (`glm5f.model.lora`: {"<module>.lora_A":
    [r, in] or [E, r, in], "<module>.lora_B": [out, r] or [E, out, r]}, scale spec.alpha / spec.rank) for
    Transformers' GlmMoeDsaForCausalLM of `cfg`; tensors keep the adapters' dtypes. Adapters of the MTP layers,
    which Transformers' model does not have, are left out with a warning (the merged export keeps them). A
    ValueError names adapters that do not fit `cfg` or `spec`. `base_model_name_or_path` is written absolute
    where it names a local path (PEFT reads it from wherever the adapter is loaded), else as given (a Hub id)."""
    targets = _peft_targets(cfg)
    shapes = {p: tuple(t.shape) for p, t in flatten(abstract_params(cfg, torch.float32)).items()}
    modules = list(dict.fromkeys(k.rpartition(".")[0] for k in adapters))
    bad, mtp = [], []
    for module in modules:
        a, b = adapters.get(f"{module}.lora_A"), adapters.get(f"{module}.lora_B")
        w = shapes.get(f"{module}.weight")
        layer = LAYER_KEY.match(module + ".")
        if w is None or a is None or b is None:
            bad.append(f"{module}: expected {module}.lora_A and .lora_B beside a weight of the model, found "
                       f"{sorted(k for k in adapters if k.rpartition('.')[0] == module)}")
        elif (tuple(a.shape), tuple(b.shape)) != ((*w[:-2], spec.rank, w[-1]), (*w[:-2], w[-2], spec.rank)):
            bad.append(f"{module}: expected lora_A {[*w[:-2], spec.rank, w[-1]]} and lora_B "
                       f"{[*w[:-2], w[-2], spec.rank]} (weight {list(w)}, rank {spec.rank}), found "
                       f"{list(a.shape)} and {list(b.shape)}")
        elif layer and int(layer.group(1)) >= cfg.num_hidden_layers:
            mtp.append(module)
    if bad:
        raise ValueError(f"adapters do not fit the model's config and --lora.rank ({len(bad)} in all):\n  " +
                         "\n  ".join(bad[:8] + (["..."] if len(bad) > 8 else [])))
    if mtp:
        warnings.warn(f"PEFT export: leaving out the adapters of {len(mtp)} multi-token-prediction layer module(s) "
                      f"({', '.join(mtp[:3])}{', ...' if len(mtp) > 3 else ''}): Transformers' model has no MTP "
                      f"layers; the merged export (scripts/convert.py --merge-lora) keeps them", stacklevel=2)
    r = spec.rank
    weight_of = {f"{m}.weight": m for m in modules if m not in mtp}
    tensors, chosen, fused = {}, {"module": [], "parameter": []}, {}  # fused: gate_up_proj name -> adapted gate/up
    down_adapted = {n for n, (path, _) in targets.items() if n.endswith(".experts.down_proj") and path in weight_of}
    for name, (path, kind) in targets.items():
        m = expert_leaf(path)
        if m and m[1] != "down_proj":  # gate_up_proj: the gate and up adapters of this layer
            parts = [(i, weight_of[f"{m[0]}.{proj}.weight"]) for i, proj in enumerate(("gate_proj", "up_proj"))
                     if f"{m[0]}.{proj}.weight" in weight_of]
            if not parts:
                continue
            fused[name] = len(parts)
            E, F_, D = shapes[path]
            b_parts_ExFxR = [io.materialize(adapters[f"{module}.lora_B"]) for _, module in parts]
            a = torch.cat([io.materialize(adapters[f"{module}.lora_A"]) for _, module in parts], dim=1)  # [E, kr, D]
            b = b_parts_ExFxR[0].new_zeros((E, 2 * F_, len(parts) * r))  # block-diagonal: gate rows, then up rows
            for j, ((i, _), b_ExFxR) in enumerate(zip(parts, b_parts_ExFxR)):
                b[:, i * F_:(i + 1) * F_, j * r:(j + 1) * r] = b_ExFxR
            experts = module_name(cfg, m[0])
            key = f"{_PEFT_PREFIX}{experts}.{'base_layer.' if f'{experts}.down_proj' in down_adapted else ''}"
        elif path in weight_of:
            module = weight_of[path]
            a, b = io.materialize(adapters[f"{module}.lora_A"]), io.materialize(adapters[f"{module}.lora_B"])
            key = f"{_PEFT_PREFIX}{module_name(cfg, m[0] if m else module)}."
        else:
            continue
        chosen[kind].append(name)
        if a.ndim == 3:  # [E, r, in] -> rows e * r + k; [E, out, r] -> columns k * E + e
            a, b = a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)
        tensors[f"{key}lora_A.weight"], tensors[f"{key}lora_B.weight"] = a.contiguous(), b.contiguous()
    if not tensors:
        raise ValueError("no adapters to export: every adapter belongs to a multi-token-prediction layer, which "
                         "Transformers' model does not have; export the merged model (scripts/convert.py "
                         "--merge-lora) instead")
    universe = {kind: {n for n, (_, k) in targets.items() if k == kind} for kind in ("module", "parameter")}
    doubled = _compact([n for n, k in fused.items() if k == 2], {n for n in targets if n.endswith(".gate_up_proj")})
    # GLM-5.3's vision blocks hold mlp.{gate,up,down}_proj too (and PEFT's parameter targets exclude nothing)
    shadowed = tuple(f"mlp.{n}.weight" for n in _MLP_NAMES) if cfg.is_glm53 else ()
    dropout = spec.dropout
    if chosen["parameter"] and dropout:
        warnings.warn(f"PEFT export: lora_dropout {dropout} written as 0: PEFT's parameter adapters (routed experts, "
                      f"MLPs) take no dropout; inference is the same", stacklevel=2)
        dropout = 0.0
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    if base_model_name_or_path is not None and os.path.exists(base_model_name_or_path):
        base_model_name_or_path = os.path.abspath(base_model_name_or_path)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": _compact(chosen["module"], universe["module"]),
        "target_parameters": _compact(chosen["parameter"], universe["parameter"], shadowed) or None,
        "rank_pattern": {re.escape(n): 2 * r for n in doubled},
        "alpha_pattern": {re.escape(n): 2 * alpha for n in doubled},
    }
    return tensors, config


def save_peft(path: str | os.PathLike, cfg: GLM5Config, adapters: dict, spec: LoraSpec, *,
              base_model_name_or_path: str | None = None, write: bool = True,
              flag: str = "--checkpoint.export_peft", extra_files: tuple[str, ...] = (),
              overwrite: bool = False) -> None:
    """Write glm5f LoRA adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(GlmMoeDsaForCausalLM base, path)` loads for the model of `cfg`: attention,
    indexer, dense and shared MLPs and routed experts (see `peft_adapter`). Written into a temporary sibling and
    renamed; `path` must be new, empty or a previous export (check_export_dir), which is replaced. DTensor adapters
    are gathered: every rank calls save_peft, only the one with write=True writes. `extra_files` (the run's
    tokenizer files) are copied in beside them; `overwrite` as save_hf's."""
    path = os.fspath(path).rstrip("/")
    if write:
        check_export_dir(path, flag=flag, writes=tuple(extra_files), overwrite=overwrite)
    tensors, config = peft_adapter(cfg, adapters, spec, base_model_name_or_path)
    if not write:
        return

    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, PEFT_FILES[0]), "w") as f:
            json.dump(config, f, indent=2)
        io.write_safetensors(os.path.join(tmp, PEFT_FILES[1]),
                           [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], iter(tensors.values()))
        for file in extra_files:
            shutil.copyfile(file, os.path.join(tmp, os.path.basename(file)))
        write_marker(tmp)
    write_dir(path, fill)
