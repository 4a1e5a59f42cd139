"""Train GLM-5 with glm5f: config -> params -> data -> [batch -> train_step -> log -> evaluate -> save].

    python train.py                      # glm5-tiny on the embedded text, CPU, about a minute
    python train.py --help               # every flag, with defaults
    python train.py --model.preset glm5-scaled-moe --data.type synthetic --train.steps 50
    python train.py --config recipes/tiny.yaml --train.steps 100   # a recipe (or a run's config.yaml), flags over it
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

import glm5f
from configs import Config, mesh_errors, parse, validate, with_data_type
from glm5f.run import preempt
from glm5f.run import rundir
from glm5f.posttrain import reference as dpo_reference
from glm5f.posttrain import grpo
from glm5f.posttrain import sampler
from glm5f.ckpt import checkpoint
from glm5f.model import lora
from glm5f.data.chat import RUN_TOKENIZER_DIR, ChatFormat, check_same_tokenizer, resolve_tokenizer
from glm5f.data import (PresetSource, check_first_batch, make_eval_source, make_source, make_tokenizer,
                        model_tokenizer, print_warning, readers, warnings_as_lines)
from glm5f.parallel.distributed import DistLayout
from glm5f.ckpt.hf.export import export_run
from glm5f.ckpt.hf.export_dir import note_base
from glm5f.ckpt.hf.load import check_loaded_finite
from glm5f.ckpt.hf.peft import save_peft
from glm5f.run.launch import (TIMEOUT_EXIT, StallWatch, WorkerFailure, check_device, collective_timeout, init_process,
                              silent_ranks, spawn, under_torchrun)
from glm5f.train.loss import eval_loss, unused_weights
from glm5f.run.metrics import MetricsLog, Progress, plot_losses, read_metrics
from glm5f.model.decoder import check_input_ids
from glm5f.train.optim import Optimizer, schedule_change, unused_flags
from glm5f.parallel.layout import Layout, full_tensor, local_tensor, nonfinite_counts
from glm5f.run.plan import rows_per_item
from glm5f.run.preflight import check_inputs, check_run
from glm5f.core.params import flatten, leaf_dtype, map_with_path, region_of
from glm5f.run.resume import check_resumable
from glm5f.run.recipe_file import write_config
from glm5f.posttrain.grpo import old_logprobs
from glm5f.objectives import objective
from glm5f.train.step import Trainer, TrainState, train_step


class TrainingError(ValueError):
    """A run stopped for a reason the user has to act on (the message says what)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device)
    return check_device(torch.device(name), "--train.device")


@contextlib.contextmanager
def user_errors():
    """Bad input (a missing file, a malformed record, a mismatched checkpoint) stops the run with its message."""
    try:
        yield
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise TrainingError(str(e)) from e


@contextlib.contextmanager
def writing(path: str, run_dir: str):
    """Writing one of the run's files (metrics.jsonl, config.yaml, an export): a full disk or another I/O error
    stops the run with a line naming the file, the cause and the last checkpoint."""
    try:
        yield
    except OSError as e:
        why = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
        fix = "free some space" if e.errno == errno.ENOSPC else "fix the cause"
        raise TrainingError(f"could not write {path}: {why}; {fix}; {checkpoint.last_line(run_dir)}") from None


