"""The pieces of train.py's loop, each behind a named call: the start lines, the batch's checks, the skip rule, a
step's record, the evaluation, the run's files and the checkpoint cadence (`Checkpoints`, which owns it)."""

from __future__ import annotations

import dataclasses
import math
import os

import glm5f
from glm5f.ckpt import checkpoint
from glm5f.ckpt.hf.export_dir import note_base
from glm5f.core.params import flatten
from glm5f.data import PresetSource, check_first_batch, print_warning
from glm5f.data.chat import RUN_TOKENIZER_DIR
from glm5f.model.decoder import check_input_ids
from glm5f.run import preempt, rundir
from glm5f.run.errors import check_finite, check_gradients, check_step, user_errors
from glm5f.run.metrics import Progress
from glm5f.run.trackers import Reporter
from glm5f.run.recipe_file import write_config
from glm5f.run.resume import data_files
from glm5f.train.loss import eval_loss


def say_start(run, state, start: int) -> None:
    """The run's start lines: the model, data, batch, layout and steps; the tokenizer; a LoRA run's adapters."""
    cfg, layout, spec = run.cfg, run.layout, run.spec
    run.say(f"glm5f: {cfg.model.init_from or cfg.model.preset} ({glm5f.param_count(run.model_cfg):,} parameters), "
            f"{cfg.data.type} data, {batch_sizes(run)}, {cfg.train.dtype} on "
            f"{layout.device} x{layout.world} (dp_shard {cfg.parallel.dp_shard} x cp {cfg.parallel.cp}, ep "
            f"{cfg.parallel.ep}), steps {start}->{cfg.train.steps}, run dir {cfg.checkpoint.dir}")
    run.say(f"tokenizer: {run.tokenizer.how}")
    if spec:
        base = state.frozen
        run.say(f"LoRA: rank {spec.rank}, alpha {spec.alpha:g}, {len(state.trained) // 2} adapted weights, "
                f"{sum(t.numel() for t in state.trained.values()):,} trained parameters; the base frozen in "
                f"{str(next(iter(flatten(base).values())).dtype).replace('torch.', '')}")


def batch_sizes(run) -> str:
    """The batch x sequence sizes the run trains on, for its start line: those of --data.path's batches (one or
    several) for preset_pt data, else the main objective's line (`Objective.batch_line`), else --data.batch_size x
    --data.seq_len."""
    cfg = run.cfg
    if isinstance(run.data, PresetSource):
        return " or ".join(f"{B}x{S}" for B, S in run.data.shapes) + f" tokens/step (the batches of {cfg.data.path})"
    return run.row.batch_line(cfg) or f"{cfg.data.batch_size}x{cfg.data.seq_len} tokens/step"


def check_batch(run, batch: dict, i: int, first: bool) -> None:
    """A batch's token ids fit the model; the run's first batch (of step index i) is checked for something to
    learn (and a compiled step says it compiles)."""
    check_input_ids(batch["input_ids"], run.model_cfg)
    if first:
        with user_errors():
            check_first_batch(batch, i, run.cfg.data.path or run.cfg.data.type)
        if run.cfg.train.compile:
            run.say("compiling the step (the first step takes a while; the next ones reuse it)...", flush=True)


def skip_rule(run, batch: dict, step: int, last_ckpt: str | None):
    """The `train_step` skip rule of step `step` (1-based): a non-finite loss or gradient norm stops the run
    (`errors.check_step`) or, with --train.skip_nonfinite, skips the update; so does the main objective's rule
    (`Objective.skip`: e.g. GRPO's batch with nothing to learn), said before the step."""
    why = run.row.skip(batch, run.trainer.step.settings)
    if why:
        run.say(f"step {step}: {why}; skipping this step's update")
    return lambda m: check_step(run.cfg, step, m["loss"], m["grad_norm"], last_ckpt, run.say) or why is not None


def first_step_check(run):
    """The look at the run's first update's gradients (`errors.check_gradients`: trained leaves that get none);
    train_step runs it only on a step it does not skip."""
    return lambda grads: check_gradients(grads, run.layout, run.warn)


def step_record(step: int, metrics: dict, batch: dict, seconds: float, feed_metrics: dict) -> dict:
    """The metrics record of step `step`: the step's metrics, its tokens and time, the feed's (e.g. the sampling
    time) and whether its update was skipped."""
    skipped = metrics.pop("skipped", False)
    tokens = batch["input_ids"].numel()
    return {"step": step, **metrics, "tokens": tokens, "tokens_per_s": tokens / seconds, "step_time_s": seconds,
            **feed_metrics, **({"skipped": True} if skipped else {})}


