"""Experiment trackers beside metrics.jsonl (--metrics.report_to tensorboard,wandb,mlflow): the run's config as
hyperparameters, every metrics record as scalars, sampled completions (--metrics.log_completions) as tables.

Rank 0 only. Each tracker writes into the run directory: tensorboard/ (event files), wandb/ (W&B's run files; offline
without a login), mlflow.db and mlartifacts/ (a local MLflow store, unless MLFLOW_TRACKING_URI names another).
completions.jsonl holds the sampled completions with or without a tracker.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import time
from dataclasses import dataclass

from glm5f.core import IGNORE_INDEX
from glm5f.data.tokens import chat_tokenizer
from glm5f.run.metrics import MetricsLog

TRACKERS = ("tensorboard", "wandb", "mlflow")
COMPLETIONS_FILE = "completions.jsonl"


@dataclass
class MetricsConfig:
    """Where the metrics go beside metrics.jsonl."""

    report_to: str = ""
    """Trackers, comma-separated: tensorboard, wandb, mlflow (each needs its package installed)."""
    log_completions: int = 0
    """Sampled completions logged per step (prompt, completion, reward, length) to completions.jsonl and the
    trackers; 0: none."""

    @property
    def trackers(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.report_to.split(",") if t.strip())


def errors(m: MetricsConfig) -> list[str]:
    """What is wrong with the --metrics flags (none: [])."""
    out = [f"--metrics.report_to takes {', '.join(TRACKERS)} (comma-separated), found {t!r}"
           for t in m.trackers if t not in TRACKERS]
    if m.log_completions < 0:
        out.append(f"--metrics.log_completions must be >= 0, found {m.log_completions}")
    return out


def flat_config(config: dict, prefix: str = "") -> dict:
    """{"section.field": value} of a nested config dict, each value a number, a bool or a string (others as
    their JSON)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


def scalars(rec: dict) -> dict[str, float]:
    """The numbers of a metrics record (bools as 0/1), "step" aside."""
    return {k: float(v) for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}


def completion_rows(batch: dict, decode, n: int) -> list[dict]:
    """The first `n` completions of a GRPO batch: {"prompt", "completion" (text by `decode`), "reward", "length"
    (completion tokens)}; the prompt is the row's tokens before its first scored one, padding left out."""
    if n <= 0 or "reward" not in batch:
        return []
    rows = []
    for ids, labels, reward in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), batch["reward"].tolist()):
        scored = [i for i, t in enumerate(labels) if t != IGNORE_INDEX]
        if not scored:
            continue
        start, end = scored[0], scored[-1] + 1
        rows.append({"prompt": decode(ids[:start]), "completion": decode(ids[start:end]), "reward": reward,
                     "length": len(scored)})
        if len(rows) == n:
            break
    return rows


def _wandb_mode() -> str:
    """WANDB_MODE when set; else online with a login (WANDB_API_KEY, or the netrc entry `wandb login` writes),
    offline without."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class Reporter:
    """metrics.jsonl (`MetricsLog`), completions.jsonl and the trackers of `settings`, all started at the first
    record (a run that fails before it leaves the run directory as it was). `config` is the run's config (a nested
    dict); completions are decoded by the run's tokenizer (`tokenizer_path`; None: the byte tokenizer)."""

    def __init__(self, settings: MetricsConfig, run_dir: str, config: dict, resume_step: int = 0,
                 warn=lambda message: None, tokenizer_path: str | None = None, say=print):
        self.settings, self.run_dir, self.config, self.say = settings, run_dir, config, say
        self.decode = chat_tokenizer(tokenizer_path).decode if settings.log_completions else None
        self.metrics = MetricsLog(run_dir, resume_step, warn)
        self.completions = MetricsLog(run_dir, resume_step, warn, name=COMPLETIONS_FILE)
        self.path, self.open, self.started = self.metrics.path, {}, False

    def _start(self) -> None:
        name = os.path.basename(os.path.abspath(self.run_dir))
        hparams = flat_config(self.config)
        for tracker in self.settings.trackers:
            try:
                self.open[tracker] = getattr(self, f"_start_{tracker}")(name, hparams)
            except ImportError:
                raise ImportError(f"--metrics.report_to {tracker} needs its package: pip install {tracker} (or pip "
                                  f"install -e '.[trackers]' for all three)") from None
        self.started = True

    def _start_tensorboard(self, name: str, hparams: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
        for summary in hparams_summary(hparams, {}):
            writer.file_writer.add_summary(summary)
        return writer

    def _start_wandb(self, name: str, hparams: dict):
        import wandb

        mode = _wandb_mode()
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "glm5f"), name=name, dir=self.run_dir,
                         config=hparams, mode=mode)
        if mode == "offline":
            self.say(f"wandb: offline (no login): its run files are in {run.dir}; `wandb sync` uploads them")
        return run

    def _start_mlflow(self, name: str, hparams: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        here = os.path.abspath(self.run_dir)
        client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{here}/mlflow.db")
        experiment = client.get_experiment_by_name("glm5f")
        experiment_id = experiment.experiment_id if experiment else \
            client.create_experiment("glm5f", artifact_location=os.path.join(here, "mlartifacts"))
        run_id = client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in hparams.items()]
        for i in range(0, len(params), 100):  # MLflow takes 100 params a call
            client.log_batch(run_id, params=params[i:i + 100])
        return client, run_id

    def write(self, rec: dict, batch: dict | None = None) -> None:
        """Record `rec` (one step's metrics) everywhere, and the step's sampled completions from `batch`."""
        if not self.started:
            self._start()
        self.metrics.write(rec)
        step, values = rec["step"], scalars(rec)
        rows = completion_rows(batch, self.decode, self.settings.log_completions) if batch is not None else []
        for row in rows:
            self.completions.write({"step": step, **row})
        if "tensorboard" in self.open:
            writer = self.open["tensorboard"]
            for k, v in values.items():
                writer.add_scalar(k, v, step)
            if rows:
                writer.add_text("completions", _markdown(rows), step)
            writer.flush()
        if "wandb" in self.open:
            import wandb

            extra = {"completions": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])} \
                if rows else {}
            self.open["wandb"].log({**values, **extra}, step=step)
        if "mlflow" in self.open:
            from mlflow.entities import Metric

            client, run_id = self.open["mlflow"]
            stamp = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, v, stamp, step) for k, v in values.items()
                                              if math.isfinite(v)])
            if rows:
                client.log_text(run_id, "".join(json.dumps(r) + "\n" for r in rows),
                                f"completions/step_{step:08d}.jsonl")

    def close(self) -> None:
        """End the trackers' runs (W&B's files and TensorBoard's events complete, MLflow's run finished)."""
        for tracker, handle in self.open.items():
            if tracker == "tensorboard":
                handle.close()
            elif tracker == "wandb":
                handle.finish()
            else:
                handle[0].set_terminated(handle[1])
        self.open = {}


def _markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard's text plugin renders it)."""
    cols = list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "\\n")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
                     + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows])
