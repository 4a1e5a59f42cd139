"""A run's edges before its first step: the device, the parameters (a preset or a Transformers checkpoint), a LoRA
run's adapters, the objective's reference, the data, and `start`, which makes them all into a `Run` and a state."""

from __future__ import annotations

import dataclasses

import torch

import glm5f
from glm5f.ckpt import checkpoint
from glm5f.ckpt.hf.load import check_loaded_finite
from glm5f.core.params import leaf_dtype, map_with_path, region_of
from glm5f.data import make_eval_source, make_source, print_warning
from glm5f.data.chat import resolve_tokenizer
from glm5f.model import lora
from glm5f.model.decoder import check_input_ids
from glm5f.objectives import objective
from glm5f.parallel.layout import Layout
from glm5f.posttrain.reference import check_architecture
from glm5f.run import rundir
from glm5f.run.errors import TrainingError, user_errors, writing
from glm5f.run.launch import check_device
from glm5f.train.feed import on_device
from glm5f.train.loss import unused_weights
from glm5f.train.optim import unused_flags
from glm5f.train.step import Trainer, TrainState


@dataclasses.dataclass
class Run:
    """What stays the same over a run's steps beside the Trainer: its config, layout, output (`say` prints on rank
    0, `warn` a warning line), tokenizer, model config, main objective (`row`), a LoRA run's spec and base record,
    the training data and its batch schedule (`feed`), the held-out batches, the history of the settings changed on
    resume (--checkpoint.allow_changed). An objective's hooks read it."""

    cfg: object
    layout: Layout
    say: object
    warn: object
    tokenizer: object
    model_cfg: glm5f.GLM5Config
    trainer: Trainer
    row: object
    spec: lora.LoraSpec | None
    base: dict | None
    data: object = None
    feed: object = None
    eval_batches: list = dataclasses.field(default_factory=list)
    changes: list = dataclasses.field(default_factory=list)  # the settings changed on resume (resume.Change.record)

    def writing(self, path: str):
        """`errors.writing` of one of this run's files."""
        return writing(path, self.cfg.checkpoint.dir)


def start(cfg, layout: Layout) -> tuple[Run, TrainState]:
    """(the Run, the state at step 0) of `cfg` on `layout`: the run's one tokenizer and template (data,
    checkpoints and exports all use it), its run directory prepared, the params (seeded by --train.seed), a LoRA
    run's adapters beside them, the Trainer of --train.objective's row, its reference, the data and its feed, and
    the row's `setup` (e.g. DPO's precomputed reference, which frees the reference)."""
    say = print if layout.is_main else (lambda *a, **k: None)
    warn = print_warning if layout.is_main else (lambda message: None)
    with user_errors():
        tokenizer = resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    with user_errors():
        rundir.prepare_run_dir(cfg, layout, say, tokenizer.names())
    torch.manual_seed(cfg.train.seed)
    model_cfg, params = init_params(cfg, layout)
    spec = cfg.lora.spec()
    # a LoRA run trains its adapters (a flat tree of their own) beside the frozen base; else the params train
    trained, frozen = (init_adapters(cfg, spec, params, layout), params) if spec else (params, None)
    base = lora_base(cfg, params, layout) if spec else None
    for message in unused_weights(cfg.train, model_cfg) + unused_flags(cfg.optim, lora=bool(spec)):
        warn(message)
    row = objective(cfg.train.objective)
    trainer = Trainer.of(cfg, model_cfg, layout, row)
    reference = init_reference(cfg, model_cfg, params, layout) \
        if row.needs_reference(trainer.step.settings) else None
    run = Run(cfg, layout, say, warn, tokenizer, model_cfg, trainer, row, spec, base)
    run.data, run.eval_batches = make_data(cfg, model_cfg, layout, say, tokenizer.path)
    run.feed = row.feed(run.data, trainer)
    reference = row.setup(run, run.data, reference)
    return run, trainer.init(trained, frozen, reference)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device)
    return check_device(torch.device(name), "--train.device")


