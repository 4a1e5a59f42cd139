"""Convert a training checkpoint (DCP, saved from any parallel layout) to a Transformers checkpoint directory.

    python scripts/convert.py runs/default runs/default-hf            # the run's latest checkpoint
    python scripts/convert.py runs/default/checkpoints/step_00000100 out/hf
    python scripts/convert.py runs/lora out/adapter --peft            # a LoRA run: its adapters, PEFT's format
    python scripts/convert.py runs/lora out/merged --merge-lora       # a LoRA run: base + adapters merged

Reads only the parameters (not the optimizer state) into this one process, then writes config.json and
safetensors shards one at a time (glm5f.save_hf). OUT_DIR must be new, empty, or a previous export. A LoRA run's
checkpoint holds its adapters, not the base: --peft writes them as a PEFT adapter directory (glm5f.hf.save_peft);
--merge-lora rebuilds the base from what the run named (its --model.init_from, or its preset and seed), checks
its fingerprint, and writes W + scale * B @ A (merged in fp32, cast to the base's dtype) as a Transformers
checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm5f  # noqa: E402
from glm5f import checkpoint, lora  # noqa: E402
from glm5f.config import GLM5Config  # noqa: E402
from glm5f.data import make_tokenizer  # noqa: E402
from glm5f.hf import check_export_dir, save_peft  # noqa: E402


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def run_tokenizer(path: str) -> tuple[dict, list[str]]:
    """What the run of checkpoint `path` tokenized with: the config.json ids of its tokenizer (bos/eos/pad of
    --model.tokenizer_path, else of the byte tokenizer: 256/257/258) and the tokenizer files to ship beside the
    weights (tokenizer.json and, from its directory, tokenizer_config.json and special_tokens_map.json)."""
    tok_path = (checkpoint.read_meta(path).get("run") or {}).get("model", {}).get("tokenizer_path")
    tok = make_tokenizer(tok_path)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    if tok_path is None:
        return ids, []
    directory = tok_path if os.path.isdir(tok_path) else os.path.dirname(tok_path)
    files = [tok_path if os.path.isfile(tok_path) else os.path.join(tok_path, "tokenizer.json")]
    files += [os.path.join(directory, n) for n in TOKENIZER_FILES[1:] if os.path.isfile(os.path.join(directory, n))]
    return ids, files


def convert(source: str, out_dir: str) -> str:
    """Write the params of `source` (a checkpoint, or a run directory's latest) to `out_dir`, with the run's
    tokenizer's bos/eos/pad ids in config.json and its tokenizer files; returns the checkpoint it read."""
    path = checkpoint.resolve(source)
    check_export_dir(out_dir)  # before reading: refuses a non-empty directory that is not a previous export
    ids, files = run_tokenizer(path)
    cfg, params = checkpoint.load_params(path)
    glm5f.save_hf(out_dir, dataclasses.replace(cfg, **ids), params, extra_files=tuple(files))
    return path


def convert_lora(source: str, out_dir: str, merge: bool) -> str:
    """A LoRA run's checkpoint `source`: its adapters as a PEFT directory, or (merge) base + adapters merged as a
    Transformers checkpoint with the run's tokenizer ids and files; returns the checkpoint it read."""
    path = checkpoint.resolve(source)
    check_export_dir(out_dir)
    if merge:
        return convert(path, out_dir)  # load_params merges a LoRA run's adapters into its rebuilt base
    spec, adapters = checkpoint.load_adapters(path)
    meta = checkpoint.read_meta(path)
    save_peft(out_dir, GLM5Config.from_hf(meta["model"]), adapters, spec,
              base_model_name_or_path=(meta["run"].get("model") or {}).get("init_from"), flag="OUT_DIR")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    ap.add_argument("out_dir", help="the Transformers checkpoint directory to write")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--peft", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory")
    how.add_argument("--merge-lora", action="store_true",
                     help="a LoRA run: write its base with the adapters merged as a Transformers checkpoint")
    args = ap.parse_args(argv)
    try:
        is_lora = "lora_base" in checkpoint.read_meta(checkpoint.resolve(args.checkpoint))
        if is_lora and not (args.peft or args.merge_lora):
            raise ValueError(f"{args.checkpoint} is a LoRA run's checkpoint (adapters, not the whole model): pass "
                             f"--peft (the adapters, PEFT's format) or --merge-lora (base + adapters merged)")
        if not is_lora and (args.peft or args.merge_lora):
            raise ValueError(f"{args.checkpoint} is not a LoRA run's checkpoint: convert it without "
                             f"{'--peft' if args.peft else '--merge-lora'}")
        path = convert_lora(args.checkpoint, args.out_dir, args.merge_lora) if is_lora else \
            convert(args.checkpoint, args.out_dir)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