@contextlib.contextmanager
def out_of_memory(step: int, layout: Layout, cfg: Config):
    """Running out of device memory in a step stops the run with one line: the allocation, the step and what to
    change (the allocator's own report stays in the exception chain)."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:  # CUDA's OutOfMemoryError; the CPU allocator's RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and "not enough memory" not in str(e):
            raise
        size = re.search(r"[Tt]ried to allocate ([\d.]+ \w+)", str(e))
        what = size.group(1) if size else "memory"
        if what.endswith(" bytes"):
            what = f"{int(what.split()[0]) / 2**30:.2f} GiB"
        p = cfg.parallel
        raise TrainingError(
            f"step {step}: out of memory on {layout.device} trying to allocate {what} "
            f"(micro-batch {cfg.data.batch_size // (cfg.train.grad_accum * p.dp_shard)} x {cfg.data.seq_len} tokens "
            f"per rank); lower --data.batch_size or --data.seq_len, raise --train.grad_accum, turn on "
            f"--train.activation_checkpointing, or shard over more ranks; `python train.py --plan table` with the "
            f"same flags shows where the memory goes") from e


def train(cfg: Config, layout: Layout | None = None) -> list[dict]:
    """Run the training `cfg` describes (already validated) on `layout` (default: one process); returns the
    metrics records of the steps it ran."""
    cfg = with_data_type(cfg)
    layout = layout or Layout(resolve_device(cfg.train.device))
    say = print if layout.is_main else (lambda *a, **k: None)
    with user_errors():  # the run's one tokenizer and template: data, checkpoints, exports all use it
        tokenizer = resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    with user_errors():
        rundir.prepare_run_dir(cfg, layout, say, tokenizer.names())
    torch.manual_seed(cfg.train.seed)
    model_cfg, params = init_params(cfg, layout)
    spec = cfg.lora.spec()
    # a LoRA run trains its adapters (a flat tree of their own) beside the frozen base; else the params train
    trained, frozen = (init_adapters(cfg, spec, params, layout), params) if spec else (params, None)
    base = lora_base(cfg, params, layout) if spec else None
    unused = unused_weights(cfg.train, model_cfg) + unused_flags(cfg.optim, lora=bool(spec))
    for message in unused if layout.is_main else ():
        print_warning(message)
    trainer = Trainer.of(cfg, model_cfg, layout, objective(cfg.train.objective))
    reference = init_reference(cfg, model_cfg, params, layout) \
        if trainer.step.objective.needs_reference(trainer.step.settings) else None
    data, eval_batches = make_data(cfg, model_cfg, layout, say, tokenizer.path)
    if cfg.dpo.precompute_reference:  # the reference's sums go with the data; its weights are freed
        precompute_reference(cfg, model_cfg, reference, data, trainer, say, tokenizer)
        reference = None
    state = trainer.init(trained, frozen, reference)
    state, last_ckpt = resume(cfg, model_cfg, state, base, trainer.optimizer, data, say, tokenizer)
    start = state.step
    if start >= cfg.train.steps:
        say(f"nothing to do: step {start} >= --train.steps {cfg.train.steps}")
        export(cfg, model_cfg, state, layout, say, tokenizer)
        return read_metrics(cfg.checkpoint.dir)
    log = MetricsLog(cfg.checkpoint.dir, start, print_warning) if layout.is_main else None
    progress = Progress(cfg.train.steps, start, cfg.train.log_every) if layout.is_main else None
    say(f"glm5f: {cfg.model.init_from or cfg.model.preset} ({glm5f.param_count(model_cfg):,} parameters), "
        f"{cfg.data.type} data, {batch_sizes(cfg, data)}, {cfg.train.dtype} on "
        f"{layout.device} x{layout.world} (dp_shard {cfg.parallel.dp_shard} x cp {cfg.parallel.cp}, ep "
        f"{cfg.parallel.ep}), steps {start}->{cfg.train.steps}, run dir {cfg.checkpoint.dir}")
    say(f"tokenizer: {tokenizer.how}")
    if spec:
        say(f"LoRA: rank {spec.rank}, alpha {spec.alpha:g}, {len(trained) // 2} adapted weights, "
            f"{sum(t.numel() for t in trained.values()):,} trained parameters; the base frozen in "
            f"{str(next(iter(flatten(params).values())).dtype).replace('torch.', '')}")
    meta = {"model": model_cfg.to_hf(), "run": dataclasses.asdict(cfg), "optimizer": trainer.optimizer.meta,
            "tokenizer": tokenizer.fingerprint(), **({"lora_base": base} if base else {})}
    warn = print_warning if layout.is_main else (lambda message: None)
    records = []
    per_batch = cfg.rl.updates_per_batch if cfg.train.objective == "grpo" else 1
    batch = resumed_batch(last_ckpt, layout) if start % per_batch else None  # resumed between a batch's updates
    for i in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        sample_time = 0.0
        if batch is None or i % per_batch == 0:
            with user_errors():  # a streamed record is read, and checked, when a batch needs it
                if isinstance(data, sampler.PromptSource):  # sampled now, by the policy this step trains
                    batch = data.next_batch(decoding_params(state, cfg, spec), layout)
                    sample_time = time.perf_counter() - t0
                else:
                    batch = data.next_batch()
                batch = {k: v.to(layout.device) for k, v in batch.items()}
            if per_batch > 1:  # the ratio's old log-probabilities: the policy's before the batch's first update
                batch["old_targets"] = old_logprobs(state.params, batch, model_cfg, layout, trainer.step)
        check_input_ids(batch["input_ids"], model_cfg)
        if i == start:
            with user_errors():
                check_first_batch(batch, i, cfg.data.path or cfg.data.type)
        if i == start and cfg.train.compile:
            say("compiling the step (the first step takes a while; the next ones reuse it)...", flush=True)
        no_signal = "reward" in batch and not trainer.step.settings.kl_beta and not grpo.has_signal(batch)
        if no_signal:
            say(f"step {i + 1}: every group's completions have the same reward, so every advantage is 0 and there "
                f"is nothing to learn; skipping this step's update")
        with out_of_memory(i + 1, layout, cfg):
            state, metrics = train_step(
                state, batch, trainer,
                skip=lambda m: check_step(cfg, i + 1, m["loss"], m["grad_norm"], last_ckpt, say) or no_signal,
                inspect=(lambda grads: check_gradients(grads, layout, warn)) if i == start else None)
        skipped = metrics.pop("skipped", False)
        dt = time.perf_counter() - t0
        tokens = batch["input_ids"].numel()
        rec = {"step": i + 1, **metrics, "tokens": tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
               **({"sample_time_s": sample_time} if isinstance(data, sampler.PromptSource) else {}),
               **({"skipped": True} if skipped else {})}
        if eval_batches and ((i + 1) % cfg.eval.every == 0 or i + 1 == cfg.train.steps):
            if cfg.train.compile and not any("eval_loss" in r for r in records):  # no gradients: other graphs
                say("compiling the evaluation (the first one takes a while; the next ones reuse it)...", flush=True)
            rec["eval_loss"] = eval_loss(state.params, eval_batches, model_cfg, layout, trainer.step)
            rec["eval_ppl"] = math.exp(rec["eval_loss"]) if rec["eval_loss"] < 700 else math.inf
        records.append(rec)
        if layout.is_main:
            with writing(log.path, cfg.checkpoint.dir):
                log.write(rec)
            if i == start:  # beside the first metrics record, so a run that fails before it leaves nothing
                with writing(os.path.join(cfg.checkpoint.dir, rundir.CONFIG_FILE), cfg.checkpoint.dir):
                    write_config(cfg)
                    tokenizer.write(os.path.join(cfg.checkpoint.dir, RUN_TOKENIZER_DIR))
                    if cfg.model.init_from:
                        note_base(cfg.model.init_from, cfg.checkpoint.dir)
            progress.update(i + 1, rec)
        layout.step_done(i + 1)
        stop = preempt.should_stop(layout)  # SIGTERM on any rank: all save this step, then stop
        if stop or (cfg.checkpoint.every and (i + 1) % cfg.checkpoint.every == 0) or i + 1 == cfg.train.steps:
            check_finite(state.trained, layout, i + 1, last_ckpt)
            last_ckpt = checkpoint.save(
                cfg.checkpoint.dir, i + 1, state.saved(),
                extra={"step": i + 1, "data": data.state_dict(), "rng": checkpoint.rng_state(),
                       **({"batch": {k: v.cpu() for k, v in batch.items()}} if (i + 1) % per_batch else {})},
                meta=meta, keep=cfg.checkpoint.keep)
        if stop:
            raise preempt.Preempted(i + 1, last_ckpt)
    report(cfg, layout, say)
    export(cfg, model_cfg, state, layout, say, tokenizer)
    return records


def resumed_batch(ckpt: str | None, layout: Layout) -> dict:
    """The batch a checkpoint taken between a batch's updates (--rl.updates_per_batch) was training on, with its
    old log-probabilities, on the layout's device."""
    saved = checkpoint.read_extra(ckpt).get("batch") if ckpt else None
    if saved is None:
        raise TrainingError(f"{ckpt}: taken between the updates of a batch (--rl.updates_per_batch), but it holds no "
                            f"batch; resume with the --rl.updates_per_batch it was saved with")
    return {k: v.to(layout.device) for k, v in saved.items()}


