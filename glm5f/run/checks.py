"""The checks of a run config (configs.Config) that read the objective table or the model it trains (configs.validate
adds them): what its objective refuses; what a layout, the trained leaves, LoRA and the tokenizer cannot honour."""

from __future__ import annotations

import dataclasses
import os
import re

import glm5f
from glm5f.data import load_batches
from glm5f.data.tokens import make_tokenizer
from glm5f.model.lora import target_modules
from glm5f.objectives import OBJECTIVES
from glm5f.train.optim import trained_paths

DATA_TYPES = ("text", "synthetic", "json_file", "preset_pt", "hf_datasets", "chat")  # the data floor's (make_source)
PATH_TYPES = ("json_file", "preset_pt", "hf_datasets")  # of those, the ones that need --data.path


def owned_data_types() -> tuple[str, ...]:
    """The --data.type values an objective of the table trains on and owns (its `source` reads them), in order."""
    return tuple(t for r in OBJECTIVES.values() if r.source is not None for t in r.data_types or ())


def objective_errors(cfg, row) -> list[str]:
    """What the objective of --train.objective (`row`, None when unknown) refuses: its own checks (`row.check`),
    data that another objective owns, and a flag of another objective's section (it would be ignored)."""
    errs, name = [], cfg.train.objective
    owners = {t: n for n, r in OBJECTIVES.items() if r.source is not None for t in r.data_types or ()}
    if cfg.data.type in owners and (row is None or cfg.data.type not in (row.data_types or ())):
        errs.append(f"--data.type {cfg.data.type} holds data for --train.objective {owners[cfg.data.type]}, not "
                    f"{name}; pass --train.objective {owners[cfg.data.type]}, or data that {name} trains on")
    for owner, r in OBJECTIVES.items():
        if not r.settings or owner == name or (row is not None and row.settings == r.settings) \
                or not hasattr(cfg, r.settings):
            continue
        given, default = getattr(cfg, r.settings), r.config()
        own = getattr(cfg, row.settings) if row is not None and row.settings else None
        for f in dataclasses.fields(given):
            if getattr(given, f.name) != getattr(default, f.name):
                hint = f" ({name}'s own is --{row.settings}.{f.name})" if hasattr(own, f.name) else ""
                errs.append(f"--{r.settings}.{f.name} is for --train.objective {owner}, not {name} (which would ignore "
                            f"it); drop it, or pass --train.objective {owner}{hint}")
    return errs + (row.check(cfg) if row is not None else [])


def model_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """What the run's flags cannot honour for the model they train: its layout, trained leaves, LoRA, tokenizer."""
    return layout_errors(cfg, model) + trainable_errors(cfg, model) + lora_errors(cfg, model) + \
        tokenizer_errors(cfg, model)


def tokenizer_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """--model.tokenizer_path with --model.init_from: the checkpoint fixes the vocab_size (its config.json), so a
    tokenizer with more ids cannot be given room (--model.vocab_size is not an override there)."""
    if not (cfg.model.init_from and cfg.model.tokenizer_path):
        return []
    try:
        tok = make_tokenizer(cfg.model.tokenizer_path)
    except (ValueError, OSError, ImportError):
        return []  # the run names what is wrong with the file
    if tok.vocab_size <= model.vocab_size:
        return []
    return [f"--model.tokenizer_path {cfg.model.tokenizer_path} has {tok.vocab_size} ids but --model.init_from "
            f"{cfg.model.init_from} embeds {model.vocab_size} (its config.json's vocab_size, which a run from it "
            f"keeps): pass the tokenizer that checkpoint was trained with, or drop --model.tokenizer_path to use the "
            f"one it carries"]


def mesh_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """What leaves no mesh to plan (--plan refuses these, as a run does; it plans past the other errors): a mesh
    size, batch or grad_accum below 1, an ep that does not divide the ranks or the routed experts."""
    p = cfg.parallel
    errs = [f"--{n} must be >= 1, got {v}" for n, v in (
        ("parallel.dp_shard", p.dp_shard), ("parallel.cp", p.cp), ("parallel.ep", p.ep), ("parallel.tp", p.tp),
        ("data.batch_size", cfg.data.batch_size), ("train.grad_accum", cfg.train.grad_accum)) if v < 1]
    if not errs and p.world % p.ep:
        errs.append(f"--parallel.ep {p.ep} must divide the ranks dp_shard x cp = {p.world}")
    if not errs and model.n_routed_experts % p.ep:
        errs.append(f"--parallel.ep {p.ep} must divide n_routed_experts ({model.n_routed_experts})")
    return errs


