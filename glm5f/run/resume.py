"""Resuming a run: whether a checkpoint can be resumed by it (its meta.json read against the run's Config: model, data
type, trained leaves, objective, optimizer, LoRA flags and base; each mismatch a ValueError saying what to pass), and
`resume`, which loads the newest one into the run's state."""

from __future__ import annotations

import dataclasses

from glm5f.ckpt import checkpoint
from glm5f.core.config import GLM5Config
from glm5f.data import print_warning
from glm5f.data.chat import check_same_tokenizer
from glm5f.run.errors import TrainingError, user_errors
from glm5f.train.loss import Step
from glm5f.train.optim import Optimizer, schedule_change


def check_resumable(cfg, model_cfg: GLM5Config, params: dict, meta: dict, base: dict | None, optimizer: Optimizer,
                    ckpt: str) -> None:
    """Checkpoint `ckpt` (its meta.json `meta`) continues the run `cfg` (a configs.Config) describes: the same
    model config, data type, trained leaves of `params`, LoRA flags and base `base`, objective and optimizer."""
    if meta.get("model") != model_cfg.to_hf():
        raise ValueError(f"{ckpt} was saved for another model config; resume with the same --model flags (see its "
                         f"meta.json)")
    saved = meta.get("run") or {}
    check_same_data(cfg, saved, ckpt)
    check_same_trained(cfg, model_cfg, params, saved, ckpt)
    check_same_lora(cfg, saved, meta.get("lora_base"), base, ckpt)
    check_same_objective(cfg, saved, ckpt)
    check_same_optimizer(meta.get("optimizer", {"name": "adamw"}), optimizer, ckpt)


def check_same_data(cfg, saved: dict, ckpt: str) -> None:
    """A checkpoint's data position (an epoch/offset, a step, a batch index) means something only for the
    --data.type it was saved with."""
    kind = saved.get("data", {}).get("type")
    if kind is not None and kind != cfg.data.type:
        raise ValueError(f"{ckpt} was saved by a run on --data.type {kind}, not {cfg.data.type}: resume it with "
                         f"--data.type {kind}, or start a new run with another --checkpoint.dir")


def check_same_trained(cfg, model_cfg: GLM5Config, params: dict, saved: dict, ckpt: str) -> None:
    """A checkpoint's optimizer state covers the leaves its run trained (--train.trainable, and the indexer only
    with --train.indexer_loss); resuming it must train the same ones."""
    if not saved.get("train"):
        return
    then = dataclasses.replace(cfg.train, trainable=saved["train"].get("trainable"),
                               indexer_loss=saved["train"].get("indexer_loss", "off"))
    before, now = Step.of(then, model_cfg).trained(params), Step.of(cfg.train, model_cfg).trained(params)
    if before != now:
        raise ValueError(
            f"{ckpt} was saved by a run that trained {len(before)} leaves (--train.trainable {then.trainable!r}, "
            f"--train.indexer_loss {then.indexer_loss}); this run trains {len(now)} (--train.trainable "
            f"{cfg.train.trainable!r}, --train.indexer_loss {cfg.train.indexer_loss}), and the checkpoint's "
            f"optimizer state covers only the first set. Resume with its flags, or start the next stage from its "
            f"weights: export them (the same run with --checkpoint.export_hf DIR) and start a new run with "
            f"--model.init_from DIR")


def check_same_objective(cfg, saved: dict, ckpt: str) -> None:
    """A checkpoint continues only under the main objective it was trained on (a run before --train.objective
    trained lm); another objective is the next stage, started from its weights."""
    then = (saved.get("train") or {}).get("objective", "lm")
    if then != cfg.train.objective:
        raise ValueError(f"{ckpt} was saved by a run with --train.objective {then}, not {cfg.train.objective}: "
                         f"resume with --train.objective {then}, or start the next stage from its weights (export "
                         f"them with --checkpoint.export_hf DIR, then --model.init_from DIR)")


def check_same_optimizer(saved: dict, optimizer: Optimizer, ckpt: str) -> None:
    """A checkpoint's optimizer state is the state of the optimizer that saved it (its meta.json says which, and
    how it keeps it); another one cannot continue from it."""
    if saved != optimizer.meta:
        raise ValueError(f"{ckpt} holds the state of --optim.name {saved.get('name')} ({saved}), not of "
                         f"--optim.name {optimizer.name} ({optimizer.meta}): resume with --optim.name "
                         f"{saved.get('name')}, or start the next stage from its weights (export them with "
                         f"--checkpoint.export_hf DIR, then --model.init_from DIR)")


def check_same_lora(cfg, saved: dict, saved_base: dict | None, base: dict | None, ckpt: str) -> None:
    """A LoRA checkpoint holds adapters (of its rank and targets) for one base: resuming it needs the same LoRA
    flags and a base whose fingerprint is the one it was trained on; a full checkpoint resumes without LoRA."""
    then, now = saved.get("lora") or {}, cfg.lora
    same = then.get("rank", 0) == now.rank and (
        not now.rank or (then.get("alpha"), then.get("targets")) == (now.alpha, now.targets))
    if not same:
        raise ValueError(f"{ckpt} was saved by a run with --lora.rank {then.get('rank', 0)} --lora.alpha "
                         f"{then.get('alpha')} --lora.targets {then.get('targets')!r}; this run has --lora.rank "
                         f"{cfg.lora.rank} --lora.alpha {cfg.lora.alpha} --lora.targets {cfg.lora.targets!r}. "
                         f"Resume with its --lora flags")
    if base is not None and saved_base is not None and saved_base["fingerprint"] != base["fingerprint"]:
        raise ValueError(f"{ckpt} holds adapters trained on the base {saved_base['source']} (fingerprint "
                         f"{saved_base['fingerprint']}), but this run's base, {base['source']}, has fingerprint "
                         f"{base['fingerprint']}: its weights (or --lora.base_dtype) changed. Resume on the base "
                         f"it was trained on, or start a new run")


def resume(run, state) -> tuple[object, str | None]:
    """(the state to start from, the checkpoint it comes from or None): with --checkpoint.resume, the newest
    complete checkpoint's trained tree, optimizer state and step (checked against this run's model, data type,
    trained leaves, objective, optimizer, a LoRA run's base and the tokenizer and template `tokenizer`), with the
    data position (and a batch between its updates: `Feed.load_state_dict`) and RNG states restored; else
    `state`. `run`: the run's edges (`setup.Run`)."""
    cfg, model_cfg, say, tokenizer = run.cfg, run.model_cfg, run.say, run.tokenizer
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
        check_resumable(cfg, model_cfg, state.params, meta, run.base, run.trainer.optimizer, ckpt)
    saved = meta.get("run") or {}
    with user_errors():
        check_same_tokenizer(meta.get("tokenizer"), tokenizer, ckpt, cfg.data.allow_changed, print_warning)
    trees = state.saved()
    with user_errors():
        extra = checkpoint.load(ckpt, trees)
    try:
        with user_errors():
            run.feed.load_state_dict(extra, extra["step"], ckpt)
    except (KeyError, TypeError) as e:
        raise TrainingError(f"{ckpt}: its data position does not fit --data.type {cfg.data.type} (no {e}); resume "
                            f"with the --data flags it was saved with") from None
    checkpoint.set_rng_state(extra["rng"])
    say(f"resumed from {ckpt} at step {extra['step']}")
    note = schedule_change(saved, cfg.optim, cfg.train, extra["step"])
    if note and extra["step"] < cfg.train.steps:  # a run with no step left has no learning rate to change
        say(note)
    return state.restored(trees, extra["step"]), ckpt
