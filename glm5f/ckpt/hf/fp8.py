"""Block-quantized FP8 checkpoints (e4m3 `weight` + fp32 `weight_scale_inv` per block): their scales checked
against config.json's quantization_config, and a part of a weight read dequantized (fp8 x its block's scale)."""

from __future__ import annotations

import os

import torch

from glm5f.core.config import read_json
from glm5f.ckpt.hf import io

SCALE_SUFFIX = "_scale_inv"  # `….weight_scale_inv`: the per-block scales of the FP8 tensor `….weight`
_FP8 = ("F8_E4M3", "F8_E5M2")


def fp8_scales(path: str, inv: dict) -> tuple[dict[str, tuple], tuple[int, int] | None]:
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


def read_dequantized(f, shape: tuple[int, ...], dtype: torch.dtype, begin: int, part: tuple[slice, ...],
                      scale, block: tuple[int, int], dest: torch.Tensor, files: dict) -> None:
    """`read_part` of an FP8 tensor, as fp8.float() * its block's scale: reads only the part's FP8 bytes and the
    scales of the blocks it touches (`scale`: the scale's inventory entry; `files`: open files by name)."""
    if dest.numel() == 0:
        return
    q = torch.empty([sl.stop - sl.start for sl in part], dtype=dtype)
    io.read_into(f, shape, begin, part, q)
    (rows, cols), (br, bc) = part[-2:], block
    blocks = (slice(rows.start // br, -(-rows.stop // br)), slice(cols.start // bc, -(-cols.stop // bc)))
    fn, scale_shape, scale_dt, scale_begin = scale
    s = torch.empty([sl.stop - sl.start for sl in part[:-2] + blocks], dtype=io.DTYPES[scale_dt])
    if fn not in files:
        files[fn] = open(fn, "rb")
    io.read_into(files[fn], scale_shape, scale_begin, part[:-2] + blocks, s)
    s = s.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    r0, c0 = rows.start - blocks[0].start * br, cols.start - blocks[1].start * bc
    dest.copy_(q.float() * s[..., r0:r0 + rows.stop - rows.start, c0:c0 + cols.stop - cols.start])