def decoding_params(state: TrainState, cfg: Config, spec: lora.LoraSpec | None) -> dict:
    """The policy's weights as the on-policy sampler decodes with them: whole on every rank (gathered one leaf at
    a time under a multi-process layout: collective), each leaf in the compute dtype (the fp32 leaves of
    `params.leaf_kinds()` stay fp32), a LoRA run's adapters merged into a copy of its base."""
    act = getattr(torch, cfg.train.dtype)
    whole = lambda tree: map_with_path(  # noqa: E731
        lambda path, t: full_tensor(t.detach()).to(leaf_dtype(path, act)), tree)
    return lora.merge(whole(state.frozen), whole(state.trained), spec) if spec else whole(state.trained)


def batch_sizes(cfg: Config, data) -> str:
    """The batch x sequence sizes the run trains on, for its start line: those of --data.path's batches (one or
    several) for preset_pt data, else --data.batch_size x --data.seq_len."""
    if isinstance(data, PresetSource):
        return " or ".join(f"{B}x{S}" for B, S in data.shapes) + f" tokens/step (the batches of {cfg.data.path})"
    if cfg.train.objective == "grpo":
        return (f"{cfg.data.batch_size} groups of {rows_per_item(cfg)} completions x {cfg.data.seq_len} "
                f"tokens/step")
    return f"{cfg.data.batch_size}x{cfg.data.seq_len} tokens/step"


# ---- the run's edges ----------------------------------------------------------------------------------------------

