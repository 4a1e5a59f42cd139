"""Resuming a run: whether a checkpoint can be resumed by it (its meta.json read against the run's Config: model, data
type, trained leaves, objective, optimizer, LoRA flags and base, and every other setting by the table `RULES`; each
mismatch a ValueError saying what to pass), and `resume`, which loads the newest one into the run's state."""

from __future__ import annotations

import dataclasses
import difflib
import json

from glm5f.ckpt import checkpoint
from glm5f.core.config import GLM5Config
from glm5f.data import print_warning
from glm5f.data.chat import check_same_tokenizer
from glm5f.data.readers import check_same_files, file_changes, fingerprint
from glm5f.objectives import OBJECTIVES
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
    trained leaves, objective, optimizer, a LoRA run's base, the tokenizer and template `tokenizer`, and the other
    settings and the data file: `check_same_settings`, which sets `run.changes`), with the data position (and a
    batch between its updates: `Feed.load_state_dict`) and RNG states restored; else `state`. `run`: the run's
    edges (`setup.Run`)."""
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
        run.changes = check_same_settings(cfg, meta, ckpt, say, run.warn)
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


# ---- the settings a resume may change -----------------------------------------------------------------------------

FREE, ALLOW, OWN = "free", "allow", "own"
# How a config section's fields may differ on resume from the checkpoint's run: (its fields' rule, {field: another
# rule}). FREE: changes without a word (output, cadence, layout, numerics of the same step); ALLOW: refused unless
# --checkpoint.allow_changed names it (what the run trains on and how); OWN: refused by its own check
# (`check_resumable`, the tokenizer's), which that flag does not lift. The running objective's section (--dpo,
# --rl: its `settings`) is ALLOW, the other objectives' FREE (unread); a section not listed here is ALLOW.
RULES = {
    "model": (OWN, {}),
    "data": (ALLOW, {"type": OWN, "chat_template": OWN, "allow_changed": FREE, "share_prefixes": FREE}),
    "optim": (ALLOW, {"name": OWN, "schedule_steps": FREE}),
    "train": (ALLOW, {**dict.fromkeys(("objective", "trainable", "indexer_loss"), OWN),
                      **dict.fromkeys(("steps", "grad_accum", "query_parts", "reduce_dtype", "activation_checkpointing",
                                       "compile", "seed", "device", "log_every", "skip_nonfinite",
                                       "skip_memory_check"), FREE)}),
    "parallel": (FREE, {}),
    "checkpoint": (FREE, {}),
    "eval": (FREE, {"split_fraction": ALLOW}),
    "lora": (OWN, {"dropout": ALLOW}),
    "metrics": (FREE, {}),
}


def resume_rule(cfg, section: str, name: str) -> str:
    """FREE, ALLOW or OWN: how --section.name of run `cfg` may differ from its checkpoint's run (`RULES`)."""
    running = OBJECTIVES[cfg.train.objective].settings if cfg.train.objective in OBJECTIVES else None
    if section == running:
        return ALLOW
    if any(r.settings == section for r in OBJECTIVES.values()):
        return FREE
    default, fields = RULES.get(section, (ALLOW, {}))
    return fields.get(name, default)


def _sections(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, dict)}


def allow_changed_errors(cfg) -> list[str]:
    """What is wrong with --checkpoint.allow_changed: a name that is no flag, or one whose change it does not govern
    (FREE: it changes without it; OWN: no resume may change it). These are errors, as a name the run cannot use is
    a typo or a misunderstanding. A flag it names that then has the checkpoint's value is only a warning (at the
    resume): the resume command a preempted run prints repeats the flags, so a second resume after an allowed
    change names a flag that no longer differs."""
    sections, errs = _sections(cfg), []
    flags = [f"{s}.{f}" for s, fields in sections.items() for f in fields]
    for name in cfg.checkpoint.allowed:
        section, _, field = name.partition(".")
        if field not in sections.get(section, {}):
            near = difflib.get_close_matches(name, flags, n=1)
            errs.append(f"--checkpoint.allow_changed names {name}, which is not a flag"
                        f"{f' (did you mean {near[0]}?)' if near else ''}; name flags as section.field, e.g. "
                        f"dpo.beta,data.path")
        elif resume_rule(cfg, section, field) == FREE:
            errs.append(f"--checkpoint.allow_changed names {name}, which may change on resume without it; drop it")
        elif resume_rule(cfg, section, field) == OWN:
            errs.append(f"--checkpoint.allow_changed names {name}, which no resume may change (its own check names "
                        f"what to do); drop it, or start the next stage from the checkpoint's weights (export them "
                        f"with --checkpoint.export_hf DIR, then --model.init_from DIR)")
    return errs


