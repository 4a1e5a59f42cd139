"""`load_hf`: params from a Transformers checkpoint directory (config.json + safetensors), read tensor by tensor,
only the part of each leaf a rank holds; and the check that what was loaded is finite."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections import defaultdict

import torch

from glm5f.core.config import GLM5Config
from glm5f.ckpt.hf import io
from glm5f.ckpt.hf.fp8 import fp8_scales, read_dequantized
from glm5f.ckpt.hf.keys import load_plan, summarize_keys, text_model_keys
from glm5f.parallel.layout import nonfinite_counts
from glm5f.core.params import MTP_COPIES, Region, abstract_params, flatten, leaf_dtype, region_of, unflatten


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
    inv = io.inventory(io.checkpoint_files(path))
    scales, block = fp8_scales(path, inv)
    inv, _ = text_model_keys(cfg, inv)
    scales = {ours: scales[key] for ours, key in text_model_keys(cfg, {k: k for k in scales})[0].items()}
    L = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers and not any(k.startswith(f"model.layers.{L}.") for k in inv):
        warnings.warn(f"{path}: config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the "
                      f"weights hold no model.layers.{L}.* tensors; loading without the MTP layers",
                      stacklevel=2)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0, mtp_shared_depths=0)
    copies = tuple(name for name in MTP_COPIES if cfg.num_nextn_predict_layers and
                   all(f"model.layers.{L + d}.{name}.weight" in inv for d in range(cfg.num_nextn_predict_layers)))
    plan, mtp = load_plan(cfg, inv, copies)
    if mtp:
        warnings.warn(f"{path}: ignoring {len(mtp)} multi-token-prediction tensors (layers >= "
                      f"num_hidden_layers + num_nextn_predict_layers = {L + cfg.num_nextn_predict_layers}; raise "
                      f"num_nextn_predict_layers in config.json to load them): " + ", ".join(summarize_keys(mtp)),
                      stacklevel=2)
    shapes = flatten(abstract_params(cfg, torch.float32, copies))
    first_dtype = {}
    for key, targets in plan.items():
        for target_path, _, _ in targets:
            first_dtype.setdefault(target_path, torch.float32 if key in scales else
                                   io.DTYPES.get(inv[key][2], torch.float32))
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
                            read_dequantized(f, shape, io.DTYPES[dt], begin, part + full[len(part):], scales[key],
                                              block, dest, files)
                        else:
                            io.read_part(f, shape, io.DTYPES[dt], begin, part + full[len(part):], dest)
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

