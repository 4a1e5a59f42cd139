"""Continue a prompt with a trained model, or answer a chat, printing tokens as they come.

    python scripts/generate.py runs/default --prompt "The module"          # a run's latest checkpoint, greedy
    python scripts/generate.py runs/default-hf --prompt "The module" --temperature 0.8 --top-p 0.9 --seed 1
    python scripts/generate.py runs/chat --chat --prompt "What is the capital of Peru?"   # a chat turn
    python scripts/generate.py runs/chat --chat --system "Answer briefly." --messages talk.json --prompt "And?"
    python scripts/generate.py runs/chat --chat --interactive                 # one user turn a line, until EOF
    python scripts/generate.py runs/chat --chat --interactive --prompt "Hi"   # "Hi" first, then stdin's lines
    python scripts/generate.py runs/mtp --prompt "The module" --draft-depths 3   # greedy, 3 MTP drafts a step

The model is a train.py run directory (its latest checkpoint), one of its checkpoints, or a Transformers
checkpoint directory. The tokenizer and chat template are the ones it carries: a run's tokenizer/ copy (for a run
from before that copy, its --model.tokenizer_path), an export's tokenizer.json and chat_template.jinja (or
tokenizer_config.json's template); without a tokenizer.json, the byte tokenizer and glm5f's GLM-5-style template.
--tokenizer and --chat-template override them. With --chat the conversation (--system, the turns of --messages
FILE, then --prompt as a user turn) is rendered by the template with the generation prompt, and the answer stops
at the template's stop tokens.
With --draft-depths N the model's MTP layers draft N tokens a step that the main model checks (self-speculative,
greedy: the same text); a model with one MTP layer applies it N times (--model.mtp_shared_depths). The tokens per
main-model pass and the drafts accepted are printed after the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import glm5f  # noqa: E402
from glm5f.ckpt import checkpoint  # noqa: E402
from glm5f.data.chat import (ChatFormat, ChatTemplate, RunTokenizer, chat_messages, checkpoint_tokenizer,  # noqa: E402
                             resolve_tokenizer, tokenizer_of)
from glm5f.data import make_tokenizer, warnings_as_lines  # noqa: E402
from glm5f.model.decode import speculative, stream  # noqa: E402
from glm5f.run.launch import check_device  # noqa: E402
from glm5f.run.preflight import cache_bytes, check_fits, checkpoint_weights, size, weight_bytes  # noqa: E402
from glm5f.data.tokens import chat_tokenizer, template_tokens  # noqa: E402


def load(path: str, tokenizer: str | None = None, device: str = "cpu"):
    """(cfg, params, tokenizer, RunTokenizer) of a run directory, a checkpoint, or a Transformers checkpoint
    directory; `tokenizer` (a tokenizer.json or a directory with one) overrides the one it carries."""
    if is_hf(path):
        cfg, params = glm5f.load_hf(path, device=device)
        tokens = tokenizer_of(path)
    else:
        ckpt = checkpoint.resolve(path)
        cfg, params = checkpoint.load_params(ckpt)
        params = glm5f.core.params.map_with_path(lambda p, t: t.to(device), params)
        tokens = checkpoint_tokenizer(ckpt, checkpoint.read_meta(ckpt).get("run") or {})[0]
    if tokenizer is not None:
        tokens = resolve_tokenizer(tokenizer, None, None)
    tok = make_tokenizer(tokens.path)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}: "
                         f"pass the tokenizer the model was trained with (--tokenizer)")
    return cfg, params, tok, tokens


def check_memory(path: str, max_tokens: int, device: str) -> None:
    """Before loading: a ValueError when the weights of `path` (as `load` reads it) and the decode cache of
    --max-tokens new positions need more memory than `device` has available (`preflight.check_fits`). The
    figure is a lower bound: a Transformers checkpoint's weights at 2 bytes a parameter (the narrowest they load
    in), the cache's positions without the prompt's."""
    if is_hf(path):
        cfg, dtype = glm5f.GLM5Config.from_hf(path), torch.bfloat16
    else:
        cfg, dtype = checkpoint_weights(checkpoint.resolve(path))
    weights, cache = weight_bytes(cfg, dtype), cache_bytes(cfg, 1, max_tokens + 1, dtype)
    check_fits(weights + cache, torch.device(device), f"loading {path} and decoding needs",
               f"{size(weights)} of weights in {str(dtype).replace('torch.', '')}, {size(cache)} of "
               f"decode cache for {max_tokens + 1} positions", "generate where there is more (another --device or "
               "machine), from a bf16 export (a Transformers checkpoint), or with fewer --max-tokens; "
               "--skip-memory-check loads it anyway")


def is_hf(path: str) -> bool:
    """Whether `path` is a Transformers checkpoint directory (not a train.py run or checkpoint)."""
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "meta.json"))


def chat_format(tokens: RunTokenizer, template_file: str | None, vocab_size: int) -> ChatFormat:
    """The chat format of `tokens` (its tokenizer with its chat special tokens, and its template, or the one in
    `template_file`)."""
    if template_file is not None:
        if not os.path.isfile(template_file):
            raise FileNotFoundError(f"--chat-template {template_file!r}: no such file (expected a jinja chat template)")
        with open(template_file, encoding="utf-8") as f:
            source, name = f.read(), template_file
    elif tokens.template is not None:
        source, name = tokens.template, tokens.template_name
    else:
        raise ValueError(f"the model carries no chat template ({tokens.how}): pass --chat-template FILE")
    tok = chat_tokenizer(tokens.path)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"the chat tokenizer has {tok.vocab_size} ids (with its special tokens) but the model "
                         f"only {vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return ChatFormat(tok, ChatTemplate(source, name), template_tokens(tok, tokens.path))


def conversation(system: str | None, messages_file: str | None, prompt: str) -> list[dict]:
    """The messages of a chat: the --system turn, those of --messages FILE (a JSON list of {"role", "content"},
    or a chat record: {"messages": [...]} or ShareGPT {"conversations": [...]}), then `prompt` as a user turn
    (none when it is empty)."""
    messages = [{"role": "system", "content": system}] if system else []
    if messages_file is not None:
        if not os.path.isfile(messages_file):
            raise FileNotFoundError(f"--messages {messages_file!r}: no such file (expected JSON: a list of "
                                    f"{{'role', 'content'}} messages)")
        try:
            with open(messages_file, encoding="utf-8") as f:
                rec = json.load(f)
        except ValueError as e:
            raise ValueError(f"--messages {messages_file}: not a JSON file ({e})") from None
        try:
            turns, _ = chat_messages({"messages": rec} if isinstance(rec, list) else rec)
        except (ValueError, KeyError) as e:
            raise ValueError(f"--messages {messages_file}: {e}") from None
        messages += turns
    if prompt:
        messages.append({"role": "user", "content": prompt})
    if not messages:
        raise ValueError("--chat needs a conversation: pass --prompt TEXT, --messages FILE or --interactive")
    return messages


def check_positions(n: int, cfg) -> None:
    """A warning line when a prompt of `n` tokens plus the new ones reach past the model's
    max_position_embeddings (rope positions it was not trained for)."""
    if n > cfg.max_position_embeddings:
        print(f"warning: the prompt and --max-tokens reach position {n}, past the model's max_position_embeddings "
              f"{cfg.max_position_embeddings}: what follows is outside the positions it was trained for",
              file=sys.stderr)


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


def resolve_device(name: str) -> str:
    """--device: auto is cuda when there is one, else cpu; anything else is checked to be there."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    check_device(torch.device(device), "--device")
    return device