def init_params(cfg: Config, layout: Layout) -> tuple[glm5f.GLM5Config, dict]:
    """(model config, params as the layout stores them): a preset (with overrides) or a Transformers checkpoint;
    fp32 master parameters (fp64 in fp64 runs; a LoRA run's frozen base in --lora.base_dtype); each rank makes or
    reads only its own shards."""
    master = torch.promote_types(getattr(torch, cfg.train.dtype), torch.float32)
    if cfg.lora.rank and cfg.lora.base_dtype:
        master = getattr(torch, cfg.lora.base_dtype)
    if not cfg.model.init_from:
        model_cfg = cfg.model.build()
        return model_cfg, layout.local_params(
            lambda region: glm5f.init_params(model_cfg, cfg.train.seed, master, layout.device, region))
    if cfg.model.overrides():
        raise TrainingError(f"--model.init_from takes the config from the checkpoint; drop the overrides "
                            f"{sorted(cfg.model.overrides())}")
    loaded = {}

    def load(region):
        loaded["cfg"], p = glm5f.load_hf(cfg.model.init_from, dtype=master, device=layout.device, region=region)
        return p
    with user_errors():
        params = layout.local_params(load)
        check_loaded_finite(params, cfg.model.init_from, layout.sum)
    return loaded["cfg"], params


def init_reference(cfg: Config, model_cfg: glm5f.GLM5Config, params: dict, layout: Layout) -> dict:
    """The reference model an objective compares with (DPO's), as the layout stores the params: a LoRA run's base
    itself (the adapters off: no copy); else --dpo.reference's weights, or a copy of the run's starting weights,
    each leaf in the compute dtype (the fp32 leaves of `params.leaf_kinds()` stay fp32). Made before any resume
    loads trained weights into the params."""
    if cfg.lora.rank:
        return params
    act = getattr(torch, cfg.train.dtype)
    if cfg.dpo.reference:
        loaded = {}

        def load(region):
            loaded["cfg"], p = glm5f.load_hf(cfg.dpo.reference, device=layout.device, region=region)
            return p
        with user_errors():
            ref = layout.local_params(load)
        ref_cfg = loaded["cfg"]
        if ref_cfg.to_hf() != model_cfg.to_hf():
            raise TrainingError(f"--dpo.reference {cfg.dpo.reference} is another model than the one trained (its "
                                f"config.json differs); pass a checkpoint of the same architecture")
        params = ref
    return map_with_path(lambda path, t: t.detach().to(leaf_dtype(path, act), copy=True), params)