def layout_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """What a parallel layout cannot honour for this model and data."""
    p, errs = cfg.parallel, []
    if p.ep > 1:
        if p.world % p.ep:
            errs.append(f"--parallel.ep {p.ep} must divide the ranks dp_shard x cp = {p.world}")
        if model.n_routed_experts % p.ep:
            errs.append(f"--parallel.ep {p.ep} must divide n_routed_experts ({model.n_routed_experts})")
        if "sparse" not in model.mlp_layer_types:
            errs.append("--parallel.ep > 1 needs MoE layers, and this model has none")
    if p.cp > 1:
        seq = cfg.data.seq_len
        if cfg.data.type == "preset_pt" and cfg.data.path and os.path.isfile(cfg.data.path):
            try:
                seq = load_batches(cfg.data.path)[0]["input_ids"].shape[1]
            except (ValueError, LookupError, TypeError, AttributeError) as e:
                return errs + [str(e) if isinstance(e, ValueError) else f"--data.path {cfg.data.path}: expected a "
                               f"list of dicts with 'input_ids' (torch.save of a list of batches)"]
        if seq % (2 * p.cp):
            errs.append(f"context parallelism cuts each sequence into 2 x cp = {2 * p.cp} equal chunks: the sequence "
                        f"length {seq} must divide by {2 * p.cp} (change --data.seq_len)")
    parts = cfg.train.query_parts
    if parts > 1 and (cfg.data.seq_len // p.cp) % (2 * parts):
        errs.append(f"--train.query_parts {parts} holds the queries as a {parts}-way CP run does, in 2 x {parts} "
                    f"equal chunks: this rank's {cfg.data.seq_len // p.cp} queries must divide by {2 * parts} "
                    f"(change --data.seq_len or --train.query_parts)")
    return errs


def trainable_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """What is wrong with --train.trainable and the indexer loss for this model."""
    t, errs = cfg.train, []
    if t.indexer_target not in ("own", "mean"):
        errs.append(f"--train.indexer_target must be own or mean, got {t.indexer_target!r}")
    if t.trainable is None:
        return errs
    try:
        re.compile(t.trainable)
    except re.error as e:
        return errs + [f"--train.trainable {t.trainable!r} is not a regular expression ({e})"]
    abstract = glm5f.abstract_params(model)
    if not trained_paths(abstract, t.trainable, indexer=t.indexer_loss != "off"):
        hint = ""
        if t.indexer_loss == "off" and trained_paths(abstract, t.trainable, indexer=True):
            hint = " (the indexer's parameters are trained only with --train.indexer_loss dense or sparse)"
        errs.append(f"--train.trainable {t.trainable!r} matches none of the trained parameters{hint}; parameter "
                    f"paths look like model.layers.0.self_attn.indexer.wk.weight")
    return errs


def lora_errors(cfg, model: glm5f.GLM5Config) -> list[str]:
    """What is wrong with the --lora flags for this model. LoRA trains the adapters only, so it excludes the flags
    that choose other trained leaves (--train.trainable, --train.indexer_loss)."""
    lo, errs = cfg.lora, []
    if lo.rank < 0:
        return [f"--lora.rank must be >= 0 (0: no adapters), got {lo.rank}"]
    if not lo.rank:
        if cfg.checkpoint.export_peft:
            errs.append("--checkpoint.export_peft writes LoRA adapters: it needs --lora.rank >= 1")
        if lo.base_dtype is not None:
            errs.append(f"--lora.base_dtype {lo.base_dtype} needs --lora.rank >= 1 (without adapters the base is "
                        f"what trains, in fp32 masters)")
        return errs
    if lo.alpha <= 0:
        errs.append(f"--lora.alpha must be positive, got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        errs.append(f"--lora.dropout must lie in [0, 1), got {lo.dropout}")
    if cfg.train.trainable is not None:
        errs.append(f"--train.trainable {cfg.train.trainable!r} with --lora.rank {lo.rank}: a LoRA run trains the "
                    f"adapters only (choose the adapted weights with --lora.targets); drop one of them")
    if cfg.train.indexer_loss != "off":
        errs.append(f"--train.indexer_loss {cfg.train.indexer_loss} with --lora.rank {lo.rank}: the indexer loss "
                    f"trains the base's indexer, which LoRA keeps frozen; drop one of them")
    if lo.base_dtype == "float64" and cfg.train.dtype != "float64":
        errs.append(f"--lora.base_dtype float64 needs --train.dtype float64")
    try:
        re.compile(lo.targets)
    except re.error as e:
        return errs + [f"--lora.targets {lo.targets!r} is not a regular expression ({e})"]
    try:
        target_modules(glm5f.abstract_params(model), lo.targets)
    except ValueError as e:
        errs.append(str(e))
    return errs
