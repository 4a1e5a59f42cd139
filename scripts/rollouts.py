"""Sample a rollouts file (the JSONL `--data.type rollouts` trains on: glm5f/data/rollouts.py) from a prompts file with
glm5f's decoder: per prompt a group of completions, each with its token ids, its reward and its log-probabilities.

    python scripts/rollouts.py runs/sft --prompts prompts.jsonl --reward my_rewards:score --out rollouts.jsonl
    python scripts/rollouts.py runs/sft-hf --prompts prompts.jsonl --reward glm5f.posttrain.rewards:lowercase_share \\
        --out rollouts.jsonl --group-size 8 --temperature 1.0 --max-new-tokens 64 --seed 0

The model is a train.py run directory (its latest checkpoint), one of its checkpoints, or a Transformers checkpoint
directory, with the tokenizer and chat template it carries (as scripts/generate.py reads them). The prompts are
records {"prompt" | "messages" | "prompt_ids", ...other fields} as `--data.type prompts` reads them; each output
record is the prompt record with "completions": [{"ids", "reward", "logprobs"}]. The reward function (module:function,
imported with the working directory and PYTHONPATH on the path) is called as `--rl.reward`'s; without --reward every
reward is 0 (a warning says so: GRPO learns nothing from equal rewards until they are filled in). The file is
written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from glm5f.posttrain import sampler  # noqa: E402
from glm5f.posttrain.grpo import RLConfig  # noqa: E402
from glm5f.data import warnings_as_lines  # noqa: E402
from scripts.generate import chat_format, load, resolve_device  # noqa: E402


def zero_reward(**kwargs) -> float:
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a run directory, a checkpoint directory, or a Transformers checkpoint directory")
    ap.add_argument("--prompts", required=True, help="JSONL of prompt records (as --data.type prompts reads)")
    ap.add_argument("--out", required=True, help="the rollouts JSONL to write")
    ap.add_argument("--reward", help="module:function scoring a completion (see above); none: every reward 0")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (at least 2)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens holding this mass")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion at most")
    ap.add_argument("--batch-prompts", type=int, default=8, help="prompts decoded together (x --group-size rows)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--record", default="routing,indexer",
                    help="the decoder's choices to write per completion for --rl.replay (comma-separated: routing, "
                         "indexer; empty: none)")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory with one) instead of the model's")
    ap.add_argument("--chat-template", help="a jinja chat template for chat records instead of the model's")
    ap.add_argument("--device", default="auto", help="auto (cuda when there is one, else cpu), cpu, cuda, ...")
    args = ap.parse_args(argv)
    warnings_as_lines()
    lines, tmp, writing = [], f"{args.out}.tmp", False
    try:
        if args.group_size < 2 or args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 \
                or args.batch_prompts < 1:
            raise ValueError(f"--group-size must be >= 2, --max-new-tokens and --batch-prompts >= 1, --temperature "
                             f">= 0 and --top-p in (0, 1]; got {args.group_size}, {args.max_new_tokens}, "
                             f"{args.batch_prompts}, {args.temperature}, {args.top_p}")
        if os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} is a directory; pass the path of the JSONL file to write")
        reward = sampler.load_reward(args.reward) if args.reward else zero_reward
        device = resolve_device(args.device)
        cfg, params, tok, tokens = load(args.model, args.tokenizer, device)
        try:
            fmt = chat_format(tokens, args.chat_template, cfg.vocab_size)
        except ValueError:  # a model without a template: its chat records are refused when read
            if args.chat_template is not None:
                raise
            fmt = None
        prompts = sampler.read_prompts(args.prompts, tok, fmt)
        records = [json.loads(line) for line in open(args.prompts, "rb") if line.strip()]
        for p in prompts:
            if len(p.ids) + args.max_new_tokens > cfg.max_position_embeddings:
                print(f"warning: {p.where}: the prompt and --max-new-tokens reach past the model's "
                      f"max_position_embeddings {cfg.max_position_embeddings}", file=sys.stderr)
        if not args.reward:
            print("warning: no --reward: every completion's reward is 0; fill them in before training on the file",
                  file=sys.stderr)
        record = tuple(f.strip() for f in args.record.split(",") if f.strip())
        if any(f not in ("routing", "indexer") for f in record):
            raise ValueError(f"--record takes routing and/or indexer (comma-separated), got {args.record!r}")
        settings = RLConfig(group_size=args.group_size, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, replay=",".join(record))
        generator = torch.Generator(device).manual_seed(args.seed)
        name = f"--reward {args.reward}" if args.reward else "the reward"
        lines = []
        for start in range(0, len(prompts), args.batch_prompts):
            part = prompts[start:start + args.batch_prompts]
            groups = sampler.sample_groups(params, cfg, part, settings, reward, tok, tok.pad_id, generator,
                                           reward_name=name)
            for rec, p, g in zip(records[start:], part, groups):
                rec = {**rec, "completions": [
                    {"ids": c.example.ids[len(p.ids):], "reward": c.reward, "logprobs": c.logprobs,
                     **{f: v.tolist() for f, v in c.replay.items()}} for c in g.completions]}
                lines.append(json.dumps(rec) + "\n")
            print(f"{start + len(part)}/{len(prompts)} prompts", file=sys.stderr)
        writing = True
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, args.out)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # one line, and no half-written file
        if writing and os.path.exists(tmp):
            os.remove(tmp)
        print(f"stopped on Ctrl-C (SIGINT) after {len(lines)} prompts' groups: {args.out} was not written (it is "
              f"written whole or not at all); run the command again", file=sys.stderr)
        return 130
    print(f"wrote {len(lines)} groups of {args.group_size} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