def precompute_reference(cfg: Config, model_cfg: glm5f.GLM5Config, reference: dict, data, trainer: Trainer, say,
                         tokenizer) -> None:
    """--dpo.precompute_reference: the reference's summed answer log-probabilities of every pair, handed to the
    data (`PairSource.use_reference`): read from the run directory's dpo_reference.safetensors when it was made
    from this data (the file's fingerprint, --data.seq_len, the tokenizer and template) and this reference (its
    weights' fingerprint, the model config, --train.dtype and reduce_dtype), else computed in one pass (`dpo_reference.compute`)
    and written there by rank 0. Every rank reuses the file, or none does. Collective."""
    layout = trainer.layout
    fingerprint = {"data": readers.fingerprint(cfg.data.path), "seq_len": cfg.data.seq_len,
                   "tokenizer": tokenizer.fingerprint(), "reference": checkpoint.fingerprint(reference, layout.sum),
                   "model": model_cfg.to_hf(), "dtype": [cfg.train.dtype, cfg.train.reduce_dtype]}
    path = os.path.join(cfg.checkpoint.dir, dpo_reference.FILE)
    table, why = dpo_reference.load(path, fingerprint, len(data.pairs))
    if int(layout.sum(torch.tensor(float(table is not None), device=layout.device))) == layout.world:
        say(f"reference log-probabilities: reusing {path} (the same data and reference)")
    else:
        why = why or f"another rank could not read {path}"
        say(f"reference log-probabilities: {why}; computing them ({len(data.pairs)} pairs)", flush=True)
        step = trainer.step
        table = dpo_reference.compute(reference, data, model_cfg, layout, step,
                                      cfg.data.batch_size // step.grad_accum, lambda line: say(line, flush=True))
        if layout.is_main:
            with writing(path, cfg.checkpoint.dir):
                os.makedirs(cfg.checkpoint.dir, exist_ok=True)
                dpo_reference.save(path, table, fingerprint)
    data.use_reference(table)


def init_adapters(cfg: Config, spec: lora.LoraSpec, params: dict, layout: Layout) -> dict:
    """A LoRA run's fresh adapters (`lora.init_adapters`, seeded by --train.seed) as the layout stores them, in
    the master dtype (fp32, fp64 in fp64 runs), whatever the base's."""
    master = torch.promote_types(getattr(torch, cfg.train.dtype), torch.float32)
    with user_errors():
        whole = lora.init_adapters(params, spec, cfg.train.seed, master)
    return layout.local_params(lambda region: {p: t[region_of(region, p, tuple(t.shape))].to(layout.device)
                                               for p, t in whole.items()})


def lora_base(cfg: Config, params: dict, layout: Layout) -> dict:
    """What names a LoRA run's frozen base in its checkpoints: where it comes from (--model.init_from, or the
    preset and --train.seed of a fresh init) and the fingerprint of its values (checked on resume)."""
    source = cfg.model.init_from or f"{cfg.model.preset} initialised with --train.seed {cfg.train.seed}"
    return {"source": source, "fingerprint": checkpoint.fingerprint(params, layout.sum)}


def make_data(cfg: Config, model_cfg: glm5f.GLM5Config, layout: Layout, say, tokenizer_path: str | None):
    """(the training source, the held-out batches: [] without evaluation), tokenized by the run's tokenizer."""
    warn = print_warning if layout.is_main else (lambda message: None)
    d = cfg.data
    common = dict(vocab_size=model_cfg.vocab_size, batch_size=d.batch_size, seq_len=d.seq_len, seed=d.seed,
                  tokenizer_path=tokenizer_path, pack=d.pack, shuffle_buffer=d.shuffle_buffer,
                  chat_template=d.chat_template, train_on=d.train_on, held_out=cfg.eval.split_fraction)
    if d.seq_len > model_cfg.max_position_embeddings:
        warn(f"--data.seq_len {d.seq_len} reaches past the model's max_position_embeddings "
             f"{model_cfg.max_position_embeddings}: positions past it are outside what its rope was made for")
    steps, warmup = cfg.train.steps, cfg.optim.warmup_steps
    if steps < warmup:
        warn(f"--train.steps {steps} ends inside the {warmup}-step warm-up (--optim.warmup_steps): the learning "
             f"rate peaks at {cfg.optim.lr * steps / warmup:.2e}, not --optim.lr {cfg.optim.lr:.2e}")
    if d.type == "prompts":
        with user_errors():
            return prompt_source(cfg, model_cfg, layout, tokenizer_path), []
    with user_errors():
        data = make_source(d.type, path=d.path, split=d.split, warn=warn, allow_changed=d.allow_changed,
                           model_cfg=model_cfg, share_prefixes=d.share_prefixes, **common)
        held_out = make_eval_source(d.type, path=cfg.eval.path, split=cfg.eval.split, train_path=d.path,
                                    train_split=d.split, **common)
        eval_batches = [] if held_out is None or not cfg.eval.every else \
            [{k: v.to(layout.device) for k, v in held_out.next_batch().items()} for _ in range(cfg.eval.batches)]
        for b in eval_batches:
            check_input_ids(b["input_ids"], model_cfg)
    if held_out is None and cfg.eval.every and d.type in ("preference", "rollouts"):
        say(f"no evaluation: the held-out loss is the LM loss of held-out text, and --train.objective "
            f"{cfg.train.objective} trains on {'preference pairs' if d.type == 'preference' else 'rollouts'} "
            f"(--eval.every 0 says so)")
    elif held_out is None and cfg.eval.every:
        say(f"no evaluation: {d.type} data has no held-out part; pass --eval.path (or --eval.split), or hold out a "
            f"part of --data.path with --eval.split_fraction")
    return data, eval_batches


def prompt_source(cfg: Config, model_cfg: glm5f.GLM5Config, layout: Layout, tokenizer_path: str | None):
    """--data.type prompts: the prompt records of --data.path, sampled each batch with the --rl flags, scored by
    --rl.reward; the sampling generator seeded by --train.seed."""
    d, r = cfg.data, cfg.rl
    tok = model_tokenizer(tokenizer_path, model_cfg.vocab_size)
    fmt = ChatFormat.load(tokenizer_path, d.chat_template)
    settings = sampler.SampleSettings(r.group_size, r.temperature, r.top_p, r.max_new_tokens, r.replayed)
    reward = sampler.load_reward(r.reward)
    return sampler.PromptSource(sampler.read_prompts(d.path, tok, fmt), d.batch_size, d.seq_len, model_cfg, d.seed,
                                tok.pad_id, settings, reward, f"--rl.reward {r.reward}", tok, cfg.train.seed,
                                layout.device)


def resume(cfg: Config, model_cfg: glm5f.GLM5Config, state: TrainState, base: dict | None, optimizer: Optimizer,
           data, say, tokenizer=None) -> tuple[TrainState, str | None]:
    """(the state to start from, the checkpoint it comes from or None): with --checkpoint.resume, the newest
    complete checkpoint's trained tree, optimizer state and step (checked against this run's model, data type,
    trained leaves, objective, optimizer, a LoRA run's base and the tokenizer and template `tokenizer`), with the
    data position and RNG states restored; else `state`."""
    if not cfg.checkpoint.resume:
        return state, None
    with user_errors():
        ckpt, note = checkpoint.choose(cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.trust_unverified)
    if note:
        say(note)
    if ckpt is None:
        say(f"no checkpoint in {cfg.checkpoint.dir}/checkpoints: starting from step 0")
        return state, None
    with user_errors():
        meta = checkpoint.read_meta(ckpt)
        check_resumable(cfg, model_cfg, state.params, meta, base, optimizer, ckpt)
    saved = meta.get("run") or {}
    if tokenizer is not None:
        with user_errors():
            check_same_tokenizer(meta.get("tokenizer"), tokenizer, ckpt, cfg.data.allow_changed, print_warning)
    trees = state.saved()
    with user_errors():
        extra = checkpoint.load(ckpt, trees)
    try:
        with user_errors():
            data.load_state_dict(extra["data"])
    except (KeyError, TypeError) as e:
        raise TrainingError(f"{ckpt}: its data position does not fit --data.type {cfg.data.type} (no {e}); resume "
                            f"with the --data flags it was saved with") from None
    checkpoint.set_rng_state(extra["rng"])
    say(f"resumed from {ckpt} at step {extra['step']}")
    note = schedule_change(saved, cfg.optim, cfg.train, extra["step"])
    if note and extra["step"] < cfg.train.steps:  # a run with no step left has no learning rate to change
        say(note)
    return state.restored(trees, extra["step"]), ckpt


def check_step(cfg: Config, step: int, loss: float, grad_norm: float, last_ckpt: str | None, say) -> bool:
    """Whether step `step` is skipped: a NaN/inf loss or gradient norm stops the run before the update, or with
    --train.skip_nonfinite skips it."""
    bad = [f"the {name} is {v}" for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)]
    if bad and not cfg.train.skip_nonfinite:
        raise TrainingError(f"step {step}: {' and '.join(bad)}; stopping before the update. The last good "
                            f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}; resume from it with "
                            f"a lower --optim.lr, or pass --train.skip_nonfinite to skip such steps")
    if bad:
        say(f"step {step}: {' and '.join(bad)}; skipping this step's update (--train.skip_nonfinite)")
    return bool(bad)


