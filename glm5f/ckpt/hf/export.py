"""`save_hf`: params as a Transformers checkpoint directory (config.json + safetensors shards, a GLM-5.3 source's
vision tower and MTP layer carried along), and `export_run`, the one way a run's weights are exported."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import torch

from glm5f.core.config import GLM5Config, read_json
from glm5f.ckpt.hf import io
from glm5f.ckpt.hf.export_dir import check_export_dir, write_dir, write_marker
from glm5f.ckpt.hf.fp8 import fp8_scales, read_dequantized
from glm5f.ckpt.hf.keys import checkpoint_key, hf_keys, text_model_keys
from glm5f.core.params import flatten


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
    entries = [(checkpoint_key(cfg, key), leaf, e, tuple(t.shape[1:] if e is not None else t.shape))
               for leaf, t in flat.items() for key, e in hf_keys(leaf, tuple(t.shape))]
    widest = max({t.dtype for t in flat.values()}, key=lambda d: torch.finfo(d).bits)  # config.json's dtype
    source_cfg, quantized = None, False
    if source is not None and cfg.is_glm53:
        source_cfg = read_json(os.path.join(source, "config.json"), "a Transformers config.json")
        src = io.inventory(io.checkpoint_files(os.fspath(source)))
        scales, block = fp8_scales(os.fspath(source), src)  # takes the scales out of src
        quantized = bool(scales)
        # a carried tensor is a "leaf" of (file, dtype, byte offset); an FP8 one's also (its scale, the block),
        # read dequantized into `widest`, as load_hf reads the text model's
        for key in text_model_keys(cfg, src)[1]:
            fn, shape, dt, begin = src[key]
            carried = (fn, widest, begin, io.DTYPES[dt], scales[key], block) if key in scales else \
                (fn, io.DTYPES[dt], begin)
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
                        read_dequantized(f, shape, fp8[0], begin, whole, fp8[1], fp8[2], out, files)
                    finally:
                        for handle in files.values():
                            handle.close()
                else:
                    io.read_into(f, shape, begin, whole, out)
            return out.to(dt)
        if held["leaf"] != leaf:
            held.update(leaf=leaf, t=None)
            held["t"] = io.materialize(flat[leaf])
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
            io.write_safetensors(os.path.join(tmp, name), [(e[0], e[3], dtype_of(e)) for e in shard],
                               (tensor(*entry) for entry in shard))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(nbytes(entry) for entry in entries)},
                     "weight_map": {entry[0]: n for n, shard in zip(names, shards) for entry in shard}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        write_marker(tmp)
    write_dir(path, fill)



def export_run(path: str | os.PathLike, cfg: GLM5Config, weights: dict, *, init_from: str | None,
               token_ids: dict[str, int | None], token_files: tuple[str, ...] = (), write: bool = True,
               overwrite: bool = False) -> None:
    """Write a run's weights (a LoRA run's merged into its base) as a Transformers checkpoint: what train.py's
    --checkpoint.export_hf and scripts/convert.py (--merge-lora too) write, the same for the same run.

    `init_from`: the checkpoint the run started from (--model.init_from), None for a preset. A preset's token ids
    are placeholders, so config.json takes the run's tokenizer's `token_ids` (bos_token_id, eos_token_id,
    pad_token_id); a checkpoint's config.json has its own, which stay. A GLM-5.3 run from a checkpoint carries
    that checkpoint's tensors that are not its text model's (the vision tower, the MTP layer) and its config.json
    fields (vision_config, ...), see `save_hf`'s `source`; that checkpoint must still be there, else a
    FileNotFoundError says so and nothing is written. `token_files` (the run's tokenizer files and chat template)
    are copied in beside the weights; `write` and `overwrite` as save_hf's."""
    if not init_from:
        cfg = dataclasses.replace(cfg, **token_ids)
    elif cfg.is_glm53 and not os.path.isfile(os.path.join(init_from, "config.json")):
        raise FileNotFoundError(f"the run started from the GLM-5.3 checkpoint {init_from} (--model.init_from), "
                                f"whose vision tower and config the export carries, but it is not there now: "
                                f"export where that checkpoint is")
    save_hf(path, cfg, weights, write=write, extra_files=tuple(token_files), source=init_from, overwrite=overwrite)