@dataclasses.dataclass(frozen=True)
class Change:
    """A setting that differs from the checkpoint's run: `flag` section.field, its `old` and `new` values, and for
    the data file (`data.path`), what differs in its files (`files`)."""

    flag: str
    old: object
    new: object
    files: str = ""

    def __str__(self) -> str:
        shown = f"--{self.flag} {_show(self.old)} -> {_show(self.new)}"
        return f"{shown} ({self.files})" if self.files else shown

    def record(self, step: int) -> dict:
        """Its entry in the run's history (`changes` in meta.json and config.yaml): the new value from `from_step`
        on, the old one before it."""
        return {"from_step": step + 1, "flag": f"--{self.flag}", "old": self.old, "new": self.new,
                **({"files": self.files} if self.files else {})}


def _show(value) -> str:
    """A value as its flag takes it (a string bare unless empty or spaced, None as None)."""
    if value is None:
        return "None"
    return value if isinstance(value, str) and value and " " not in value else json.dumps(value)


def _plain(value):
    """`value` as meta.json holds it (tuples as lists), so a saved value and this run's compare equal."""
    return json.loads(json.dumps(value, default=str))


def data_files(cfg) -> list[dict] | None:
    """What a checkpoint records of the run's data file (`readers.fingerprint` of --data.path, for every data type
    that reads one; None: none)."""
    return fingerprint(cfg.data.path) if cfg.data.path else None


def changed_settings(cfg, meta: dict) -> list[Change]:
    """The ALLOW settings (`RULES`) of run `cfg` that differ from those of the run that saved the checkpoint of
    `meta`: each field of its config (meta's "run"), and the data file by its fingerprint ("data_files": another
    path to the same files is no change). A field or record the checkpoint lacks (written before it) is not
    compared."""
    saved, out = meta.get("run") or {}, []
    for section, fields in _sections(cfg).items():
        before = saved.get(section)
        if not isinstance(before, dict):
            continue
        for name, value in fields.items():
            if name not in before or resume_rule(cfg, section, name) != ALLOW:
                continue
            if (section, name) == ("data", "path"):
                if meta.get("data_files") is not None:
                    files = file_changes(meta["data_files"], value) if value else ["this run reads no file"]
                    if files:
                        out.append(Change("data.path", before[name], value, "; ".join(files[:3])))
            elif _plain(before[name]) != _plain(value):
                out.append(Change(f"{section}.{name}", before[name], value))
    return out


def check_same_settings(cfg, meta: dict, ckpt: str, say=print, warn=print_warning) -> list[dict]:
    """Checkpoint `ckpt` (its meta.json `meta`) continues run `cfg` only with the settings it was trained on
    (`changed_settings`), unless --checkpoint.allow_changed names each one that changed (the data file also with
    --data.allow_changed): else a ValueError in one line naming every changed flag, its old and new value, and
    how to allow it. Allowed changes are said in one line through `say` (a named flag that did not change: a
    warning through `warn`). Returns the run's history of changes: the checkpoint's (meta's "changes") with these
    appended (`Change.record`)."""
    step, allowed = meta.get("step", 0), set(cfg.checkpoint.allowed)
    if cfg.data.allow_changed:
        allowed.add("data.path")
    changes = changed_settings(cfg, meta)
    refused = [c for c in changes if c.flag not in allowed]
    if len(refused) == 1 and refused[0].flag == "data.path" and refused[0].old == refused[0].new:
        check_same_files(meta["data_files"], cfg.data.path, False)  # the data file alone: the data's own message
    if refused:
        names = ",".join(c.flag for c in changes)
        raise ValueError(f"{ckpt} was saved by a run with other settings: {'; '.join(map(str, refused))}. Resume "
                         f"with the checkpoint's values, or pass --checkpoint.allow_changed {names} to go on with "
                         f"these from step {step + 1} (config.yaml then records both), or start a new run")
    unchanged = sorted(set(cfg.checkpoint.allowed) - {c.flag for c in changes})
    if unchanged:
        warn(f"--checkpoint.allow_changed names {', '.join(unchanged)}, which the checkpoint's run already had: "
             f"nothing to allow")
    if changes:
        say(f"resuming at step {step} with changed settings: {'; '.join(map(str, changes))}; steps 1-{step} ran "
            f"with the old values, steps from {step + 1} run with the new (config.yaml records both)")
    return list(meta.get("changes") or []) + [c.record(step) for c in changes]