def check_finite(params: dict, layout: Layout, step: int, last_ckpt: str | None) -> None:
    """Refuse to checkpoint parameters holding NaN or inf (counted over all ranks' shards)."""
    names = list(nonfinite_counts(params, layout.sum))
    if names:
        raise TrainingError(f"step {step}: non-finite values in {len(names)} parameter(s) ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''}); not writing a checkpoint of them. The last good "
                            f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}")


def check_gradients(grads: dict, layout: Layout, warn) -> None:
    """After the first step: a warning naming the trained leaves whose gradient is zero on every rank (nothing the
    loss computes depends on them, e.g. LoRA on the indexer without --train.indexer_loss). A LoRA weight counts by
    its lora_B (lora_A's gradient is zero while lora_B is, as it starts)."""
    flat = {p: g for p, g in flatten(grads).items() if not p.endswith(".lora_A")}
    if not flat:
        return
    nonzero = layout.sum(torch.stack([(local_tensor(g) != 0).sum() for g in flat.values()]).to(torch.float64))
    dead = [p.removesuffix(".lora_B") for p, n in zip(flat, nonzero.tolist()) if n == 0]
    if dead:
        named = ", ".join(dead[:4]) + (", ..." if len(dead) > 4 else "")
        warn(f"{len(dead)} of the {len(flat)} trained leaves got no gradient in the first step ({named}): "
             f"the loss does not depend on them, so they will not train; drop them from --lora.targets / "
             f"--train.trainable, or turn on the loss that uses them (e.g. --train.indexer_loss for the indexer)")


def report(cfg: Config, layout: Layout, say) -> None:
    """The run's loss curve (loss.png) and a summary of its metrics.jsonl."""
    if not layout.is_main:
        return
    run_dir = cfg.checkpoint.dir
    history = read_metrics(run_dir)
    png = os.path.join(run_dir, "loss.png")
    try:
        if plot_losses({os.path.basename(os.path.abspath(run_dir)): history}, png):
            say(f"loss curve: {png}")
        else:
            say("no loss curve: matplotlib is not installed (pip install matplotlib)")
    except OSError as e:  # the run and its checkpoint are complete: the picture is not worth an error
        print_warning(f"no loss curve: could not write {png}: {e.strerror or e} "
                      f"({errno.errorcode.get(e.errno, e.errno)})")
    first, last = history[0], history[-1]
    say(f"done: loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})")
    if "reward" in first:
        say(f"reward: {first['reward']:.4f} (step {first['step']}) -> {last['reward']:.4f} (step {last['step']})")
    if "indexer_loss" in first:
        say(f"indexer: indexer_loss {first['indexer_loss']:.4f} -> {last['indexer_loss']:.4f}, "
            f"indexer_recall {first['indexer_recall']:.4f} -> {last['indexer_recall']:.4f}")
    evals = [r for r in history if "eval_loss" in r]
    if evals:
        say(f"held-out: eval_loss {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.2f}) at step "
            f"{evals[-1]['step']}")