def init_params(cfg, layout: Layout) -> tuple[glm5f.GLM5Config, dict]:
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


def init_reference(cfg, model_cfg: glm5f.GLM5Config, params: dict, layout: Layout) -> dict:
    """The reference model an objective compares with (DPO's; GRPO's KL), as the layout stores the params: a LoRA
    run's base itself (the adapters off: no copy); else the checkpoint its settings' `reference` flag names
    (--dpo.reference, --rl.reference), or a copy of the run's starting weights, each leaf in the compute dtype (the
    fp32 leaves of `params.leaf_kinds()` stay fp32). Made before any resume loads trained weights into the
    params."""
    if cfg.lora.rank:
        return params
    act = getattr(torch, cfg.train.dtype)
    section = objective(cfg.train.objective).settings
    path = getattr(getattr(cfg, section, None), "reference", None) if section else None
    if path:
        with user_errors():  # its config first: a checkpoint of another architecture is refused before any read
            check_architecture(glm5f.GLM5Config.from_hf(path), model_cfg, path, f"--{section}.reference")
            params = layout.local_params(lambda region: glm5f.load_hf(path, device=layout.device, region=region)[1])
    return map_with_path(lambda path, t: t.detach().to(leaf_dtype(path, act), copy=True), params)


def init_adapters(cfg, spec: lora.LoraSpec, params: dict, layout: Layout) -> dict:
    """A LoRA run's fresh adapters (`lora.init_adapters`, seeded by --train.seed) as the layout stores them, in
    the master dtype (fp32, fp64 in fp64 runs), whatever the base's."""
    master = torch.promote_types(getattr(torch, cfg.train.dtype), torch.float32)
    with user_errors():
        whole = lora.init_adapters(params, spec, cfg.train.seed, master)
    return layout.local_params(lambda region: {p: t[region_of(region, p, tuple(t.shape))].to(layout.device)
                                               for p, t in whole.items()})


def lora_base(cfg, params: dict, layout: Layout) -> dict:
    """What names a LoRA run's frozen base in its checkpoints: where it comes from (--model.init_from, or the
    preset and --train.seed of a fresh init) and the fingerprint of its values (checked on resume)."""
    source = cfg.model.init_from or f"{cfg.model.preset} initialised with --train.seed {cfg.train.seed}"
    return {"source": source, "fingerprint": checkpoint.fingerprint(params, layout.sum)}


def make_data(cfg, model_cfg: glm5f.GLM5Config, layout: Layout, say, tokenizer_path: str | None):
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
    row = objective(cfg.train.objective)
    if row.source is not None and d.type in (row.data_types or ()):  # the objective's own data: no held-out part
        with user_errors():
            data = row.source(cfg, model_cfg, layout, tokenizer_path, warn)
        if cfg.eval.every:
            say(f"no evaluation: the held-out loss is the LM loss of held-out text, and --train.objective "
                f"{cfg.train.objective} trains on --data.type {d.type} (pass --eval.every 0 to turn evaluation off "
                f"without this line)")
        return data, []
    with user_errors():
        data = make_source(d.type, path=d.path, split=d.split, warn=warn,
                           allow_changed=d.allow_changed or "data.path" in cfg.checkpoint.allowed, **common)
        held_out = make_eval_source(d.type, path=cfg.eval.path, split=cfg.eval.split, train_path=d.path,
                                    train_split=d.split, **common)
        eval_batches = [] if held_out is None or not cfg.eval.every else \
            [on_device(held_out.next_batch(), layout.device) for _ in range(cfg.eval.batches)]
        for b in eval_batches:
            check_input_ids(b["input_ids"], model_cfg)
    if held_out is None and cfg.eval.every:
        say(f"no evaluation: {d.type} data has no held-out part; pass --eval.path (or --eval.split), or hold out a "
            f"part of --data.path with --eval.split_fraction")
    return data, eval_batches


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
