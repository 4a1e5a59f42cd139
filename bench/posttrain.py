"""Post-training steps against TRL: a full-training DPO step of glm5f (`train_step` with --dpo.reference) against
TRL's DPOTrainer (ref_model= passed), and an on-policy GRPO step, sampling included, against TRL's GRPOTrainer
(Transformers' generate, no vLLM); the same Transformers checkpoint, data and batch on both sides.

    python bench/posttrain.py dpo                          # the bench model (4 layers), 4 pairs x 256 tokens a side
    python bench/posttrain.py dpo --batch 2 --seq 512 --steps 8
    python bench/posttrain.py dpo --prompt-len 1024 --answer-len 256   # a long prompt: shared vs unshared vs TRL
    python bench/posttrain.py grpo --batch 2 --group 4 --new-tokens 32
    python bench/posttrain.py grpo --prompt-len 512 --group 8 --new-tokens 64   # a long prompt: shared vs unshared
    python bench/posttrain.py all                          # every section (dpo, grpo)
    python bench/posttrain.py dpo --threads 1 --profile    # and where glm5f's step time goes

A section writes, into a temporary directory, a Transformers GlmMoeDsaForCausalLM (save_pretrained) to train and
another to compare with (the reference), a word-level tokenizer both sides read, and a JSONL of --batch x
(--warmup + --steps) text records {"prompt", "chosen", "rejected"}: each sequence, prompt and answer, is --seq
tokens, half each (or --prompt-len + --answer-len; no padding, no truncation on either side). The dpo section
runs glm5f twice, its pairs as two sequences and as trees (`shared`: --data.share_prefixes True). Both sides
train fp32, AdamW at --lr without weight decay, grad norm clipped to 1, beta 0.1, without activation checkpointing
(TRL's default turns it on, and bf16: both off here).
Each side runs in its own subprocess (its peak is its own): the median wall time of the steps after --warmup (the
optimizer step included, the batch's collation not) and their median CPU time (all the side's threads: on a shared
CPU the figure that does not depend on the load), the peak resident set size at the end of the last step, and the
peak after its imports (the libraries').

The grpo section trains the policy on a JSONL of --batch x (--warmup + --steps) text prompts of --seq // 2 tokens
(or --prompt-len):
each step samples --group completions of at most --new-tokens tokens per prompt at temperature 1 (eos stops one on
both sides), scores them with `reward` (this module's, imported by glm5f as --rl.reward posttrain:reward), and
takes one AdamW step on the dapo loss without a KL term (TRL: beta 0, num_iterations 1). The rows add the mean
completion length each side sampled (stop token included) and glm5f's sampling time per step. glm5f runs twice,
each group as one row per completion and as a tree (`shared`: --data.share_prefixes True, the update's forward and
backward computing each prompt once; the sampler is the same).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import tempfile
import time

import torch

from common import add_model_flags, add_run_flags, model_config, model_flags, run_child, serve_child, threads_of

BETA, SPECIALS = 0.1, ("<pad>", "<eos>")
EOS_ID = SPECIALS.index("<eos>")
TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "glm5f", "assets",
                        "glm5_chat_template.jinja")


def reward(completion_ids: list[int], **_) -> float:
    """The grpo section's reward: the share of a completion's tokens, its stop token left out, with an even id (a
    random policy's completions differ in it, so every group has a signal; 0 for an empty completion)."""
    ids = [i for i in completion_ids if i != EOS_ID]
    return sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0


def rss_gb() -> float:
    """This process's peak resident set size so far (ru_maxrss), GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- the inputs both sides read ---------------------------------------------------------------------------------

def write_inputs(args, root: str) -> dict:
    """The policy and reference checkpoints (Transformers' save_pretrained, different seeds; the tokenizer beside
    the policy), the preference JSONL and the prompt JSONL, in `root`: {"policy", "reference", "data", "prompts"}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()
    cfg = model_config(args)
    paths = {"policy": os.path.join(root, "policy"), "reference": os.path.join(root, "reference"),
             "data": os.path.join(root, "pairs.jsonl"), "prompts": os.path.join(root, "prompts.jsonl")}
    for seed, name in ((0, "policy"), (1, "reference")):
        torch.manual_seed(seed)
        GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg.to_hf())).save_pretrained(paths[name])
    words = list(SPECIALS) + [f"w{i}" for i in range(len(SPECIALS), cfg.vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(
        paths["policy"])
    g = torch.Generator().manual_seed(0)
    prompt, answer = dpo_lengths(args) if args.answer_len is not None or args.prompt_len is None else (0, 2)
    answer -= 1  # the answer's eos ends the sequence

    def text(n: int) -> str:
        return " ".join(words[i] for i in torch.randint(len(SPECIALS), cfg.vocab_size, (n,), generator=g).tolist())
    with open(paths["data"], "w") as f:
        for _ in range(args.batch * (args.warmup + args.steps)):
            f.write(json.dumps({"prompt": text(prompt), "chosen": " " + text(answer),
                                "rejected": " " + text(answer)}) + "\n")
    with open(paths["prompts"], "w") as f:
        for _ in range(args.batch * (args.warmup + args.steps)):
            f.write(json.dumps({"prompt": text(grpo_prompt_len(args))}) + "\n")
    return paths


def dpo_lengths(args) -> tuple[int, int]:
    """(prompt tokens, answer tokens with its eos) of each DPO sequence: --prompt-len and --answer-len when given,
    else half of --seq each (the answer one short, its eos making --seq)."""
    if args.prompt_len is None and args.answer_len is None:
        return args.seq // 2, args.seq - args.seq // 2
    if args.prompt_len is None or args.answer_len is None or args.answer_len < 2:
        raise SystemExit("error: --prompt-len and --answer-len come together (the answer at least 2 tokens: its "
                         "words and eos)")
    return args.prompt_len, args.answer_len


def grpo_prompt_len(args) -> int:
    """The grpo section's prompt tokens: --prompt-len, else half of --seq."""
    return args.seq // 2 if args.prompt_len is None else args.prompt_len


# ---- the sides --------------------------------------------------------------------------------------------------

def dpo_glm5f_shared(args, paths: dict) -> tuple[list[float], float, float, dict]:
    """`dpo_glm5f` with --data.share_prefixes True: each pair's prompt computed once (a tree row)."""
    return dpo_glm5f(args, paths, share=True)


def dpo_glm5f(args, paths: dict, share: bool = False) -> tuple[list[float], float, float, dict]:
    """(seconds of each step, peak RSS GB after the last, RSS GB after the imports, with --profile one more step's
    op self time per (family, kind): `common.profile_split`): train.py's edges (params, reference, data) and
    `train_step`."""
    from configs import parse, with_data_type
    from glm5f.data.chat import resolve_tokenizer
    from glm5f.parallel.layout import Layout
    from glm5f.objectives import objective
    from glm5f.train.step import Trainer, train_step
    from glm5f.run.setup import init_params, init_reference, make_data

    imported = rss_gb()
    cfg = with_data_type(parse([
        "--model.init_from", paths["policy"], "--dpo.reference", paths["reference"], "--train.objective", "dpo",
        "--data.type", "preference", "--data.path", paths["data"], "--data.batch_size", str(args.batch),
        "--data.seq_len", str(2 * sum(dpo_lengths(args))), "--train.dtype", args.dtype, "--train.steps",
        str(args.warmup + args.steps), "--optim.name", "adamw", "--optim.lr", str(args.lr), "--optim.warmup_steps",
        "0", "--optim.weight_decay", "0", "--dpo.beta", str(BETA), "--eval.every", "0",
        "--data.chat_template", TEMPLATE, "--data.share_prefixes", str(share)]))  # the template: not used by
    # text records, but read whenever a tokenizer is given
    layout = Layout(args.device)
    tokenizer = resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    model_cfg, params = init_params(cfg, layout)
    trainer = Trainer.of(cfg, model_cfg, layout, objective(cfg.train.objective))
    state = trainer.init(params, None, init_reference(cfg, model_cfg, params, layout))
    data, _ = make_data(cfg, model_cfg, layout, lambda *a, **k: None, tokenizer.path)
    seconds = []
    for _ in range(args.warmup + args.steps):
        batch = {k: v.to(layout.device) for k, v in data.next_batch().items()}
        t, c = time.perf_counter(), time.process_time()
        state, metrics = train_step(state, batch, trainer)
        seconds.append((time.perf_counter() - t, time.process_time() - c))
    profile = {}
    if args.profile:
        from common import profile_split
        batch = {k: v.to(layout.device) for k, v in data.next_batch().items()}
        profile = profile_split(lambda: train_step(state, batch, trainer), reps=1)
    return seconds, rss_gb(), imported, profile


def dpo_trl(args, paths: dict) -> tuple[list[float], float, float, dict]:
    """(seconds of each step, peak RSS GB after the last, RSS GB after the imports, {}): TRL's DPOTrainer,
    ref_model= the reference."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    imported = rss_gb()
    dtype = getattr(torch, args.dtype)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager", dtype=dtype)  # noqa: E731
    model, ref = load(paths["policy"]), load(paths["reference"])
    tok = PreTrainedTokenizerFast.from_pretrained(paths["policy"])
    with open(paths["data"]) as f:
        data = Dataset.from_list([json.loads(line) for line in f])
    seconds, peak = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            seconds.append((time.perf_counter() - self.t, time.process_time() - self.c))
            peak[:] = [rss_gb()]

    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
                           learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                           beta=BETA, loss_type=["sigmoid"], max_length=sum(dpo_lengths(args)), bf16=False,
                           gradient_checkpointing=False, use_cpu=args.device == "cpu", save_strategy="no",
                           report_to=[], logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data, processing_class=tok,
                   callbacks=[Timer()]).train()
    return seconds, peak[0], imported, {}


def grpo_glm5f_shared(args, paths: dict) -> tuple[list[tuple], float, float, dict]:
    """`grpo_glm5f` with --data.share_prefixes True: each group's prompt computed once in the update (a tree row)."""
    return grpo_glm5f(args, paths, share=True)


def grpo_glm5f(args, paths: dict, share: bool = False) -> tuple[list[tuple], float, float, dict]:
    """(each step's (seconds, CPU seconds, sampling seconds, mean completion tokens), peak RSS GB after the last,
    RSS GB after the imports, with --profile one more update's op self time per (family, kind)): train.py's edges
    (params, the prompt source) and, each step, the source's sampling by the current policy then `train_step`."""
    from configs import parse, with_data_type
    from glm5f.data.chat import resolve_tokenizer
    from glm5f.parallel.layout import Layout
    from glm5f.objectives import objective
    from glm5f.train.step import Trainer, train_step
    from glm5f.data.tokens import IGNORE_INDEX
    from glm5f.posttrain.grpo import decoding_params
    from glm5f.run.setup import init_params, make_data
    from glm5f.data.rollout_trees import tree_rows

    imported = rss_gb()
    cfg = with_data_type(parse([
        "--model.init_from", paths["policy"], "--train.objective", "grpo", "--data.type", "prompts", "--data.path",
        paths["prompts"], "--data.batch_size", str(args.batch), "--data.seq_len",
        str(grpo_prompt_len(args) + args.new_tokens), "--rl.reward", "posttrain:reward", "--rl.group_size",
        str(args.group),
        "--rl.max_new_tokens", str(args.new_tokens), "--rl.temperature", "1.0", "--rl.kl_beta", "0", "--rl.loss",
        "dapo", "--rl.updates_per_batch", "1", "--train.dtype", args.dtype, "--train.steps",
        str(args.warmup + args.steps), "--optim.name", "adamw", "--optim.lr", str(args.lr), "--optim.warmup_steps",
        "0", "--optim.weight_decay", "0", "--eval.every", "0", "--data.chat_template", TEMPLATE,
        "--data.share_prefixes", str(share)]))
    layout = Layout(args.device)
    tokenizer = resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    model_cfg, params = init_params(cfg, layout)
    trainer = Trainer.of(cfg, model_cfg, layout, objective(cfg.train.objective))
    state = trainer.init(params, None, None)
    data, _ = make_data(cfg, model_cfg, layout, lambda *a, **k: None, tokenizer.path)
    steps = []

    def next_batch() -> dict:  # as GRPOFeed makes it: sampled, then (shared) laid out as trees
        batch = data.next_batch(decoding_params(state, trainer.step))
        batch = tree_rows(batch, data.S, data.pad_id) if share else batch
        return {k: v.to(layout.device) for k, v in batch.items()}
    for _ in range(args.warmup + args.steps):
        t, c = time.perf_counter(), time.process_time()
        batch = next_batch()
        sampled = time.perf_counter() - t
        state, metrics = train_step(state, batch, trainer)
        completion = (batch["labels"] != IGNORE_INDEX).sum().item() / (batch["group"] >= 0).sum().item()
        steps.append((time.perf_counter() - t, time.process_time() - c, sampled, completion))
    profile = {}
    if args.profile:
        from common import profile_split
        batch = next_batch()
        profile = profile_split(lambda: train_step(state, batch, trainer), reps=1)
    return steps, rss_gb(), imported, profile


def grpo_trl(args, paths: dict) -> tuple[list[tuple], float, float, dict]:
    """(each step's (seconds, CPU seconds, sampling seconds, mean completion tokens), peak RSS GB after the last,
    RSS GB after the imports, {}): TRL's GRPOTrainer, generating with the model's own generate (no vLLM); the
    sampling time is that of its generate calls."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    imported = rss_gb()
    model = AutoModelForCausalLM.from_pretrained(paths["policy"], attn_implementation="eager",
                                                 dtype=getattr(torch, args.dtype))
    model.generation_config.eos_token_id = EOS_ID  # the stop token glm5f's sampler ends a text prompt's completion at
    tok = PreTrainedTokenizerFast.from_pretrained(paths["policy"])
    with open(paths["prompts"]) as f:
        data = Dataset.from_list([json.loads(line) for line in f])
    steps, peak, sampled, lengths = [], [], [0.0], []
    generate = model.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = generate(*a, **k)
        sampled[0] += time.perf_counter() - t
        return out
    model.generate = timed_generate

    def scored(completion_ids: list[list[int]], **_) -> list[float]:
        lengths.extend(len(ids) for ids in completion_ids)
        return [reward(ids) for ids in completion_ids]

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()
            sampled[0], lengths[:] = 0.0, []

        def on_step_end(self, *a, **k):
            steps.append((time.perf_counter() - self.t, time.process_time() - self.c, sampled[0],
                          sum(lengths) / len(lengths)))
            peak[:] = [rss_gb()]

    with tempfile.TemporaryDirectory() as out:
        rows = args.batch * args.group  # TRL's batch sizes count completions
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=rows, generation_batch_size=rows,
                            num_generations=args.group, max_completion_length=args.new_tokens, temperature=1.0,
                            top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", epsilon_high=0.28,
                            max_steps=args.warmup + args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                            weight_decay=0.0, max_grad_norm=1.0, bf16=False, gradient_checkpointing=False,
                            use_vllm=False, use_cpu=args.device == "cpu", save_strategy="no", report_to=[],
                            logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
                            seed=0)
        GRPOTrainer(model=model, reward_funcs=scored, args=config, train_dataset=data, processing_class=tok,
                    callbacks=[Timer()]).train()
    return steps, peak[0], imported, {}


# a section's sides, by name; glm5f first
SIDES = {"dpo": {"glm5f": dpo_glm5f, "shared": dpo_glm5f_shared, "trl": dpo_trl},
         "grpo": {"glm5f": grpo_glm5f, "shared": grpo_glm5f_shared, "trl": grpo_trl}}


def run_side(args) -> dict:
    section, side = args.child.split(":")
    seconds, peak, imports, profile = SIDES[section][side](args, json.loads(args.paths))
    return {"seconds": seconds, "peak_gb": peak, "imports_gb": imports,
            "profile": [[family, kind, t] for (family, kind), t in profile.items()]}


# ---- the command ------------------------------------------------------------------------------------------------

def run_section(section: str, args) -> None:
    """Both sides of `section` on the same inputs; prints a row per side and their ratio."""
    cfg = model_config(args)
    here = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as root:
        paths = write_inputs(args, root)
        flags = [*model_flags(args), "--warmup", str(args.warmup), "--lr", str(args.lr), "--group", str(args.group),
                 "--new-tokens", str(args.new_tokens), "--paths", json.dumps(paths),
                 *([] if args.prompt_len is None else ["--prompt-len", str(args.prompt_len)]),
                 *([] if args.answer_len is None else ["--answer-len", str(args.answer_len)]),
                 *(["--profile"] if args.profile else [])]
        res = {side: run_child(here, ["--child", f"{section}:{side}", *flags], f"the {section} {side} side")
               for side in SIDES[section]}
    model = f"{args.preset} ({cfg.num_hidden_layers} layers, index_topk {cfg.index_topk})"
    run = (f"{args.dtype} on {args.device} ({threads_of(args)} threads); median of {args.steps} steps after "
           f"{args.warmup} warm-up")
    if section == "grpo":
        tokens = args.batch * args.group * (grpo_prompt_len(args) + args.new_tokens)  # at full completion length
        print(f"grpo: {model}, {args.batch} prompt(s) of {grpo_prompt_len(args)} tokens x {args.group} completions of "
              f"at most {args.new_tokens} tokens a step, sampling at temperature 1 then one update (dapo, no KL), "
              f"{run}; shared: glm5f with --data.share_prefixes True")
    else:
        prompt, answer = dpo_lengths(args)
        tokens = 2 * args.batch * (prompt + answer)
        print(f"{section}: {model}, {args.batch} pair(s) x 2 x ({prompt} prompt + {answer} answer) tokens a step, "
              f"full training with a reference model, {run}; shared: glm5f with --data.share_prefixes True")
    extra = section == "grpo"  # the steps also record (sampling seconds, mean completion tokens)
    print(f"  {'side':8s}{'s/step':>10s}{'tok/s':>10s}{'CPU s/step':>12s}{'peak RSS GB':>13s}{'after imports':>15s}"
          + (f"{'sample s':>10s}{'completion':>12s}" if extra else ""))
    for side, r in res.items():
        medians = [statistics.median(x[i] for x in r["seconds"][args.warmup:]) for i in range(len(r["seconds"][0]))]
        r["median"], r["cpu"] = medians[:2]
        print(f"  {side:8s}{r['median']:10.3f}{tokens / r['median']:10.0f}{r['cpu']:12.3f}{r['peak_gb']:13.3f}"
              f"{r['imports_gb']:15.3f}" + (f"{medians[2]:10.3f}{medians[3]:12.1f}" if extra else ""))
    *ours, (b, rb) = res.items()  # each glm5f side against the last (TRL)
    for a, ra in ours:
        print(f"  {a} / {b}: {rb['median'] / ra['median']:.2f}x the speed ({rb['cpu'] / ra['cpu']:.2f}x in CPU "
              f"time), {ra['peak_gb'] / rb['peak_gb']:.3f} of the peak memory", flush=True)
    for side, r in res.items():
        if r["profile"]:
            print(f"  where a {side} step's time goes (op self time, s; one profiled step):")
            for family, kind, t in sorted(r["profile"], key=lambda row: -row[2]):
                print(f"    {family + ' (' + kind + ')':40s}{t:8.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", nargs="?", default="all", choices=[*SIDES, "all"])
    add_model_flags(ap, "after --warmup")
    ap.set_defaults(seq=256, steps=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps run before the timed ones")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--group", type=int, default=4, help="grpo: completions sampled per prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="grpo: most tokens sampled per completion")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="dpo: prompt tokens (with --answer-len; else --seq); grpo: prompt tokens (else --seq // 2)")
    ap.add_argument("--answer-len", type=int, default=None, help="dpo: answer tokens, its eos included")
    ap.add_argument("--profile", action="store_true", help="after the timed steps, profile one glm5f step")
    ap.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("error: bench/posttrain.py compares with TRL (trl>=1.16), which this Python does not have: "
                         "pip install 'trl>=1.16', or the test extras: pip install -e '.[test]'")
    if args.threads:
        torch.set_num_threads(args.threads)
    for section in SIDES if args.section == "all" else [args.section]:
        run_section(section, args)


if __name__ == "__main__":
    main()