def export(cfg: Config, model_cfg: glm5f.GLM5Config, state: TrainState, layout: Layout, say, tokenizer) -> None:
    """--checkpoint.export_hf: the weights (a LoRA run's merged into the base) as a Transformers checkpoint
    (`hf.export_run`, what scripts/convert.py writes from the run's last checkpoint; collective: the ranks gather
    one leaf at a time, rank 0 writes; a GLM-5.3 run copies the tensors of --model.init_from that are not its
    text model's). --checkpoint.export_peft: a LoRA run's adapters as a PEFT adapter directory (`hf.save_peft`:
    the ranks gather them, rank 0 writes). Both carry the run's tokenizer files and chat template."""
    spec = cfg.lora.spec()
    params, adapters = (state.frozen, state.trained) if spec else (state.trained, None)
    files = ()
    if layout.is_main and (cfg.checkpoint.export_hf or cfg.checkpoint.export_peft):
        here = os.path.join(cfg.checkpoint.dir, RUN_TOKENIZER_DIR)
        with writing(here, cfg.checkpoint.dir), user_errors():
            files = tuple(os.path.join(here, n) for n in tokenizer.write(here))
    if cfg.checkpoint.export_hf:
        tok = make_tokenizer(tokenizer.path)
        with user_errors(), writing(cfg.checkpoint.export_hf, cfg.checkpoint.dir):
            weights = lora.merge(params, adapters, spec) if spec else params
            export_run(cfg.checkpoint.export_hf, model_cfg, weights, init_from=cfg.model.init_from,
                       token_ids={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
                       token_files=files, write=layout.is_main, overwrite=cfg.checkpoint.replace_export)
        say(f"exported Transformers checkpoint{' (adapters merged)' if spec else ''}: {cfg.checkpoint.export_hf}")
    if cfg.checkpoint.export_peft:
        with user_errors(), writing(cfg.checkpoint.export_peft, cfg.checkpoint.dir):
            save_peft(cfg.checkpoint.export_peft, model_cfg, adapters, spec,
                      base_model_name_or_path=cfg.model.init_from, write=layout.is_main, extra_files=files,
                      overwrite=cfg.checkpoint.replace_export)
        say(f"exported PEFT adapter: {cfg.checkpoint.export_peft}")


# ---- the command line ---------------------------------------------------------------------------------------------

def run_rank(argv: list[str], torchrun: bool = False) -> None:
    """One process of a multi-process run: spawned by main (which holds the run directory's lock and names the
    ranks that stop answering), or started by torchrun (then rank 0 holds the lock for all, and on a collective
    timeout the ranks that timed out name, in one line, those that did not)."""
    cfg = parse(argv)
    device = init_process(resolve_device(cfg.train.device), cfg.parallel.timeout_s)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    p = cfg.parallel
    with preempt.handling(cfg.checkpoint.preempt_grace_s, launched=not torchrun):
        try:
            with rundir.shared_run_lock(cfg.checkpoint.dir) if torchrun else contextlib.nullcontext():
                watch = StallWatch(cfg.parallel.timeout_s)  # its thread runs from `with` on
                layout = DistLayout(p.dp_shard, p.cp, p.ep, device, on_step=watch.step_done)
                with watch:
                    train(cfg, layout)
        except (preempt.Preempted, preempt.StopNow) as e:  # every rank stops here; rank 0 says where
            stopped(e, cfg, argv)
        except Exception as e:
            if preempt.stopped_now():  # the collective of a peer that stopped on the same second SIGTERM
                stopped(preempt.stopped_now(), cfg, argv)
            if torchrun and preempt.interrupted():  # a peer that stopped on the same Ctrl-C: main says it once
                raise KeyboardInterrupt from None
            if not torchrun or not collective_timeout(e):
                raise
            report_timeout(cfg, e)
            raise SystemExit(TIMEOUT_EXIT) from None


def stopped(e: BaseException, cfg: Config, argv: list[str]) -> None:
    """A rank of a multi-process run stops on SIGTERM (Preempted after the save, StopNow without one): rank 0 says
    where, and every rank exits 143."""
    if os.environ.get("RANK") == "0":
        print(e.message(argv) if isinstance(e, preempt.Preempted) else
              interrupted_line(f"{e} (without saving)", cfg.checkpoint.dir, argv), file=sys.stderr, flush=True)
    raise SystemExit(preempt.SIGNAL_EXIT[signal.SIGTERM]) from None


def interrupted_line(why: str, run_dir: str, argv: list[str]) -> str:
    """The one line a run stopped at once (Ctrl-C, StopNow) prints: why, its last checkpoint, how to resume."""
    last = checkpoint.latest(run_dir)
    if last is None:
        return f"stopped {why}: no checkpoint was written in {run_dir}; start again with the same command"
    return f"stopped {why}: the last checkpoint is {last}; resume with: {preempt.resume_command(argv)}"


def report_timeout(cfg: Config, e: Exception) -> None:
    """Under torchrun, after this rank's collective timed out: the lowest rank that timed out prints one line
    naming the ranks that did not (they stopped answering) and the last checkpoint; the others print nothing."""
    last = checkpoint.last_line(cfg.checkpoint.dir)
    found = silent_ranks()
    if found is None:  # the store is gone too (it lived in a rank that stopped): what this rank's error says
        print(f"error: [rank {dist.get_rank()}] {collective_timeout(e)}; {last}", file=sys.stderr, flush=True)
        return
    answered, silent = found
    if dist.get_rank() == min(answered):
        who = (f"rank(s) {', '.join(map(str, silent))} stopped answering (hung, stopped or dead)" if silent else
               "every rank timed out waiting for the others (each in another collective)")
        print(f"error: a collective timed out after --parallel.timeout_s {cfg.parallel.timeout_s}: {who}; {last}",
              file=sys.stderr, flush=True)


def plan_run(cfg: Config) -> None:
    """--plan: print the memory plan of the run the other flags describe (nothing allocated, nothing written)."""
    from glm5f.run.plan import print_plan

    model_cfg = glm5f.GLM5Config.from_hf(cfg.model.init_from) if cfg.model.init_from else cfg.model.build()
    blocking = mesh_errors(cfg, model_cfg)
    if blocking:
        raise TrainingError(f"--plan needs a mesh: {'; '.join(blocking)}")
    print_plan(cfg, cfg.plan, model_cfg, plan_device(cfg.train.device), cfg.model.init_from or cfg.model.preset)


def plan_device(name: str) -> torch.device:
    """The device --plan plans for: --train.device as named, present or not (the plan allocates nothing, so
    `--plan search --train.device cuda` runs on a machine without a GPU); auto is the one a run would take."""
    if name == "auto":
        return resolve_device(name)
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise TrainingError(f"--train.device {name!r} is not a device torch knows ({e}); pass cpu, cuda or "
                            f"cuda:N") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings_as_lines()
    try:
        cfg = parse(argv, description=__doc__)
    except ValueError as e:  # a recipe file (--config) that does not fit Config
        print(f"error: {e}", file=sys.stderr)
        return 1
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.parallel.world
    try:
        errors = validate(cfg, world_size=world)
        if cfg.plan:  # the plan of what the flags describe, with what a run of them would refuse
            for e in errors:
                print_warning(f"a run of these flags would stop: {e}")
            with user_errors():
                plan_run(cfg)
            return 0
        if errors:  # before any process starts
            raise TrainingError("invalid configuration:\n  - " + "\n  - ".join(errors))
        cfg = with_data_type(cfg)
        rundir.check_run_paths(cfg)
        device = resolve_device(cfg.train.device)  # a device that is not there: one line, before any process starts
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun() else world  # ranks on this machine
        with user_errors():  # what the ranks would read first, and the memory they would hold, checked here
            check_inputs(cfg)
            if not cfg.train.skip_memory_check:
                check_run(cfg, device, local, spawned=not under_torchrun() and world > 1,
                          rank=int(os.environ.get("LOCAL_RANK", 0)))
        if under_torchrun():  # rank 0 holds the lock, once the process group is up (see run_rank)
            run_rank(argv, torchrun=True)
            return 0
        with rundir.run_lock(cfg.checkpoint.dir):
            if world > 1:
                spawn(run_rank, world, argv)
            else:
                with preempt.handling(cfg.checkpoint.preempt_grace_s):
                    train(cfg)
    except preempt.Preempted as e:
        print(e.message(argv), file=sys.stderr)
        return preempt.SIGNAL_EXIT[e.signum]
    except (preempt.StopNow, KeyboardInterrupt) as e:
        why = f"{e} (without saving)" if isinstance(e, preempt.StopNow) else "on Ctrl-C (SIGINT)"
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets Ctrl-C; rank 0 says it
            print(interrupted_line(why, cfg.checkpoint.dir, argv), file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    except WorkerFailure as e:
        print(f"error: {e}; {checkpoint.last_line(cfg.checkpoint.dir)}", file=sys.stderr)
        return 1
    except (TrainingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
