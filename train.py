"""Train GLM-5 with glm5f: config -> params -> data -> [batch -> value_and_grad -> clip -> AdamW -> log -> save].

    python train.py                      # glm5-tiny on the embedded text, CPU, about a minute
    python train.py --help               # every flag, with defaults
    python train.py --model.preset glm5-scaled-moe --data.type synthetic --train.steps 50
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import time

import torch
import tyro

import glm5f
from configs import Config, validate, with_data_type
from glm5f import checkpoint, preempt
from glm5f.data import check_first_batch, make_eval_source, make_source, print_warning
from glm5f.hf import check_export_dir, check_loaded_finite
from glm5f.metrics import MetricsLog, Progress, plot_losses, read_metrics
from glm5f.model import apply, check_input_ids, cross_entropy_sum, mtp_apply, mtp_inputs, mtp_targets, shift_labels
from glm5f.moe import SeqAux
from glm5f.optim import (adamw_init, adamw_update, balance_router_bias, clip_by_global_norm, lr_schedule, matches,
                         schedule_change, schedule_total, trained_paths, value_and_grad)
from glm5f.distributed import DistLayout, WorkerFailure, check_device, init_process, spawn, under_torchrun
from glm5f.parallel import Layout
from glm5f.params import flatten, leaf_dtype, map_with_path


class TrainingError(RuntimeError):
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


def check_supported(cfg: Config) -> None:
    if cfg.parallel.tp != 1:
        raise NotImplementedError("tensor parallelism (--parallel.tp) is not built yet; use dp_shard, cp and ep")


@dataclasses.dataclass(frozen=True)
class Objectives:
    """What a training step optimizes beside the LM loss, and the weights (the --train flags of the same names).

    indexer_loss: "off", "dense" or "sparse" (the DSA indexer's KL to the main attention), indexer_target: "own"
    or "mean" (its target, see AttnContext); seq_aux_loss_coeff:
    DeepSeek-V3's sequence-wise balance loss (0: off); mtp_loss_weight: the MTP layers' cross-entropy (used when
    the model has MTP layers).
    """

    indexer_loss: str = "off"
    indexer_target: str = "own"
    indexer_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    mtp_loss_weight: float = 0.0

    @classmethod
    def of(cls, train_cfg) -> "Objectives":
        return cls(**{f.name: getattr(train_cfg, f.name) for f in dataclasses.fields(cls)})

    def coeffs(self) -> dict[str, float]:
        """Each objective's weight in the step's value; the other sums (e.g. indexer_recall) are only metrics."""
        return {"loss": 1.0, "indexer_loss": self.indexer_loss_coeff, "seq_aux_loss": self.seq_aux_loss_coeff,
                "mtp_loss": self.mtp_loss_weight}


LM_ONLY = Objectives()


def micro_loss(params: dict, batch: dict, denoms: dict, model_cfg: glm5f.GLM5Config, layout: Layout,
               dtype: torch.dtype, weight_dtype: torch.dtype, remat: bool, objectives: Objectives = LM_ONLY):
    """This rank's share of the step's objective, with (sums, routes) as aux.

    sums maps each objective's name to this rank's fp64 sum of it: "loss", the token cross-entropies; with
    --train.indexer_loss, "indexer_loss" (the indexer's KL summed over the indexer layers and the valid queries)
    and "indexer_recall" (summed over the valid queries, averaged over the indexer layers; a metric only); with
    --train.seq_aux_loss_coeff, "seq_aux_loss" (the sequence-wise balance loss of every sequence, summed over the
    MoE layers); with MTP inputs in the batch (`with_targets(batch, depths)`), "mtp_loss": the sum over depths of
    each depth's cross-entropy sum over its own global target count (its denominator is the number of depths, so
    its value is the mean over depths of each depth's token mean). The MTP layers count as layers for the indexer
    and balance losses, and their routes follow the main ones. The objective is the sum over names of coefficient * sums[name] / denoms[its denominator]
    (OBJECTIVE_DENOMS), denoms being the step's global counts (`step_denoms`), so the step's value does not
    depend on the layout. routes are the expert choices of every MoE layer. Activations are `dtype`; weights
    compute in `weight_dtype`.
    """
    def weights(tree: dict, prefix: str = "") -> dict:
        """A (sub)tree's compute weights: cast to weight_dtype, FSDP shards gathered."""
        cast = map_with_path(lambda p, t: t.to(leaf_dtype(f"{prefix}.{p}" if prefix else p, weight_dtype)), tree)
        return layout.gather_params(cast, prefix)

    # the embedding, final norm and head now; each decoder layer as it runs, freed after it (see `apply`)
    top = weights({**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}})
    compute = {**top, "model": {**top["model"], "layers": params["model"]["layers"]}}
    ctx = layout.context(model_cfg, batch, dtype)
    if objectives.indexer_loss != "off":
        ctx = dataclasses.replace(ctx, indexer_loss=objectives.indexer_loss, indexer_target=objectives.indexer_target)
    if objectives.seq_aux_loss_coeff:
        ctx = dataclasses.replace(ctx, seq_aux=SeqAux(batch["valid"], layout.seq_sum))
    logits, aux = apply(compute, model_cfg, batch["input_ids"], ctx, experts=layout.experts, remat=remat,
                        gather=weights)
    layers, routes = aux["layers"], aux["routes"]
    sums = {"loss": cross_entropy_sum(logits, batch["targets"])[0]}
    depths = sum(1 for k in batch if k.startswith("mtp_input_ids."))
    if depths:
        ids = [batch[f"mtp_input_ids.{d}"] for d in range(1, depths + 1)]
        mtp_logits, mtp_aux = mtp_apply(compute, model_cfg, aux["hidden"], ids, ctx, experts=layout.experts,
                                        remat=remat, gather=weights)
        sums["mtp_loss"] = sum(cross_entropy_sum(lg, batch[f"mtp_targets.{d + 1}"])[0] / denoms["mtp_targets"][d]
                               for d, lg in enumerate(mtp_logits))
        layers, routes = layers + mtp_aux["layers"], routes + mtp_aux["routes"]
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    if objectives.indexer_loss != "off":
        indexed = [a for a in layers if "indexer_loss" in a]
        sums["indexer_loss"] = sum((a["indexer_loss"] for a in indexed), zero)
        sums["indexer_recall"] = sum((a["indexer_recall"] for a in indexed), zero) / max(1, len(indexed))
    if objectives.seq_aux_loss_coeff:
        sums["seq_aux_loss"] = sum((a["seq_aux_loss"] for a in layers if "seq_aux_loss" in a), zero)
    coeffs = objectives.coeffs()
    objective = sum(coeffs[k] * v / denoms[OBJECTIVE_DENOMS[k]] for k, v in sums.items() if k in coeffs)
    return objective, (sums, routes)


def with_targets(batch: dict, mtp_depths: int = 0) -> dict:
    """The batch with its next-token targets (shifted on whole sequences, before any split) and valid tokens;
    with mtp_depths, also each MTP depth d's inputs "mtp_input_ids.{d}" and targets "mtp_targets.{d}"."""
    mask = batch.get("attention_mask")
    valid = mask if mask is not None and mask.ndim == 2 else torch.ones_like(batch["input_ids"])
    out = dict(batch, targets=shift_labels(batch["labels"]), valid=valid)
    for d in range(1, mtp_depths + 1):
        out[f"mtp_input_ids.{d}"] = mtp_inputs(batch["input_ids"], d)
        out[f"mtp_targets.{d}"] = mtp_targets(batch["labels"], d, batch.get("position_ids"), valid)
    return out


def step_denoms(batch: dict) -> dict:
    """The global counts the step's objectives are averaged over (at least 1 each), of a `with_targets` batch."""
    denoms = {"targets": (batch["targets"] != glm5f.IGNORE_INDEX).sum().clamp(min=1),
              "queries": batch["valid"].sum().clamp(min=1),
              "sequences": (batch["valid"].sum(1) > 0).sum().clamp(min=1)}
    mtp = [batch[f"mtp_targets.{d}"] for d in range(1, 1 + sum(k.startswith("mtp_targets.") for k in batch))]
    if mtp:  # per depth: its target count; and the number of depths the MTP loss is a mean over
        denoms["mtp_targets"] = torch.stack([(t != glm5f.IGNORE_INDEX).sum() for t in mtp]).clamp(min=1)
        denoms["mtp_depths"] = torch.tensor(float(len(mtp)), dtype=torch.float64, device=mtp[0].device)
    return denoms


def step_grads(params: dict, batch: dict, cfg: Config, model_cfg: glm5f.GLM5Config, layout: Layout):
    """(metrics, gradients of the trained leaves, per-MoE-layer expert token counts) of one step.

    metrics maps each objective's name to its mean over the global batch ("loss": the LM loss; "indexer_loss" and
    "indexer_recall" with --train.indexer_loss, per valid query). Only the leaves --train.trainable selects (and
    the indexer's only with the indexer loss on) get gradients. The batch is the
    step's global batch; it is cut into micro-batches, each rank computes its share, and the token-weighted means
    over all of them are the same whatever the layout. With --train.reduce_dtype the gradients are taken, and
    summed over micro-batches and ranks, in that dtype and rounded to the parameters' at the end.
    """
    dtype = getattr(torch, cfg.train.dtype)
    reduce = getattr(torch, cfg.train.reduce_dtype) if cfg.train.reduce_dtype else None
    master = {p: t.dtype for p, t in flatten(params).items()}
    if reduce is not None:
        params = map_with_path(lambda p, t: t.to(torch.promote_types(t.dtype, reduce)), params)
    batch = with_targets(batch, model_cfg.num_nextn_predict_layers)
    denoms = step_denoms(batch)
    moe_layers = [i for i in range(model_cfg.num_hidden_layers + model_cfg.num_nextn_predict_layers)
                  if model_cfg.is_moe(i)]
    grads, sums, counts = None, {}, {}
    t = cfg.train
    grad_fn = value_and_grad(micro_loss, has_aux=True,
                             paths=trained_paths(params, t.trainable, indexer=t.indexer_loss != "off"))
    B, n = len(batch["input_ids"]), cfg.train.grad_accum
    for micro in range(n):
        mb = layout.local_batch({k: v[micro * B // n:(micro + 1) * B // n] for k, v in batch.items()})
        (_, (mb_sums, routes)), g = grad_fn(params, mb, denoms, model_cfg, layout, dtype, reduce or dtype,
                                            cfg.train.activation_checkpointing, Objectives.of(t))
        grads = g if grads is None else dict(zip(grads, torch._foreach_add(list(grads.values()), list(g.values()))))
        sums = {k: sums.get(k, 0) + v for k, v in mb_sums.items()}
        valid = mb["valid"].flatten().to(torch.float32)
        for layer, idx in zip(moe_layers, routes):
            c = torch.bincount(idx.flatten(), weights=valid.repeat_interleave(idx.shape[1]),
                               minlength=model_cfg.n_routed_experts)
            key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            counts[key] = counts.get(key, 0) + c
    grads = {p: g.to(master[p]) for p, g in grads.items()}
    metrics = {k: float(layout.sum(v) / denoms[OBJECTIVE_DENOMS[k]]) for k, v in sums.items()}
    return metrics, grads, {k: layout.sum(c) for k, c in counts.items()}


# each objective's denominator in `step_denoms`
OBJECTIVE_DENOMS = {"loss": "targets", "indexer_loss": "queries", "indexer_recall": "queries",
                    "seq_aux_loss": "sequences", "mtp_loss": "mtp_depths"}


@torch.no_grad()
def eval_loss(params: dict, batches: list[dict], cfg: Config, model_cfg: glm5f.GLM5Config, layout: Layout) -> float:
    """Token-weighted mean loss of `params` over the held-out batches: every batch cut into micro-batches and
    rank shares as a training step's, the loss sums added over all of them and divided by all their targets."""
    dtype = getattr(torch, cfg.train.dtype)
    weight_dtype = getattr(torch, cfg.train.reduce_dtype) if cfg.train.reduce_dtype else dtype
    one = {"targets": torch.ones((), device=layout.device)}
    loss_sum, n_targets = torch.zeros((), dtype=torch.float64, device=layout.device), 0
    for batch in batches:
        batch = with_targets(batch)
        n_targets += int((batch["targets"] != glm5f.IGNORE_INDEX).sum())
        B, n = len(batch["input_ids"]), cfg.train.grad_accum
        for micro in range(n):
            mb = layout.local_batch({k: v[micro * B // n:(micro + 1) * B // n] for k, v in batch.items()})
            _, (mb_sums, _) = micro_loss(params, mb, one, model_cfg, layout, dtype, weight_dtype, False)
            loss_sum = loss_sum + mb_sums["loss"]
    return float(layout.sum(loss_sum) / max(n_targets, 1))


def check_finite(params: dict, layout: Layout, step: int, last_ckpt: str | None) -> None:
    """Refuse to checkpoint parameters holding NaN or inf (counted over all ranks' shards)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    bad = {p: (~torch.isfinite(local(t))).sum() for p, t in flatten(params).items() if t.is_floating_point()}
    counts = layout.sum(torch.stack(list(bad.values())).to(torch.float64)) if bad else torch.zeros(0)
    names = [p for p, n in zip(bad, counts.tolist()) if n]
    if names:
        raise TrainingError(f"step {step}: non-finite values in {len(names)} parameter(s) ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''}); not writing a checkpoint of them. The last good "
                            f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}")


def check_same_data(cfg: Config, meta: dict, ckpt: str) -> None:
    """A checkpoint's data position (an epoch/offset, a step, a batch index) means something only for the
    --data.type it was saved with."""
    saved = (meta.get("run") or {}).get("data", {}).get("type")
    if saved is not None and saved != cfg.data.type:
        raise TrainingError(f"{ckpt} was saved by a run on --data.type {saved}, not {cfg.data.type}: resume it with "
                            f"--data.type {saved}, or start a new run with another --checkpoint.dir")


def check_same_trained(cfg: Config, params: dict, meta: dict, ckpt: str) -> None:
    """A checkpoint's optimizer state covers the leaves its run trained (--train.trainable, and the indexer only
    with --train.indexer_loss); resuming it must train the same ones."""
    saved = (meta.get("run") or {}).get("train")
    if not saved:
        return
    t = cfg.train
    before = trained_paths(params, saved.get("trainable"), indexer=saved.get("indexer_loss", "off") != "off")
    now = trained_paths(params, t.trainable, indexer=t.indexer_loss != "off")
    if before != now:
        raise TrainingError(
            f"{ckpt} was saved by a run that trained {len(before)} leaves (--train.trainable "
            f"{saved.get('trainable')!r}, --train.indexer_loss {saved.get('indexer_loss', 'off')}); this run trains "
            f"{len(now)} (--train.trainable {t.trainable!r}, --train.indexer_loss {t.indexer_loss}), and the "
            f"checkpoint's optimizer state covers only the first set. Resume with its flags, or start the next "
            f"stage from its weights: export them (the same run with --checkpoint.export_hf DIR) and start a new "
            f"run with --model.init_from DIR")


RUN_FILES = ("checkpoints", "metrics.jsonl", "loss.png")  # what a run writes into its directory


def check_run_dir(cfg: Config, is_main: bool) -> None:
    """A run directory holding a previous run is only continued (--checkpoint.resume) or, with
    --checkpoint.overwrite, emptied of what we wrote; anything else would mix two runs' metrics and checkpoints."""
    run_dir = cfg.checkpoint.dir
    if cfg.checkpoint.resume or not os.path.isdir(run_dir):
        return
    found = [n for n in RUN_FILES[:2] if os.path.exists(os.path.join(run_dir, n))]
    if not found:
        return
    if not cfg.checkpoint.overwrite:
        raise TrainingError(f"the run directory {run_dir} already holds a run ({', '.join(found)}); continue it "
                            f"with --checkpoint.resume latest, start over with --checkpoint.overwrite (deletes "
                            f"its {', '.join(RUN_FILES)}), or pass another --checkpoint.dir")
    if is_main:
        for n in RUN_FILES:
            path = os.path.join(run_dir, n)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)


def train(cfg: Config, layout: Layout | None = None) -> list[dict]:
    errors = validate(cfg, world_size=layout.world if layout else 1)
    if errors:
        raise TrainingError("invalid configuration:\n  - " + "\n  - ".join(errors))
    cfg = with_data_type(cfg)
    check_supported(cfg)
    if cfg.checkpoint.export_hf:
        with user_errors():
            check_export_dir(cfg.checkpoint.export_hf, run_dir=cfg.checkpoint.dir)
    check_run_dir(cfg, is_main=layout.is_main if layout else True)
    torch.manual_seed(cfg.train.seed)
    layout = layout or Layout(resolve_device(cfg.train.device))
    device, dtype, run_dir = layout.device, getattr(torch, cfg.train.dtype), cfg.checkpoint.dir
    say = print if layout.is_main else (lambda *a, **k: None)
    warn = print_warning if layout.is_main else (lambda message: None)
    steps, warmup = cfg.train.steps, cfg.optim.warmup_steps
    if steps < warmup:
        warn(f"--train.steps {steps} ends inside the {warmup}-step warm-up (--optim.warmup_steps): the learning "
             f"rate peaks at {cfg.optim.lr * steps / warmup:.2e}, not --optim.lr {cfg.optim.lr:.2e}")

    # ---- model: a preset (with overrides) or a Transformers checkpoint; fp32 master parameters (fp64 in fp64 runs)
    master = torch.promote_types(dtype, torch.float32)
    if cfg.model.init_from:
        if cfg.model.overrides():
            raise TrainingError(f"--model.init_from takes the config from the checkpoint; drop the overrides "
                                f"{sorted(cfg.model.overrides())}")
        loaded = {}

        def load(region):  # each rank reads only its own shards
            loaded["cfg"], p = glm5f.load_hf(cfg.model.init_from, dtype=master, device=device, region=region)
            return p
        with user_errors():
            params = layout.local_params(load)
            check_loaded_finite(params, cfg.model.init_from, layout.sum)
        model_cfg = loaded["cfg"]
    else:  # each rank makes only its own shards
        model_cfg = cfg.model.build()
        params = layout.local_params(lambda region: glm5f.init_params(model_cfg, cfg.train.seed, master, device,
                                                                      region))
    opt_state = adamw_init(params, trained_paths(params, cfg.train.trainable, indexer=cfg.train.indexer_loss != "off"))

    # ---- data
    with user_errors():
        data = make_source(cfg.data.type, vocab_size=model_cfg.vocab_size, batch_size=cfg.data.batch_size,
                           seq_len=cfg.data.seq_len, seed=cfg.data.seed, path=cfg.data.path,
                           tokenizer_path=cfg.model.tokenizer_path, pack=cfg.data.pack, split=cfg.data.split,
                           warn=warn, shuffle_buffer=cfg.data.shuffle_buffer, allow_changed=cfg.data.allow_changed)
        held_out = make_eval_source(cfg.data.type, vocab_size=model_cfg.vocab_size, batch_size=cfg.data.batch_size,
                                    seq_len=cfg.data.seq_len, seed=cfg.data.seed, path=cfg.eval.path,
                                    split=cfg.eval.split, train_path=cfg.data.path,
                                    tokenizer_path=cfg.model.tokenizer_path, pack=cfg.data.pack,
                                    shuffle_buffer=cfg.data.shuffle_buffer)
        eval_batches = [] if held_out is None or not cfg.eval.every else \
            [{k: v.to(device) for k, v in held_out.next_batch().items()} for _ in range(cfg.eval.batches)]
        for b in eval_batches:
            check_input_ids(b["input_ids"], model_cfg)
    if held_out is None and cfg.eval.every:
        say(f"no evaluation: {cfg.data.type} data has no held-out part; pass --eval.path (or --eval.split)")

    # ---- resume
    start, last_ckpt = 0, None
    if cfg.checkpoint.resume:
        with user_errors():
            last_ckpt, note = checkpoint.choose(run_dir, cfg.checkpoint.resume)
        if note:
            say(note)
        if last_ckpt is None:
            say(f"no checkpoint in {run_dir}/checkpoints: starting from step 0")
        else:
            with user_errors():
                meta = checkpoint.read_meta(last_ckpt)
            if meta.get("model") != model_cfg.to_hf():
                raise TrainingError(f"{last_ckpt} was saved for another model config; resume with the same "
                                    f"--model flags (see its meta.json)")
            check_same_data(cfg, meta, last_ckpt)
            check_same_trained(cfg, params, meta, last_ckpt)
            state = {"params": params, "optim": opt_state}
            with user_errors():
                extra = checkpoint.load(last_ckpt, state)
            params, opt_state = state["params"], state["optim"]
            try:
                with user_errors():
                    data.load_state_dict(extra["data"])
            except (KeyError, TypeError) as e:
                raise TrainingError(f"{last_ckpt}: its data position does not fit --data.type {cfg.data.type} "
                                    f"(no {e}); resume with the --data flags it was saved with") from None
            checkpoint.set_rng_state(extra["rng"])
            start = extra["step"]
            say(f"resumed from {last_ckpt} at step {start}")
            note = schedule_change(meta.get("run"), cfg.optim, cfg.train, start)
            if note:
                say(note)
    if start >= cfg.train.steps:
        say(f"nothing to do: step {start} >= --train.steps {cfg.train.steps}")
        export(cfg, model_cfg, params, layout, say)
        return read_metrics(run_dir)

    log = MetricsLog(run_dir, start, warn) if layout.is_main else None
    progress = Progress(cfg.train.steps, start, cfg.train.log_every) if layout.is_main else None
    say(f"glm5f: {cfg.model.preset if not cfg.model.init_from else cfg.model.init_from} "
        f"({glm5f.param_count(model_cfg):,} parameters), {cfg.data.type} data, {cfg.data.batch_size}x"
        f"{cfg.data.seq_len} tokens/step, {cfg.train.dtype} on {device} x{layout.world}, steps {start}->"
        f"{cfg.train.steps}, run dir {run_dir}")

    records = []
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        with user_errors():  # a streamed record is read, and checked, when a batch needs it
            batch = {k: v.to(device) for k, v in data.next_batch().items()}
        check_input_ids(batch["input_ids"], model_cfg)
        if step == start:
            with user_errors():
                check_first_batch(batch, step, cfg.data.path or cfg.data.type)
        metrics, grads, counts = step_grads(params, batch, cfg, model_cfg, layout)
        loss = metrics["loss"]
        grads, grad_norm = clip_by_global_norm(grads, cfg.optim.clip_norm)
        lr = lr_schedule(step, peak=cfg.optim.lr, warmup=cfg.optim.warmup_steps,
                         total=schedule_total(cfg.optim, cfg.train),
                         min_ratio=cfg.optim.min_lr_ratio)
        bad = [f"the {name} is {v}" for name, v in (("loss", loss), ("grad norm", float(grad_norm)))
               if not math.isfinite(v)]
        if bad and not cfg.train.skip_nonfinite:
            raise TrainingError(f"step {step + 1}: {' and '.join(bad)}; stopping before the update. The last good "
                                f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}; resume from it "
                                f"with a lower --optim.lr, or pass --train.skip_nonfinite to skip such steps")
        if bad:
            say(f"step {step + 1}: {' and '.join(bad)}; skipping this step's update (--train.skip_nonfinite)")
        else:
            params, opt_state = adamw_update(params, grads, opt_state, lr, b1=cfg.optim.b1, b2=cfg.optim.b2,
                                             eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
            params = balance_router_bias(params, {k: c for k, c in counts.items() if matches(cfg.train.trainable, k)},
                                         cfg.optim.bias_update_rate)
        del grads  # freed before the next step's forward and backward
        dt = time.perf_counter() - t0
        tokens = batch["input_ids"].numel()
        rec = {"step": step + 1, **metrics, "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens,
               "tokens_per_s": tokens / dt, "step_time_s": dt}
        if bad:
            rec["skipped"] = True
        if eval_batches and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.train.steps):
            rec["eval_loss"] = eval_loss(params, eval_batches, cfg, model_cfg, layout)
            rec["eval_ppl"] = math.exp(rec["eval_loss"]) if rec["eval_loss"] < 700 else math.inf
        records.append(rec)
        if layout.is_main:
            log.write(rec)
            progress.update(step + 1, rec)
        stop = preempt.should_stop(layout)  # SIGTERM on any rank: all save this step, then stop
        if stop or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or step + 1 == cfg.train.steps:
            check_finite(params, layout, step + 1, last_ckpt)
            last_ckpt = checkpoint.save(
                run_dir, step + 1, {"params": params, "optim": opt_state},
                extra={"step": step + 1, "data": data.state_dict(), "rng": checkpoint.rng_state()},
                meta={"model": model_cfg.to_hf(), "run": dataclasses.asdict(cfg)},
                keep=cfg.checkpoint.keep)
        if stop:
            raise preempt.Preempted(step + 1, last_ckpt)

    if layout.is_main:
        history = read_metrics(run_dir)
        png = os.path.join(run_dir, "loss.png")
        if plot_losses({os.path.basename(os.path.abspath(run_dir)): history}, png):
            say(f"loss curve: {png}")
        else:
            say("no loss curve: matplotlib is not installed (pip install matplotlib)")
        first, last = history[0]["loss"], history[-1]["loss"]
        say(f"done: loss {first:.4f} (step {history[0]['step']}) -> {last:.4f} (step {history[-1]['step']})")
        if "indexer_loss" in history[0]:
            say(f"indexer: indexer_loss {history[0]['indexer_loss']:.4f} -> {history[-1]['indexer_loss']:.4f}, "
                f"indexer_recall {history[0]['indexer_recall']:.4f} -> {history[-1]['indexer_recall']:.4f}")
        evals = [r for r in history if "eval_loss" in r]
        if evals:
            say(f"held-out: eval_loss {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.2f}) at step "
                f"{evals[-1]['step']}")
    export(cfg, model_cfg, params, layout, say)
    return records


def export(cfg: Config, model_cfg: glm5f.GLM5Config, params: dict, layout: Layout, say) -> None:
    """--checkpoint.export_hf: the weights as a Transformers checkpoint (collective: the ranks gather one leaf at
    a time, rank 0 writes)."""
    if cfg.checkpoint.export_hf:
        with user_errors():
            glm5f.save_hf(cfg.checkpoint.export_hf, model_cfg, params, write=layout.is_main)
        say(f"exported Transformers checkpoint: {cfg.checkpoint.export_hf}")


def run_rank(argv: list[str]) -> None:
    """One process of a multi-process run (spawned by main, or started by torchrun)."""
    cfg = tyro.cli(Config, args=argv, use_underscores=True)
    device = init_process(resolve_device(cfg.train.device), cfg.parallel.timeout_s)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    p = cfg.parallel
    with preempt.handling(cfg.checkpoint.preempt_grace_s):
        try:
            train(cfg, DistLayout(p.dp_shard, p.cp, p.ep, device))
        except (preempt.Preempted, preempt.StopNow) as e:  # every rank stops here; rank 0 says where
            if os.environ.get("RANK") == "0":
                print(e.message(argv) if isinstance(e, preempt.Preempted) else
                      preempt.interrupted_line(f"{e} (without saving)", cfg.checkpoint.dir, argv),
                      file=sys.stderr, flush=True)
            raise SystemExit(preempt.SIGNAL_EXIT[signal.SIGTERM]) from None


def plan_run(cfg: Config) -> None:
    """--plan: print the memory plan of the run the other flags describe (nothing allocated, nothing written)."""
    from glm5f.plan import print_plan

    model_cfg = glm5f.GLM5Config.from_hf(cfg.model.init_from) if cfg.model.init_from else cfg.model.build()
    print_plan(cfg, cfg.plan, model_cfg, resolve_device(cfg.train.device), cfg.model.init_from or cfg.model.preset)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = tyro.cli(Config, args=argv, use_underscores=True, description=__doc__)
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
        check_supported(cfg)
        cfg = with_data_type(cfg)
        checkpoint.check_run_paths(cfg)
        with checkpoint.run_lock(cfg.checkpoint.dir):
            if under_torchrun():
                run_rank(argv)
            elif world > 1:
                spawn(run_rank, world, argv)
            else:
                with preempt.handling(cfg.checkpoint.preempt_grace_s):
                    train(cfg)
    except preempt.Preempted as e:
        print(e.message(argv), file=sys.stderr)
        return preempt.SIGNAL_EXIT[e.signum]
    except (preempt.StopNow, KeyboardInterrupt) as e:
        why = f"{e} (without saving)" if isinstance(e, preempt.StopNow) else "on Ctrl-C (SIGINT)"
        print(preempt.interrupted_line(why, cfg.checkpoint.dir, argv), file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    except WorkerFailure as e:
        print(f"error: {e}; {checkpoint.last_line(cfg.checkpoint.dir)}", file=sys.stderr)
        return 1
    except (TrainingError, NotImplementedError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
