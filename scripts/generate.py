"""Continue a prompt with a trained model, printing tokens as they come.

    python scripts/generate.py runs/default --prompt "The module"          # a run's latest checkpoint, greedy
    python scripts/generate.py runs/default-hf --prompt "The module" --temperature 0.8 --top-p 0.9 --seed 1

The model is a train.py run directory (its latest checkpoint), one of its checkpoints, or a Transformers
checkpoint directory. The tokenizer is the run's (--model.tokenizer_path, else the byte tokenizer); for a
Transformers directory its tokenizer.json if it has one, else the byte tokenizer; --tokenizer overrides both.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import glm5f  # noqa: E402
from glm5f import checkpoint  # noqa: E402
from glm5f.data import make_tokenizer  # noqa: E402
from glm5f.decode import stream  # noqa: E402
from glm5f.distributed import check_device  # noqa: E402


def load(path: str, tokenizer: str | None = None, device: str = "cpu"):
    """(cfg, params, tokenizer) of a run directory, a checkpoint, or a Transformers checkpoint directory."""
    is_hf = os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "meta.json"))
    if is_hf:
        cfg, params = glm5f.load_hf(path, device=device)
        has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
        tok_path = tokenizer or (path if has_tok else None)
    else:
        ckpt = checkpoint.resolve(path)
        cfg, params = checkpoint.load_params(ckpt)
        params = glm5f.params.map_with_path(lambda p, t: t.to(device), params)
        tok_path = tokenizer or checkpoint.read_meta(ckpt).get("run", {}).get("model", {}).get("tokenizer_path")
    tok = make_tokenizer(tok_path)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}: "
                         f"pass the tokenizer the model was trained with (--tokenizer)")
    return cfg, params, tok


def prompt_ids(tok, prompt: str) -> list[int]:
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer has no bos token: pass --prompt TEXT")
    return ids


def print_stream(tok, tokens, out=None) -> list[int]:
    """Print the decoded text of the token ids from `tokens` as they come (holding back a piece that ends in an
    incomplete character); returns the ids, up to the first eos."""
    out = out or sys.stdout
    ids, shown = [], ""
    for t in tokens:
        if t == tok.eos_id:
            break
        ids.append(t)
        text = tok.decode(ids)
        if not text.endswith("\ufffd") and text.startswith(shown):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = tok.decode(ids)
    out.write(text[len(shown):] if text.startswith(shown) else "")
    out.write("\n")
    out.flush()
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a run directory, a checkpoint directory, or a Transformers checkpoint directory")
    ap.add_argument("--prompt", default="", help="text to continue")
    ap.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (stops earlier at eos)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample at this temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens holding this mass")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory with one) instead of the model's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ...")
    args = ap.parse_args(argv)
    try:
        if args.max_tokens < 0 or not 0 < args.top_p <= 1 or args.temperature < 0:
            raise ValueError("--max-tokens must be >= 0, --temperature >= 0 and --top-p in (0, 1]")
        check_device(torch.device(args.device), "--device")
        cfg, params, tok = load(args.model, args.tokenizer, args.device)
        ids_1xS = torch.tensor([prompt_ids(tok, args.prompt)], device=args.device)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator(args.device).manual_seed(args.seed)
    try:
        sys.stdout.write(args.prompt)
        new = stream(params, cfg, ids_1xS, args.max_tokens, eos_token_id=tok.eos_id, temperature=args.temperature,
                     top_p=args.top_p, generator=generator)
        print_stream(tok, (int(t[0]) for t in new))
    except BrokenPipeError:  # the reader went away (`generate.py ... | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    return 0


if __name__ == "__main__":
    sys.exit(main())
