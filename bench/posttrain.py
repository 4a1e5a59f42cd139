"""Post-training steps against TRL: a full-training DPO step of glm5f (`train_step` with --dpo.reference) against
TRL's DPOTrainer (ref_model= passed), the same Transformers checkpoint, reference, preference data and batch.

    python bench/posttrain.py dpo                          # the bench model (4 layers), 4 pairs x 256 tokens a side
    python bench/posttrain.py dpo --batch 2 --seq 512 --steps 8
    python bench/posttrain.py all                          # every section (dpo)
    python bench/posttrain.py dpo --threads 1 --profile    # and where glm5f's step time goes

A section writes, into a temporary directory, a Transformers GlmMoeDsaForCausalLM (save_pretrained) to train and
another to compare with (the reference), a word-level tokenizer both sides read, and a JSONL of --batch x
(--warmup + --steps) text records {"prompt", "chosen", "rejected"}: each sequence, prompt and answer, is --seq
tokens (no padding, no truncation on either side). Both sides train fp32, AdamW at --lr without weight decay, grad
norm clipped to 1, beta 0.1, without activation checkpointing (TRL's default turns it on, and bf16: both off here).
Each side runs in its own subprocess (its peak is its own): the median wall time of the steps after --warmup (the
optimizer step included, the batch's collation not) and their median CPU time (all the side's threads: on a shared
CPU the figure that does not depend on the load), the peak resident set size at the end of the last step, and the
peak after its imports (the libraries').
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import torch

from common import add_model_flags, add_run_flags, model_config, model_flags, run_child, serve_child, threads_of

BETA, SPECIALS = 0.1, ("<pad>", "<eos>")
TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "glm5f", "assets",
                        "glm5_chat_template.jinja")


def rss_gb() -> float:
    """This process's peak resident set size so far (ru_maxrss), GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- the inputs both sides read ---------------------------------------------------------------------------------

def write_inputs(args, root: str) -> dict:
    """The policy and reference checkpoints (Transformers' save_pretrained, different seeds; the tokenizer beside
    the policy) and the preference JSONL, in `root`: {"policy", "reference", "data"}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()
    cfg = model_config(args)
    paths = {"policy": os.path.join(root, "policy"), "reference": os.path.join(root, "reference"),
             "data": os.path.join(root, "pairs.jsonl")}
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
    prompt, answer = args.seq // 2, args.seq - args.seq // 2 - 1  # the answer's eos ends the sequence

    def text(n: int) -> str:
        return " ".join(words[i] for i in torch.randint(len(SPECIALS), cfg.vocab_size, (n,), generator=g).tolist())
    with open(paths["data"], "w") as f:
        for _ in range(args.batch * (args.warmup + args.steps)):
            f.write(json.dumps({"prompt": text(prompt), "chosen": " " + text(answer),
                                "rejected": " " + text(answer)}) + "\n")
    return paths


# ---- the sides --------------------------------------------------------------------------------------------------

def dpo_glm5f(args, paths: dict) -> tuple[list[float], float, float, dict]:
    """(seconds of each step, peak RSS GB after the last, RSS GB after the imports, with --profile one more step's
    op self time per (family, kind): `common.profile_split`): train.py's edges (params, reference, data) and
    `train_step`."""
    from configs import parse, with_data_type
    from glm5f.chat import resolve_tokenizer
    from glm5f.parallel import Layout
    from glm5f.step import Trainer, train_step
    from train import init_params, init_reference, make_data

    imported = rss_gb()
    cfg = with_data_type(parse([
        "--model.init_from", paths["policy"], "--dpo.reference", paths["reference"], "--train.objective", "dpo",
        "--data.type", "preference", "--data.path", paths["data"], "--data.batch_size", str(args.batch),
        "--data.seq_len", str(2 * args.seq), "--train.dtype", args.dtype, "--train.steps",
        str(args.warmup + args.steps), "--optim.name", "adamw", "--optim.lr", str(args.lr), "--optim.warmup_steps",
        "0", "--optim.weight_decay", "0", "--dpo.beta", str(BETA), "--eval.every", "0",
        "--data.chat_template", TEMPLATE]))  # not used by text records, but read whenever a tokenizer is given
    layout = Layout(args.device)
    tokenizer = resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    model_cfg, params = init_params(cfg, layout)
    trainer = Trainer.of(cfg, model_cfg, layout)
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
                           beta=BETA, loss_type=["sigmoid"], max_length=args.seq, bf16=False,
                           gradient_checkpointing=False, use_cpu=args.device == "cpu", save_strategy="no",
                           report_to=[], logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data, processing_class=tok,
                   callbacks=[Timer()]).train()
    return seconds, peak[0], imported, {}


SIDES = {"dpo": {"glm5f": dpo_glm5f, "trl": dpo_trl}}  # a section's sides, by name; glm5f first


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
        flags = [*model_flags(args), "--warmup", str(args.warmup), "--lr", str(args.lr), "--paths", json.dumps(paths),
                 *(["--profile"] if args.profile else [])]
        res = {side: run_child(here, ["--child", f"{section}:{side}", *flags], f"the {section} {side} side")
               for side in SIDES[section]}
    tokens = 2 * args.batch * args.seq
    print(f"{section}: {args.preset} ({cfg.num_hidden_layers} layers, index_topk {cfg.index_topk}), {args.batch} pair(s) "
          f"x 2 x {args.seq} tokens a step, full training with a reference model, {args.dtype} on {args.device} "
          f"({threads_of(args)} threads); median of {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'side':8s}{'s/step':>10s}{'tok/s':>10s}{'CPU s/step':>12s}{'peak RSS GB':>13s}{'after imports':>15s}")
    for side, r in res.items():
        r["median"], r["cpu"] = (statistics.median(x[i] for x in r["seconds"][args.warmup:]) for i in (0, 1))
        print(f"  {side:8s}{r['median']:10.3f}{tokens / r['median']:10.0f}{r['cpu']:12.3f}{r['peak_gb']:13.3f}"
              f"{r['imports_gb']:15.3f}")
    (a, ra), (b, rb) = res.items()
    print(f"  {a} / {b}: {rb['median'] / ra['median']:.2f}x the speed ({rb['cpu'] / ra['cpu']:.2f}x in CPU time), "
          f"{ra['peak_gb'] / rb['peak_gb']:.3f} of the peak memory", flush=True)
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
    ap.add_argument("--profile", action="store_true", help="after the timed steps, profile one glm5f step")
    ap.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    for section in SIDES if args.section == "all" else [args.section]:
        run_section(section, args)


if __name__ == "__main__":
    main()