def answer(params, cfg, tok, ids: list[int], args, device: str, stops=None) -> list[int]:
    """Generate from `ids` and print the new text as it comes; the new ids, up to the first stop."""
    check_positions(len(ids) + args.max_tokens, cfg)
    ids_1xS, eos, stats = torch.tensor([ids], device=device), None if stops is not None else tok.eos_id, {}
    if args.draft_depths:  # the whole answer at once, then printed as a stream is
        new = speculative(params, cfg, ids_1xS, args.max_tokens, eos_token_id=eos, stats=stats)[0]
    else:
        generator = torch.Generator(device).manual_seed(args.seed)
        new = stream(params, cfg, ids_1xS, args.max_tokens, eos_token_id=eos, temperature=args.temperature,
                     top_p=args.top_p, generator=generator)
    tokens = (int(t[0]) if t.ndim else int(t) for t in new)
    out = print_stream(tok, tokens) if stops is None else print_stream(tok, tokens, stops=stops)
    if stats:
        print(f"\ndraft: {args.draft_depths} MTP depth(s), {stats['tokens_per_step']:.2f} tokens per step "
              f"({stats['steps']} steps; {stats['accepted']} of {stats['proposed']} drafts accepted, "
              f"{stats['acceptance_rate']:.1%})", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a run directory, a checkpoint directory, or a Transformers checkpoint directory")
    ap.add_argument("--prompt", default="", help="text to continue (with --chat: the user's turn)")
    ap.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (stops earlier at eos)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample at this temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens holding this mass")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory with one) instead of the model's")
    ap.add_argument("--chat", action="store_true", help="the prompt is a user turn of a chat (see above)")
    ap.add_argument("--chat-template", help="a jinja chat template file for --chat instead of the model's")
    ap.add_argument("--system", help="--chat: a system message before the conversation")
    ap.add_argument("--messages", help="--chat: a JSON file of the conversation so far (a list of messages)")
    ap.add_argument("--interactive", action="store_true",
                    help="--chat: read user turns from stdin, one a line, answering each (until EOF); --prompt "
                         "is answered first")
    ap.add_argument("--device", default="auto", help="auto (cuda when there is one, else cpu), cpu, cuda, ...")
    ap.add_argument("--draft-depths", type=int, default=0,
                    help="greedy self-speculative decoding with this many MTP drafts a step (see above); 0: off")
    ap.add_argument("--skip-memory-check", action="store_true",
                    help="load even though the weights and decode cache need more memory than the device has "
                         "available (checked before loading)")
    args = ap.parse_args(argv)
    warnings_as_lines()
    try:
        if args.max_tokens < 0 or not 0 < args.top_p <= 1 or args.temperature < 0:
            raise ValueError("--max-tokens must be >= 0, --temperature >= 0 and --top-p in (0, 1]")
        if args.draft_depths and args.temperature > 0:
            raise ValueError(f"--draft-depths verifies greedy tokens: pass --temperature 0, got {args.temperature}")
        chat_only = [f for f, v in (("--chat-template", args.chat_template), ("--system", args.system),
                                    ("--messages", args.messages), ("--interactive", args.interactive)) if v]
        if chat_only and not args.chat:
            raise ValueError(f"{', '.join(chat_only)}: used only with --chat")
        device = resolve_device(args.device)
        if not args.skip_memory_check:
            check_memory(args.model, args.max_tokens, device)
        cfg, params, tok, tokens = load(args.model, args.tokenizer, device)
        if args.draft_depths:
            cfg = draft_config(cfg, args.draft_depths)
        stops, messages = None, []
        if args.chat:
            fmt = chat_format(tokens, args.chat_template, cfg.vocab_size)
            tok, stops = fmt.tok, fmt.stop_ids
            if args.interactive:
                messages = conversation(args.system, args.messages, "") if args.system or args.messages else []
            else:
                messages = conversation(args.system, args.messages, args.prompt)
                ids = fmt.ids(messages, add_generation_prompt=True)
        else:
            ids = prompt_ids(tok, args.prompt)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if args.chat and args.interactive:  # --prompt, when given, is the first user turn
            for line in itertools.chain([args.prompt] if args.prompt else [], sys.stdin):
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                new = answer(params, cfg, tok, fmt.ids(messages, add_generation_prompt=True), args, device, stops)
                messages.append({"role": "assistant", "content": tok.decode(new)})
            return 0
        if not args.chat:
            sys.stdout.write(args.prompt)
        answer(params, cfg, tok, ids, args, device, stops)
    except BrokenPipeError:  # the reader went away (`generate.py ... | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    return 0


if __name__ == "__main__":
    sys.exit(main())
