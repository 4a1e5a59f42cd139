"""Transformers checkpoints both ways: `load_hf` (config.json + safetensors, read tensor by tensor) and `save_hf`.

The only place that maps our parameter paths to checkpoint keys: they are equal, except that our stacked routed
experts `mlp.experts.{gate,up,down}_proj.weight` [E, ...] are written per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, the GLM-5 release layout) and read from that layout or from the
fused one (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]). Block-quantized FP8
checkpoints (e4m3 `weight` + fp32 `weight_scale_inv` per block) are dequantized as they are read. LoRA adapters
are written in PEFT's adapter format (`save_peft`), keyed as PEFT keys them on Transformers' modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections import defaultdict

import torch

from glm5f.config import GLM5Config, read_json
from glm5f.lora import NOT_ADAPTABLE, LoraSpec
from glm5f.parallel import full_tensor, nonfinite_counts
from glm5f.params import (MTP_COPIES, Region, abstract_params, describe_mismatch, flatten, leaf_dtype, leaf_kind,
                          region_of, unflatten)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_HF_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # Transformers' names (GLM-5.3's too)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (sharded via model.safetensors.index.json, or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "a safetensors index with a 'weight_map'").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are not there: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}: expected a Transformers checkpoint directory")
    return [os.path.join(path, f) for f in files]


def _inventory(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str, int]]:
    """{key: (file, shape, dtype string, byte offset of its data in the file)} from the safetensors headers only."""
    inv = {}
    for fn in files:
        header, start = _read_header(fn)
        for k, h in header.items():
            if k in inv:
                raise ValueError(f"tensor {k!r} appears in both {inv[k][0]} and {fn}")
            inv[k] = (fn, tuple(h["shape"]), h["dtype"], start + h["data_offsets"][0])
    return inv


# ---- safetensors files, read and written with plain file I/O ---------------------------------------------------
# (not memory-mapped: a rank loading its shards brings only their bytes into its memory, and export writes a
# file tensor by tensor; the format is an 8-byte header length, a JSON header, then the tensors' bytes)

def _read_header(fn: str) -> tuple[dict, int]:
    """A safetensors file's header {key: {"dtype", "shape", "data_offsets"}} and the byte its data starts at."""
    try:
        with open(fn, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(os.path.getsize(fn) - 8, 1 << 30):
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for k, h in header.items():
            if h["dtype"] not in _DTYPES:
                raise ValueError(f"tensor {k!r} has dtype {h['dtype']}, which glm5f does not read")
            h["shape"], h["data_offsets"] = [int(d) for d in h["shape"]], [int(o) for o in h["data_offsets"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{fn}: not a readable safetensors file ({e}); re-export or re-download it") from None
    return header, 8 + n


def _read_part(f, shape: tuple[int, ...], dtype: torch.dtype, begin: int, part: tuple[slice, ...],
               dest: torch.Tensor) -> None:
    """Copy the part (one [start, stop) slice per dim) of the row-major tensor at byte `begin` of the open file f
    into dest: one read per contiguous run of its bytes, straight into dest where its dtype and layout allow."""
    direct = dest.dtype == dtype and dest.is_contiguous() and dest.device.type == "cpu"
    out = dest if direct else torch.empty([sl.stop - sl.start for sl in part], dtype=dtype)
    _read_into(f, shape, begin, part, out)
    if not direct:
        dest.copy_(out)


def _read_into(f, shape: tuple[int, ...], begin: int, part: tuple[slice, ...], out: torch.Tensor) -> None:
    """`_read_part` into a contiguous CPU tensor of the file's dtype."""
    if out.numel() == 0:
        return
    flat = out.reshape(-1).view(torch.uint8).numpy()
    if not shape:
        runs, size = [0], out.element_size()
    else:
        k = len(shape)  # dims k.. are whole: each index of dims < k - 1 is one run over dim k - 1's slice
        while k > 1 and (part[k - 1].start, part[k - 1].stop) == (0, shape[k - 1]):
            k -= 1
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        size = (part[k - 1].stop - part[k - 1].start) * strides[k - 1] * out.element_size()
        runs = [sum(i * strides[d] for d, i in enumerate(idx)) + part[k - 1].start * strides[k - 1]
                for idx in itertools.product(*(range(sl.start, sl.stop) for sl in part[:k - 1]))]
    for n, offset in enumerate(runs):
        f.seek(begin + offset * out.element_size())
        if f.readinto(memoryview(flat)[n * size:(n + 1) * size]) != size:
            raise ValueError(f"{f.name}: the file ends inside a tensor (truncated); re-export or re-download it")


def _write_safetensors(fn: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]], tensors) -> None:
    """Write a safetensors file of `entries` (key, shape, dtype), taking each tensor from the iterator `tensors`
    as its bytes are due (one at a time in memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, dt in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        header[key] = {"dtype": _DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(fn, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for (key, shape, dt), t in zip(entries, tensors):
            assert tuple(t.shape) == tuple(shape) and t.dtype == dt, (key, t.shape, t.dtype)
            if t.numel():
                f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))


def _plan(cfg: GLM5Config, inv: dict, copies: tuple[str, ...] = ()) -> tuple[dict[str, list], list[str]]:
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
        m = _expert_leaf(path)
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
        layer = _LAYER_KEY.match(key)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            mtp.append(key)
        else:
            unexpected.append(key)
    if missing or unexpected or wrong:
        raise ValueError("checkpoint does not match its config.json:\n" +
                         describe_mismatch(sorted(missing), sorted(unexpected), sorted(wrong)) +
                         "\nNothing was loaded. Check that config.json belongs to these weights.")
    return plan, sorted(mtp)


SCALE_SUFFIX = "_scale_inv"  # `….weight_scale_inv`: the per-block scales of the FP8 tensor `….weight`
_FP8 = ("F8_E4M3", "F8_E5M2")


def _fp8_scales(path: str, inv: dict) -> tuple[dict[str, tuple], tuple[int, int] | None]:
    """The scales of a block-quantized FP8 checkpoint, taken out of `inv`: ({weight key: the inventory entry of
    its weight_scale_inv}, config.json's quantization_config weight_block_size), or ({}, None) without FP8. A
    scale must be [..., ceil(rows / block rows), ceil(cols / block cols)] of its weight; an FP8 weight without a
    scale, a scale without its weight, or one the config says is not converted is a ValueError naming the key."""
    scale_keys = [k for k in inv if k.endswith(SCALE_SUFFIX)]
    fp8_keys = [k for k, entry in inv.items() if entry[2] in _FP8]
    if not scale_keys and not fp8_keys:
        return {}, None
    q = read_json(os.path.join(path, "config.json"), "a Transformers config.json").get("quantization_config") or {}
    q = q if isinstance(q, dict) else {}
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{path}: the checkpoint holds FP8 tensors ({(fp8_keys or scale_keys)[0]}, ...) but "
                         f"config.json has no quantization_config.weight_block_size [rows, cols] (found {block!r}); "
                         f"add the block size it was quantized with, e.g. [128, 128]")
    skip = [m for m in q.get("modules_to_not_convert") or [] if isinstance(m, str)]
    scales = {}
    for key in scale_keys:
        weight = key[:-len(SCALE_SUFFIX)]
        entry = inv.pop(key)
        if weight not in inv:
            raise ValueError(f"{path}: {key} has no FP8 weight {weight} beside it; the checkpoint is incomplete")
        shape = inv[weight][1]
        want = tuple(shape[:-2]) + tuple(-(-n // b) for n, b in zip(shape[-2:], block)) if len(shape) >= 2 else None
        if inv[weight][2] not in _FP8:
            raise ValueError(f"{path}: {key} scales {weight}, which is {inv[weight][2]}, not FP8; remove the scale "
                             f"or re-export the checkpoint")
        if want is None or entry[1] != want or entry[2] not in ("F32", "BF16", "F16"):
            raise ValueError(f"{path}: {key} is {entry[2]} {list(entry[1])}; expected a float tensor of shape "
                             f"{list(want) if want else '[..., rows/block, cols/block]'} (one scale per "
                             f"{block[0]}x{block[1]} block of {weight} {list(shape)}); re-export the checkpoint")
        if any(weight == m or weight.startswith(m + ".") or f".{m}." in f".{weight}" for m in skip):
            raise ValueError(f"{path}: {weight} is FP8 but quantization_config.modules_to_not_convert lists it; "
                             f"the config does not belong to these weights")
        scales[weight] = entry
    unscaled = [k for k in fp8_keys if k not in scales]
    if unscaled:
        raise ValueError(f"{path}: FP8 tensor {unscaled[0]} has no {unscaled[0]}{SCALE_SUFFIX} "
                         f"({len(unscaled)} such); glm5f reads block-quantized FP8 checkpoints only")
    return scales, tuple(block)


def _read_dequantized(f, shape: tuple[int, ...], dtype: torch.dtype, begin: int, part: tuple[slice, ...],
                      scale, block: tuple[int, int], dest: torch.Tensor, files: dict) -> None:
    """`_read_part` of an FP8 tensor, as fp8.float() * its block's scale: reads only the part's FP8 bytes and the
    scales of the blocks it touches (`scale`: the scale's inventory entry; `files`: open files by name)."""
    if dest.numel() == 0:
        return
    q = torch.empty([sl.stop - sl.start for sl in part], dtype=dtype)
    _read_into(f, shape, begin, part, q)
    (rows, cols), (br, bc) = part[-2:], block
    blocks = (slice(rows.start // br, -(-rows.stop // br)), slice(cols.start // bc, -(-cols.stop // bc)))
    fn, scale_shape, scale_dt, scale_begin = scale
    s = torch.empty([sl.stop - sl.start for sl in part[:-2] + blocks], dtype=_DTYPES[scale_dt])
    if fn not in files:
        files[fn] = open(fn, "rb")
    _read_into(files[fn], scale_shape, scale_begin, part[:-2] + blocks, s)
    s = s.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    r0, c0 = rows.start - blocks[0].start * br, cols.start - blocks[1].start * bc
    dest.copy_(q.float() * s[..., r0:r0 + rows.stop - rows.start, c0:c0 + cols.stop - cols.start])


def _summarize_keys(keys: list[str]) -> list[str]:
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


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
            region: Region | None = None) -> tuple[GLM5Config, dict]:
    """(cfg, params) from a Transformers GLM-5 checkpoint directory, or a GLM-5.3 one (Glm5NextForConditionalGeneration:
    its text model; the vision tower's and the MTP layer's tensors are left where they are, see `save_hf`).

    Reads the safetensors headers first and checks every key and shape (one error lists all problems; nothing is
    loaded then), then copies tensor by tensor into the params tree. dtype: None keeps the checkpoint's dtypes;
    the router and indexer head weights stay fp32 either way. `region(path, shape)`, if given, names the part of
    each leaf to load (one slice per dim: a rank's shard, see `Layout.local_params`): only those slices are read
    from the files (and of per-expert tensors only the experts in it), and each leaf holds only its part.

    The num_nextn_predict_layers multi-token-prediction layers (model.layers.{num_hidden_layers + d}.*) are read
    when the checkpoint has them, with the layer's own embedding / head copies where present (kept as leaves
    of their own, see params.MTP_COPIES); a checkpoint without any (Transformers' save_pretrained drops them)
    loads without MTP (num_nextn_predict_layers 0, with a warning). Layers past those are ignored, with a warning.

    A block-quantized FP8 checkpoint (float8_e4m3fn `….weight` with `….weight_scale_inv` [ceil(rows / 128),
    ceil(cols / 128)] and config.json's quantization_config.weight_block_size) is dequantized as it is read,
    weight = fp8.float() * the scale of its block, only the blocks of the region (fp32 unless `dtype` says
    otherwise), with one warning saying so; save_hf then writes plain weights.
    """
    path = os.fspath(path)
    cfg = GLM5Config.from_hf(path)
    inv = _inventory(checkpoint_files(path))
    scales, block = _fp8_scales(path, inv)
    inv, _ = _text_model_keys(cfg, inv)
    scales = {ours: scales[key] for ours, key in _text_model_keys(cfg, {k: k for k in scales})[0].items()}
    L = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers and not any(k.startswith(f"model.layers.{L}.") for k in inv):
        warnings.warn(f"{path}: config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the "
                      f"weights hold no model.layers.{L}.* tensors; loading without the MTP layers",
                      stacklevel=2)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0, mtp_shared_depths=0)
    copies = tuple(name for name in MTP_COPIES if cfg.num_nextn_predict_layers and
                   all(f"model.layers.{L + d}.{name}.weight" in inv for d in range(cfg.num_nextn_predict_layers)))
    plan, mtp = _plan(cfg, inv, copies)
    if mtp:
        warnings.warn(f"{path}: ignoring {len(mtp)} multi-token-prediction tensors (layers >= "
                      f"num_hidden_layers + num_nextn_predict_layers = {L + cfg.num_nextn_predict_layers}; raise "
                      f"num_nextn_predict_layers in config.json to load them): " + ", ".join(_summarize_keys(mtp)),
                      stacklevel=2)
    shapes = flatten(abstract_params(cfg, torch.float32, copies))
    first_dtype = {}
    for key, targets in plan.items():
        for target_path, _, _ in targets:
            first_dtype.setdefault(target_path, torch.float32 if key in scales else
                                   _DTYPES.get(inv[key][2], torch.float32))
    where = {p: region_of(region, p, tuple(t.shape)) for p, t in shapes.items()}  # each leaf's part to load
    flat = {p: torch.empty([s.stop - s.start for s in where[p]], dtype=leaf_dtype(p, dtype or first_dtype[p]),
                           device=device) for p in shapes}
    by_file = defaultdict(list)
    for key in plan:
        by_file[inv[key][0]].append(key)
    files = {}  # the files scales are read from, kept open
    with torch.no_grad(), contextlib.ExitStack() as stack:
        stack.callback(lambda: [g.close() for g in files.values()])
        for fn, keys in by_file.items():
            with open(fn, "rb") as f:
                for key in keys:
                    _, shape, dt, begin = inv[key]
                    for target_path, expert, rows in plan[key]:
                        dest, part = flat[target_path], where[target_path]
                        if expert is not None:  # one expert's tensor: the part past the expert dim, if ours
                            if not part[0].start <= expert < part[0].stop:
                                continue
                            dest, part = dest[expert - part[0].start], part[1:]
                        elif rows is not None:  # gate or up rows of a fused gate_up_proj [E, 2F, D]
                            part = (part[0], slice(rows.start + part[1].start, rows.start + part[1].stop), *part[2:])
                        full = tuple(slice(0, n) for n in shape)
                        if key in scales:
                            _read_dequantized(f, shape, _DTYPES[dt], begin, part + full[len(part):], scales[key],
                                              block, dest, files)
                        else:
                            _read_part(f, shape, _DTYPES[dt], begin, part + full[len(part):], dest)
    if scales:
        warnings.warn(f"{path}: an FP8 checkpoint ({len(scales)} weights quantized in {block[0]}x{block[1]} "
                      f"blocks): dequantized on load (weight = fp8 x its block's scale)", stacklevel=2)
    return cfg, unflatten(flat, abstract_params(cfg, torch.float32, copies))


def check_loaded_finite(params: dict, source: str, total=lambda t: t) -> None:
    """A ValueError naming the tensors of loaded `params` (from checkpoint `source`) that hold NaN or inf: training
    from them cannot work, whatever the learning rate. `total` sums a count over ranks (Layout.sum), so each
    rank checks its own shards and all agree."""
    bad = [f"{p} ({n} values)" for p, n in nonfinite_counts(params, total).items()]
    if bad:
        raise ValueError(f"--model.init_from {source}: the loaded checkpoint holds NaN/inf in {len(bad)} "
                         f"tensor(s): {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}; it is damaged or was "
                         f"saved from a diverged run: load another checkpoint")


def hf_state_dict(params: dict, *, fused_experts: bool = False, cfg: GLM5Config | None = None
                  ) -> dict[str, torch.Tensor]:
    """Our params as checkpoint tensors: per expert (default), or fused as Transformers holds them in memory.

    The per-expert tensors are views of the stacked leaves; differentiable, so a Transformers module driven by
    `torch.func.functional_call(model, hf_state_dict(params, fused_experts=True), ...)` yields gradients for our
    leaves. For GLM-5.3 (`cfg`), the keys are those of Glm5NextForConditionalGeneration: the text model's under
    model.language_model, and with fused_experts its in-memory names (`_glm53_in_memory`).
    """
    if cfg is not None and cfg.is_glm53:
        out = {_checkpoint_key(cfg, k): t for k, t in hf_state_dict(params, fused_experts=fused_experts).items()}
        return _glm53_in_memory(out) if fused_experts else out
    out = {}
    for path, t in flatten(params).items():
        m = _expert_leaf(path)
        if not fused_experts or not m:
            out.update((key, t if e is None else t[e]) for key, e in _hf_keys(path, tuple(t.shape)))
            continue
        prefix, proj = m
        if proj == "down_proj":
            out[f"{prefix}.down_proj"] = t
        elif proj == "up_proj":
            out[f"{prefix}.gate_up_proj"] = torch.cat([out.pop(f"{prefix}.gate_proj"), t], dim=1)
        else:
            out[f"{prefix}.gate_proj"] = t  # joined with up_proj (which follows in tree order)
    return out


# ---- GLM-5.3 (Glm5NextForConditionalGeneration) ---------------------------------------------------------------
# Our paths are the text model's checkpoint keys without its `language_model.` level: `model.layers.3.hc_attn_fn`
# is the checkpoint's `model.language_model.layers.3.hc_attn_fn` (`lm_head.weight` is the same). The checkpoint's
# other tensors (the vision tower `model.visual.*`, the MTP layer `model.language_model.layers.{L}.*`, which
# Transformers has no forward for) are not trained here; save_hf copies them from its `source` checkpoint.
_GLM53_TEXT = "model.language_model."
_GLM53_RENAMES = [(re.compile(a), b) for a, b in [  # checkpoint key -> Transformers' parameter (its conversion)
    (r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b", r".self_attn.forget_gate.\1"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
]]


def _checkpoint_key(cfg: GLM5Config, path: str) -> str:
    """The checkpoint key of our path `path` (GLM-5: the same)."""
    if cfg.is_glm53 and path.startswith("model."):
        return _GLM53_TEXT + path[len("model."):]
    return path


def _text_model_keys(cfg: GLM5Config, inv: dict) -> tuple[dict, list[str]]:
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
        for pattern, repl in _GLM53_RENAMES:
            key = pattern.sub(repl, key)
        out[key] = t
    return out


EXPORT_MARKER = ".glm5f-export"  # JSON: {"files": the names glm5f wrote, "bases_of": runs that start from it}
TOKEN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _is_export(path: str) -> bool:
    """Whether `path` holds a previous save_hf / save_peft export: our marker, or exactly config.json + safetensors
    (+ index), or exactly a PEFT adapter's two files."""
    names = set(os.listdir(path))
    if EXPORT_MARKER in names or names == set(PEFT_FILES):
        return True
    shards = {n for n in names if n.startswith("model") and n.endswith(".safetensors")}
    return "config.json" in names and bool(shards) and names - shards <= {"config.json", "model.safetensors.index.json"}


def read_marker(path: str) -> dict:
    """What the export marker in `path` says ({} without one, or for one written before markers listed files)."""
    try:
        with open(os.path.join(path, EXPORT_MARKER), encoding="utf-8") as f:
            marker = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _written_by_us(path: str, names: set[str]) -> set[str]:
    """The files of export `path` glm5f wrote: those its marker lists; for an export without that list, the
    weights, config and PEFT files an export is recognised by."""
    listed = read_marker(path).get("files")
    if isinstance(listed, list):
        return set(listed) | {EXPORT_MARKER}
    return {n for n in names if n in ("config.json", "model.safetensors.index.json", EXPORT_MARKER, *PEFT_FILES)
            or (n.startswith("model") and n.endswith(".safetensors"))}


def note_base(path: str, run_dir: str) -> None:
    """Record in export `path`'s marker that the run in `run_dir` starts from it (--model.init_from), so a later
    export into `path` is refused without consent. Nothing for a directory glm5f did not export, or one it
    cannot write."""
    if not os.path.isfile(os.path.join(path, EXPORT_MARKER)):
        return
    marker = read_marker(path)
    bases_of = marker.get("bases_of") if isinstance(marker.get("bases_of"), list) else []
    run = os.path.realpath(run_dir)
    if run in bases_of:
        return
    try:
        with open(os.path.join(path, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump({**marker, "bases_of": bases_of + [run]}, f, indent=2)
    except OSError:
        pass


def check_export_dir(path: str | os.PathLike, run_dir: str | os.PathLike | None = None, *,
                     flag: str = "--checkpoint.export_hf", init_from: str | None = None, writes: tuple = (),
                     overwrite: bool = False, consent: str = "--checkpoint.replace_export") -> None:
    """Raise ValueError unless save_hf / save_peft may write `path`: new, empty, or a previous export of ours (which
    it replaces). Never the run directory `run_dir` or a directory that contains it, nor the run's base
    `init_from`; never one holding files glm5f did not write (they would be deleted with it). Without `overwrite`
    (the option `consent` names), not an export another run starts from, nor one whose tokenizer files the new
    export (its extra files `writes`) does not write. `flag` names the option."""
    path = os.path.realpath(os.fspath(path))
    if run_dir is not None:
        run = os.path.realpath(os.fspath(run_dir))
        if run == path or run.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{flag} {path} is or contains the run directory {run}; export to "
                             f"a directory of its own, e.g. {os.path.join(run, 'hf')}")
    if init_from is not None and os.path.realpath(init_from) == path:
        raise ValueError(f"{flag} {path} is this run's --model.init_from: exporting there would replace the base "
                         f"the run starts from (and its checkpoints rest on); export to another directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"export directory {path} is a file; pass a new or empty directory")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    names = set(os.listdir(path))
    if not _is_export(path):
        raise ValueError(f"export directory {path} holds files that are not a previous glm5f export "
                         f"({', '.join(sorted(names)[:5])}); pass a new or empty directory, or remove them")
    foreign = sorted(names - _written_by_us(path, names))
    if foreign:
        raise ValueError(f"export directory {path} is a previous glm5f export but also holds files glm5f did not "
                         f"write there ({', '.join(foreign[:5])}), which replacing it would delete; move them away "
                         f"or pass another directory")
    if overwrite:
        return
    users = [r for r in read_marker(path).get("bases_of") or [] if isinstance(r, str) and os.path.isdir(r)]
    if users:
        raise ValueError(f"export directory {path} is the --model.init_from base of the run(s) {', '.join(users)}: "
                         f"replacing it would change the base their checkpoints (and a LoRA run's --merge-lora) "
                         f"rest on; export to another directory, or pass {consent} to replace it")
    lost = sorted(names & set(TOKEN_FILES) - {os.path.basename(f) for f in writes})
    if lost:
        raise ValueError(f"export directory {path} holds tokenizer files ({', '.join(lost)}) that this export "
                         f"does not write (it has another tokenizer or none); export to another directory, or pass "
                         f"{consent} to replace them")


def save_hf(path: str | os.PathLike, cfg: GLM5Config, params: dict, *, max_shard_bytes: int = 5 << 30,
            write: bool = True, extra_files: tuple[str, ...] = (), source: str | os.PathLike | None = None,
            overwrite: bool = False) -> None:
    """Write a Transformers checkpoint directory (config.json + safetensors, per-expert keys, sharded with an
    index above `max_shard_bytes`). Written into a temporary sibling and renamed, so `path` never holds half a
    checkpoint. `path` must be new, empty or a previous export (check_export_dir); that one is replaced.

    Leaves are gathered one at a time (DTensor leaves of a sharded run: every rank calls save_hf, in the same
    order, and only the one with write=True checks `path` and writes), so no rank holds more than one full leaf
    and one shard file's tensors. `extra_files` (e.g. the run's tokenizer.json) are copied in beside them. The
    directory gets the user's umask's permissions (not mkdtemp's 0700); its marker lists the files written.
    `overwrite`: replace an export another run starts from (see check_export_dir).

    GLM-5.3: a Glm5NextForConditionalGeneration checkpoint. With `source` (the checkpoint the params were loaded
    from), its tensors that are not the text model's (the vision tower, the MTP layer) are copied unchanged and
    its config.json kept with our text_config in place of its own; without, config.json holds the text_config only
    (Transformers then makes a vision tower of its default config). A block-quantized FP8 source's copied tensors
    are written dequantized (fp8 x its block's scale, in the params' widest dtype, no `weight_scale_inv`), as
    its text model was loaded, and config.json loses its quantization_config: the export is one unquantized
    checkpoint.
    """
    path = os.fspath(path).rstrip("/")
    if write:
        check_export_dir(path, writes=tuple(extra_files), overwrite=overwrite)
    flat = flatten(params)
    # (checkpoint key, our leaf, expert index or None, the key's shape), in the order they are written
    entries = [(_checkpoint_key(cfg, key), leaf, e, tuple(t.shape[1:] if e is not None else t.shape))
               for leaf, t in flat.items() for key, e in _hf_keys(leaf, tuple(t.shape))]
    widest = max({t.dtype for t in flat.values()}, key=lambda d: torch.finfo(d).bits)  # config.json's dtype
    source_cfg, quantized = None, False
    if source is not None and cfg.is_glm53:
        source_cfg = read_json(os.path.join(source, "config.json"), "a Transformers config.json")
        src = _inventory(checkpoint_files(os.fspath(source)))
        scales, block = _fp8_scales(os.fspath(source), src)  # takes the scales out of src
        quantized = bool(scales)
        # a carried tensor is a "leaf" of (file, dtype, byte offset); an FP8 one's also (its scale, the block),
        # read dequantized into `widest`, as load_hf reads the text model's
        for key in _text_model_keys(cfg, src)[1]:
            fn, shape, dt, begin = src[key]
            carried = (fn, widest, begin, _DTYPES[dt], scales[key], block) if key in scales else \
                (fn, _DTYPES[dt], begin)
            entries.append((key, carried, None, shape))

    def dtype_of(entry) -> torch.dtype:
        return entry[1][1] if isinstance(entry[1], tuple) else flat[entry[1]].dtype

    def nbytes(entry) -> int:
        return math.prod(entry[3]) * torch.empty((), dtype=dtype_of(entry)).element_size()

    shards, current, size = [], [], 0
    for entry in entries:
        if current and size + nbytes(entry) > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes(entry)
    shards.append(current)
    held = {"leaf": None, "t": None}  # the one leaf gathered now

    def tensor(key, leaf, e, shape):
        if isinstance(leaf, tuple):  # a tensor copied from the source checkpoint
            fn, dt, begin, *fp8 = leaf
            out = torch.empty(shape, dtype=torch.float32 if fp8 else dt)
            whole = tuple(slice(0, n) for n in shape)
            with open(fn, "rb") as f:
                if fp8:
                    files = {}
                    try:
                        _read_dequantized(f, shape, fp8[0], begin, whole, fp8[1], fp8[2], out, files)
                    finally:
                        for handle in files.values():
                            handle.close()
                else:
                    _read_into(f, shape, begin, whole, out)
            return out.to(dt)
        if held["leaf"] != leaf:
            held.update(leaf=leaf, t=None)
            held["t"] = _materialize(flat[leaf])
        return held["t"] if e is None else held["t"][e]

    if not write:  # take part in every gather, in the writer's order
        for shard in shards:
            for entry in shard:
                if not isinstance(entry[1], tuple):
                    tensor(*entry)
        return

    def fill(tmp: str) -> None:
        for file in extra_files:
            shutil.copyfile(file, os.path.join(tmp, os.path.basename(file)))
        hf_cfg = cfg.to_hf()
        if source_cfg is not None:  # its vision_config and token ids, our text_config
            hf_cfg = {**source_cfg, **hf_cfg}
        if quantized:  # every tensor is written dequantized
            hf_cfg.pop("quantization_config", None)
        hf_cfg["dtype"] = str(widest).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        for name, shard in zip(names, shards):
            _write_safetensors(os.path.join(tmp, name), [(e[0], e[3], dtype_of(e)) for e in shard],
                               (tensor(*entry) for entry in shard))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(nbytes(entry) for entry in entries)},
                     "weight_map": {entry[0]: n for n, shard in zip(names, shards) for entry in shard}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        _write_marker(tmp)
    _write_dir(path, fill)


def _write_marker(tmp: str) -> None:
    """The export marker of a directory just written: the names of the files in it (all glm5f's)."""
    files = sorted(os.listdir(tmp) + [EXPORT_MARKER])
    with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=2)


def _write_dir(path: str, fill) -> None:
    """Let fill(tmp) write a temporary sibling of `path`, then put it in `path`'s place (replacing what is there),
    so `path` never holds half an export; on an error the sibling is removed and `path` is untouched. The
    directory gets the user's umask's permissions (not mkdtemp's 0700)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        fill(tmp)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
            os.replace(path, os.path.join(old, "x"))
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _expert_leaf(path: str) -> tuple[str, str] | None:
    """(prefix "….mlp.experts", projection name) of a stacked routed-expert leaf (LEAF_KINDS axes "experts", ...)."""
    if leaf_kind(path).axes[0] != "experts":
        return None
    prefix, proj, _ = path.rsplit(".", 2)
    return prefix, proj


def _hf_keys(path: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The checkpoint keys of one of our leaves, each with its expert index (None: the whole leaf)."""
    m = _expert_leaf(path)
    if not m:
        return [(path, None)]
    prefix, proj = m
    return [(f"{prefix}.{e}.{proj}.weight", e) for e in range(shape[0])]


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """A leaf's whole value, detached, on the CPU, contiguous (a DTensor leaf is gathered)."""
    return full_tensor(t).detach().to("cpu").contiguous()


# ---- LoRA adapters in PEFT's format ----------------------------------------------------------------------------
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

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
_PEFT_PREFIX = "base_model.model."
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _module_name(cfg: GLM5Config, path: str) -> str:
    """The name Transformers' model of `cfg` gives our module (or parameter) path `path`: GLM-5's is the same;
    GLM-5.3's lies under model.language_model, the forget gate's projections under `forget_gate`."""
    if not cfg.is_glm53:
        return path
    path = _checkpoint_key(cfg, path)
    for pattern, repl in _GLM53_RENAMES:
        path = pattern.sub(repl, path)
    return path


def _peft_targets(cfg: GLM5Config) -> dict[str, tuple[str, str]]:
    """{Transformers module or parameter name: (glm5f weight path, "module" | "parameter")} for every weight PEFT
    can adapt in Transformers' model of `cfg` (routed experts: `….experts.gate_up_proj` and `….experts.down_proj`,
    both naming the gate leaf's path's prefix; MTP layers are not in Transformers' model; nor are the KDA short
    convolutions, which are no linear maps, `lora.NOT_ADAPTABLE`)."""
    out = {}
    for path, t in flatten(abstract_params(cfg, torch.float32)).items():
        module, _, name = path.rpartition(".")
        layer = _LAYER_KEY.match(path)
        if name != "weight" or t.ndim not in (2, 3) or (layer and int(layer.group(1)) >= cfg.num_hidden_layers) or \
                NOT_ADAPTABLE.search(module):
            continue
        m = _expert_leaf(path)
        if m:
            out[_module_name(cfg, f"{m[0]}.{'down_proj' if m[1] == 'down_proj' else 'gate_up_proj'}")] = \
                (path, "parameter")
        elif module.rpartition(".")[2] in _MLP_NAMES:
            out[_module_name(cfg, path)] = (path, "parameter")
        else:
            out[_module_name(cfg, module)] = (path, "module")
    return out


def _compact(names: list[str], universe: set[str], shadowed: tuple[str, ...] = ()) -> list[str]:
    """`names` as PEFT matches them (a name selects every module or parameter that ends with "." + it): one
    layer-free suffix (`self_attn.q_a_proj`) for a name adapted in every layer that has it, else the full names
    (always for the suffixes in `shadowed`, which other modules of Transformers' model end with too)."""
    by_suffix: dict[str, set[str]] = defaultdict(set)
    for n in universe:
        m = _HF_LAYER_KEY.match(n)
        by_suffix[n[m.end():] if m else n].add(n)
    out = []
    for suffix, members in sorted(by_suffix.items()):
        chosen = members & set(names)
        if chosen == members and _HF_LAYER_KEY.match(next(iter(members))) and suffix not in shadowed:
            out.append(suffix)
        else:
            out.extend(sorted(chosen))
    return out


def peft_adapter(cfg: GLM5Config, adapters: dict, spec: LoraSpec, base_model_name_or_path: str | None = None,
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors keyed as PEFT saves them, adapter_config.json) of glm5f adapters (`glm5f.lora`: {"<module>.lora_A":
    [r, in] or [E, r, in], "<module>.lora_B": [out, r] or [E, out, r]}, scale spec.alpha / spec.rank) for
    Transformers' GlmMoeDsaForCausalLM of `cfg`; tensors keep the adapters' dtypes. Adapters of the MTP layers,
    which Transformers' model does not have, are left out with a warning (the merged export keeps them). A
    ValueError names adapters that do not fit `cfg` or `spec`."""
    targets = _peft_targets(cfg)
    shapes = {p: tuple(t.shape) for p, t in flatten(abstract_params(cfg, torch.float32)).items()}
    modules = list(dict.fromkeys(k.rpartition(".")[0] for k in adapters))
    bad, mtp = [], []
    for module in modules:
        a, b = adapters.get(f"{module}.lora_A"), adapters.get(f"{module}.lora_B")
        w = shapes.get(f"{module}.weight")
        layer = _LAYER_KEY.match(module + ".")
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
        m = _expert_leaf(path)
        if m and m[1] != "down_proj":  # gate_up_proj: the gate and up adapters of this layer
            parts = [(i, weight_of[f"{m[0]}.{proj}.weight"]) for i, proj in enumerate(("gate_proj", "up_proj"))
                     if f"{m[0]}.{proj}.weight" in weight_of]
            if not parts:
                continue
            fused[name] = len(parts)
            E, F_, D = shapes[path]
            b_parts_ExFxR = [_materialize(adapters[f"{module}.lora_B"]) for _, module in parts]
            a = torch.cat([_materialize(adapters[f"{module}.lora_A"]) for _, module in parts], dim=1)  # [E, kr, D]
            b = b_parts_ExFxR[0].new_zeros((E, 2 * F_, len(parts) * r))  # block-diagonal: gate rows, then up rows
            for j, ((i, _), b_ExFxR) in enumerate(zip(parts, b_parts_ExFxR)):
                b[:, i * F_:(i + 1) * F_, j * r:(j + 1) * r] = b_ExFxR
            experts = _module_name(cfg, m[0])
            key = f"{_PEFT_PREFIX}{experts}.{'base_layer.' if f'{experts}.down_proj' in down_adapted else ''}"
        elif path in weight_of:
            module = weight_of[path]
            a, b = _materialize(adapters[f"{module}.lora_A"]), _materialize(adapters[f"{module}.lora_B"])
            key = f"{_PEFT_PREFIX}{_module_name(cfg, m[0] if m else module)}."
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
        _write_safetensors(os.path.join(tmp, PEFT_FILES[1]),
                           [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], iter(tensors.values()))
        for file in extra_files:
            shutil.copyfile(file, os.path.join(tmp, os.path.basename(file)))
        _write_marker(tmp)
    _write_dir(path, fill)
