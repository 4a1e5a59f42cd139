"""Continue a prompt with a trained model, printing tokens as they come.

    python scripts/generate.py runs/default --prompt "The module"          # a run's latest checkpoint, greedy
    python scripts/generate.py runs/default-hf --prompt "The module" --temperature 0.8 --top-p 0.9 --seed 1
    python scripts/generate.py runs/chat --chat --prompt "What is the capital of Peru?"   # a chat turn
    python scripts/generate.py runs/mtp --prompt "The module" --draft-depths 3   # greedy, 3 MTP drafts a step

The model is a train.py run directory (its latest checkpoint), one of its checkpoints, or a Transformers
checkpoint directory. The tokenizer is the run's (--model.tokenizer_path, else the byte tokenizer); for a
Transformers directory its tokenizer.json if it has one, else the byte tokenizer; --tokenizer overrides both.
With --chat the prompt is a user turn rendered by the chat template (--chat-template, else the tokenizer's, else
glm5f's GLM-5-style one) with the generation prompt, and the answer stops at the template's stop tokens.
With --draft-depths N the model's MTP layers draft N tokens a step that the main model checks (self-speculative,
greedy: the same text); a model with one MTP layer applies it N times (--model.mtp_shared_depths). The tokens per
main-model pass and the drafts accepted are printed after the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import glm5f  # noqa: E402
from glm5f import checkpoint  # noqa: E402
from glm5f.chat import ChatFormat  # noqa: E402
from glm5f.data import make_tokenizer  # noqa: E402
from glm5f.decode import speculative, stream  # noqa: E402
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
    return cfg, params, tok, tok_path


def chat_prompt(tok_path: str | None, template: str | None, prompt: str, vocab_size: int):
    """(ChatFormat, ids of `prompt` as a user turn followed by the assistant's generation prompt)."""
    fmt = ChatFormat.load(tok_path, template)
    if fmt.tok.vocab_size > vocab_size:
        raise ValueError(f"the chat tokenizer has {fmt.tok.vocab_size} ids (with its special tokens) but the model "
                         f"only {vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return fmt, fmt.ids([{"role": "user", "content": prompt}], add_generation_prompt=True)


def prompt_ids(tok, prompt: str) -> list[int]:
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer has no bos token: pass --prompt TEXT")
    return ids


def print_stream(tok, tokens, out=None, stops=None) -> list[int]:
    """Print the decoded text of the token ids from `tokens` as they come (holding back a piece that ends in an
    incomplete character); returns the ids, up to the first eos (or the first of `stops`)."""
    out = out or sys.stdout
    stops = {tok.eos_id} if stops is None else set(stops)
    ids, shown = [], ""
    for t in tokens:
        if t in stops:
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


def draft_config(cfg: glm5f.GLM5Config, depths: int) -> glm5f.GLM5Config:
    """The config whose speculative decoding drafts `depths` tokens a step: its one MTP layer applied `depths`
    times, or the first `depths` of its MTP layers."""
    if cfg.num_nextn_predict_layers == 1:
        return dataclasses.replace(cfg, mtp_shared_depths=depths)
    if not 1 <= depths <= cfg.num_nextn_predict_layers:
        raise ValueError(f"--draft-depths {depths}: the model has {cfg.num_nextn_predict_layers} MTP layers; pass "
                         f"1 to {cfg.num_nextn_predict_layers} (any number with one MTP layer, which the depths share)")
    return dataclasses.replace(cfg, num_nextn_predict_layers=depths)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a run directory, a checkpoint directory, or a Transformers checkpoint directory")
    ap.add_argument("--prompt", default="", help="text to continue")
    ap.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (stops earlier at eos)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample at this temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens holding this mass")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory with one) instead of the model's")
    ap.add_argument("--chat", action="store_true", help="the prompt is a user turn of a chat (see above)")
    ap.add_argument("--chat-template", help="a jinja chat template file for --chat instead of the tokenizer's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ...")
    ap.add_argument("--draft-depths", type=int, default=0,
                    help="greedy self-speculative decoding with this many MTP drafts a step (see above); 0: off")
    args = ap.parse_args(argv)
    try:
        if args.max_tokens < 0 or not 0 < args.top_p <= 1 or args.temperature < 0:
            raise ValueError("--max-tokens must be >= 0, --temperature >= 0 and --top-p in (0, 1]")
        if args.draft_depths and args.temperature > 0:
            raise ValueError(f"--draft-depths verifies greedy tokens: pass --temperature 0, got {args.temperature}")
        if args.chat_template and not args.chat:
            raise ValueError("--chat-template is used only with --chat")
        check_device(torch.device(args.device), "--device")
        cfg, params, tok, tok_path = load(args.model, args.tokenizer, args.device)
        if args.draft_depths:
            cfg = draft_config(cfg, args.draft_depths)
        stops = None
        if args.chat:
            fmt, ids = chat_prompt(tok_path, args.chat_template, args.prompt, cfg.vocab_size)
            tok, stops = fmt.tok, fmt.stop_ids
        else:
            ids = prompt_ids(tok, args.prompt)
        ids_1xS = torch.tensor([ids], device=args.device)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator(args.device).manual_seed(args.seed)
    try:
        if not args.chat:
            sys.stdout.write(args.prompt)
        eos = None if args.chat else tok.eos_id
        stats = {}
        if args.draft_depths:  # the whole answer at once, then printed as a stream is
            new = speculative(params, cfg, ids_1xS, args.max_tokens, eos_token_id=eos, stats=stats)[0]
        else:
            new = stream(params, cfg, ids_1xS, args.max_tokens, eos_token_id=eos, temperature=args.temperature,
                         top_p=args.top_p, generator=generator)
        tokens = (int(t[0]) if t.ndim else int(t) for t in new)
        print_stream(tok, tokens) if stops is None else print_stream(tok, tokens, stops=stops)
        if stats:
            print(f"\ndraft: {args.draft_depths} MTP depth(s), {stats['tokens_per_step']:.2f} tokens per step "
                  f"({stats['steps']} steps; {stats['accepted']} of {stats['proposed']} drafts accepted, "
                  f"{stats['acceptance_rate']:.1%})", file=sys.stderr)
    except BrokenPipeError:  # the reader went away (`generate.py ... | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    return 0


if __name__ == "__main__":
    sys.exit(main())