class Evaluation:
    """The held-out loss (eval_loss, eval_ppl) every --eval.every steps and at the last; nothing without held-out
    batches. The first evaluation of a compiled run says it compiles (no gradients: other graphs)."""

    def __init__(self, run):
        self.run, self.done = run, False

    def __call__(self, step: int, state) -> dict:
        run, cfg = self.run, self.run.cfg
        if not run.eval_batches or not (step % cfg.eval.every == 0 or step == cfg.train.steps):
            return {}
        if cfg.train.compile and not self.done:
            run.say("compiling the evaluation (the first one takes a while; the next ones reuse it)...", flush=True)
        self.done = True
        loss = eval_loss(state.params, run.eval_batches, run.model_cfg, run.layout, run.trainer.step)
        return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf}


class RunFiles:
    """The run's files beside its checkpoints, written by rank 0: each step's record (metrics.jsonl) and progress
    line, and the trackers --metrics.report_to names (`trackers.Reporter`); with the first record, config.yaml, the
    tokenizer files and the base's note (so a run that fails before it leaves nothing). A full disk stops the run
    naming the file (`errors.writing`)."""

    def __init__(self, run, start: int):
        cfg, main = run.cfg, run.layout.is_main
        self.run, self.first = run, True
        self.log = Reporter(cfg.metrics, cfg.checkpoint.dir, dataclasses.asdict(cfg), start, print_warning,
                            run.tokenizer.path, run.say) if main else None
        self.progress = Progress(cfg.train.steps, start, cfg.train.log_every) if main else None

    def write(self, rec: dict, batch: dict) -> None:
        if self.log is None:
            return
        run, run_dir = self.run, self.run.cfg.checkpoint.dir
        with run.writing(self.log.path):
            self.log.write(rec, batch)
        if self.first:
            with run.writing(os.path.join(run_dir, rundir.CONFIG_FILE)):
                write_config(run.cfg, run.changes)
                run.tokenizer.write(os.path.join(run_dir, RUN_TOKENIZER_DIR))
                if run.cfg.model.init_from:
                    note_base(run.cfg.model.init_from, run_dir)
            self.first = False
        self.progress.update(rec["step"], rec)

    def close(self) -> None:
        """The trackers' last writes (after the last step)."""
        if self.log is not None:
            self.log.close()


class Checkpoints:
    """The checkpoint cadence: a checkpoint every --checkpoint.every steps, at the last step, and at once when a
    SIGTERM on any rank asks the run to stop (all ranks save that step, then stop: `preempt.Preempted`). Each
    holds the state, the feed's (`Feed.state_dict`: the data position, a batch between its updates), the RNG
    states and the run's meta (its config, the data file's fingerprint and the settings changed on resume, which
    `resume.check_same_settings` reads); parameters holding NaN or inf are never saved. `last`: the newest
    checkpoint."""

    def __init__(self, run, last: str | None):
        cfg = run.cfg
        self.run, self.last = run, last
        self.meta = {"model": run.model_cfg.to_hf(), "run": dataclasses.asdict(cfg),
                     "optimizer": run.trainer.optimizer.meta, "tokenizer": run.tokenizer.fingerprint(),
                     "data_files": data_files(cfg), "changes": run.changes,
                     **({"lora_base": run.base} if run.base else {})}

    def due(self, step: int) -> bool:
        c = self.run.cfg.checkpoint
        return bool(c.every and step % c.every == 0) or step == self.run.cfg.train.steps

    def after(self, step: int, state) -> None:
        """After step `step` (1-based): save when due or asked to stop; then stop when asked."""
        run, c = self.run, self.run.cfg.checkpoint
        stop = preempt.should_stop(run.layout)
        if stop or self.due(step):
            check_finite(state.trained, run.layout, step, self.last)
            fed = run.feed.state_dict(step)
            self.last = checkpoint.save(c.dir, step, state.saved(),
                                        extra={"step": step, "data": fed.pop("data"), "rng": checkpoint.rng_state(),
                                               **fed}, meta=self.meta, keep=c.keep)
        if stop:
            raise preempt.Preempted(step, self.last)
