"""Convert a training checkpoint (DCP, saved from any parallel layout) to a Transformers checkpoint directory.

    python scripts/convert.py runs/default runs/default-hf            # the run's latest checkpoint
    python scripts/convert.py runs/default/checkpoints/step_00000100 out/hf
    python scripts/convert.py runs/lora out/adapter --peft            # a LoRA run: its adapters, PEFT's format
    python scripts/convert.py runs/lora out/merged --merge-lora       # a LoRA run: base + adapters merged

Reads only the parameters (not the optimizer state) into this one process, then writes config.json and
safetensors shards one at a time, as the run's --checkpoint.export_hf does (glm5f.ckpt.hf.export_run: the run's
tokenizer files and chat template; a GLM-5.3 run's vision tower, copied from its --model.init_from). OUT_DIR must
be new, empty, or a previous export that no other run starts from (else --replace-export). A LoRA run's
checkpoint holds its adapters, not the base: --peft writes them as a PEFT adapter directory (glm5f.ckpt.hf.peft.save_peft);
--merge-lora rebuilds the base from what the run named (its --model.init_from, or its preset and seed), checks
its fingerprint, and writes W + scale * B @ A (merged in fp32, cast to the base's dtype) as a Transformers
checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import glm5f  # noqa: E402
from glm5f.ckpt import checkpoint  # noqa: E402
from glm5f.core.config import GLM5Config  # noqa: E402
from glm5f.data import make_tokenizer, warnings_as_lines  # noqa: E402
from glm5f.data.chat import checkpoint_tokenizer  # noqa: E402
from glm5f.ckpt.hf.export import export_run  # noqa: E402
from glm5f.ckpt.hf.export_dir import check_export_dir  # noqa: E402
from glm5f.ckpt.hf.peft import save_peft  # noqa: E402
from glm5f.run.preflight import check_fits, checkpoint_weights, weight_bytes  # noqa: E402


def run_tokenizer(path: str) -> tuple[dict, list[str]]:
    """What the run of checkpoint `path` tokenized with: the config.json ids of its tokenizer (bos/eos/pad, the byte
    tokenizer's 256/257/258 without one) and the files to ship beside the weights: the run directory's
    tokenizer/ copy (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja), or for a
    run from before that copy, its --model.tokenizer_path's files."""
    tokens, copy = checkpoint_tokenizer(path, checkpoint.read_meta(path).get("run") or {})
    files = [os.path.join(copy, n) for n in sorted(os.listdir(copy))] if copy else list(tokens.files().values())
    tok = make_tokenizer(tokens.path)
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}, files


def check_memory(path: str) -> None:
    """Before reading: a ValueError when the params of checkpoint `path` (as `checkpoint.load_params` holds them:
    the run's master dtype, a LoRA run's base in its --lora.base_dtype) need more host memory than is available
    (`preflight.check_fits`)."""
    cfg, dtype = checkpoint_weights(path)
    need = weight_bytes(cfg, dtype)
    check_fits(need, torch.device("cpu"), f"reading {path} needs", f"its {glm5f.param_count(cfg):,} parameters in "
               f"{str(dtype).replace('torch.', '')}", "convert on a machine with more memory; --skip-memory-check "
               "reads it anyway")


def convert(source: str, out_dir: str, replace: bool = False) -> str:
    """Write the params of `source` (a checkpoint, or a run directory's latest) to `out_dir` as the run's
    --checkpoint.export_hf would (`export_run`: its tokenizer files and chat template, the ids and, for GLM-5.3,
    the vision tower of what it started from); returns the checkpoint it read. `replace`: replace an export
    another run starts from (see check_export_dir)."""
    path = checkpoint.resolve(source)
    ids, files = run_tokenizer(path)
    # before reading: refuses a non-empty directory that is not a previous export
    check_export_dir(out_dir, writes=tuple(files), overwrite=replace, consent="--replace-export")
    cfg, params = checkpoint.load_params(path)
    init_from = ((checkpoint.read_meta(path).get("run") or {}).get("model") or {}).get("init_from")
    export_run(out_dir, cfg, params, init_from=init_from, token_ids=ids, token_files=tuple(files), overwrite=replace)
    return path


def convert_lora(source: str, out_dir: str, merge: bool, replace: bool = False) -> str:
    """A LoRA run's checkpoint `source`: its adapters as a PEFT directory (naming its base, with the run's tokenizer
    files), or (merge) base + adapters merged as a Transformers checkpoint with the run's tokenizer ids and files;
    returns the checkpoint it read."""
    path = checkpoint.resolve(source)
    if merge:
        return convert(path, out_dir, replace)  # load_params merges a LoRA run's adapters into its rebuilt base
    _, files = run_tokenizer(path)
    check_export_dir(out_dir, flag="OUT_DIR", writes=tuple(files), overwrite=replace, consent="--replace-export")
    spec, adapters = checkpoint.load_adapters(path)
    meta = checkpoint.read_meta(path)
    save_peft(out_dir, GLM5Config.from_hf(meta["model"]), adapters, spec,
              base_model_name_or_path=(meta["run"].get("model") or {}).get("init_from"), flag="OUT_DIR",
              extra_files=tuple(files), overwrite=replace)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    ap.add_argument("out_dir", help="the Transformers checkpoint directory to write")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--peft", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory")
    how.add_argument("--merge-lora", action="store_true",
                     help="a LoRA run: write its base with the adapters merged as a Transformers checkpoint")
    ap.add_argument("--skip-memory-check", action="store_true",
                    help="read the checkpoint even though its params need more memory than is available (checked "
                         "before reading)")
    ap.add_argument("--replace-export", action="store_true",
                    help="replace a previous export that another run starts from (--model.init_from), or whose "
                         "tokenizer files this one does not write; files glm5f did not write are never replaced")
    args = ap.parse_args(argv)
    warnings_as_lines()
    try:
        is_lora = "lora_base" in checkpoint.read_meta(checkpoint.resolve(args.checkpoint))
        if is_lora and not (args.peft or args.merge_lora):
            raise ValueError(f"{args.checkpoint} is a LoRA run's checkpoint (adapters, not the whole model): pass "
                             f"--peft (the adapters, PEFT's format) or --merge-lora (base + adapters merged)")
        if not is_lora and (args.peft or args.merge_lora):
            raise ValueError(f"{args.checkpoint} is not a LoRA run's checkpoint: convert it without "
                             f"{'--peft' if args.peft else '--merge-lora'}")
        if not args.skip_memory_check and not args.peft:  # --peft reads the adapters only
            check_memory(checkpoint.resolve(args.checkpoint))
        path = convert_lora(args.checkpoint, args.out_dir, args.merge_lora, args.replace_export) if is_lora else \
            convert(args.checkpoint, args.out_dir, args.replace_export)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
