"""Run configuration: nested dataclasses parsed by tyro into `--section.field value` flags, over a recipe file's
values (`--config FILE.yaml`: the same sections and fields, nested; flags override the file; glm5f/run/recipe_file.py reads it).

    python train.py --help
    python train.py --model.preset glm5-scaled-moe --train.steps 20 --checkpoint.dir runs/moe
    python train.py --config recipes/tiny.yaml --train.steps 100
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import tyro

import glm5f
from glm5f.run import recipe_file, trackers
from glm5f.run.resume import allow_changed_errors
from glm5f.run.trackers import MetricsConfig
from glm5f.data import check_path_fits, infer_data_type
from glm5f.model.lora import DEFAULT_TARGETS, LoraSpec
from glm5f.train.optim import OPTIMIZERS
from glm5f.objectives import OBJECTIVES
from glm5f.run.checks import (DATA_TYPES, PATH_TYPES, mesh_errors, model_errors, objective_errors,  # noqa: F401
                              owned_data_types)

@dataclass
class ModelConfig:
    """The network: a preset (or a Transformers checkpoint), with the fields that change a model overridden. The
    per-layer lists follow from --model.index_topk_pattern and --model.first_k_dense_replace."""

    preset: Annotated[str, tyro.conf.arg(help=f"One of {', '.join(glm5f.PRESETS)} (glm5f.PRESETS).")] = "glm5-tiny"
    init_from: Optional[str] = None
    """A Transformers GLM-5 or GLM-5.3 checkpoint directory to start from (its config.json replaces the preset)."""
    tokenizer_path: Optional[str] = None
    """tokenizer.json (or a directory with one) for text data; default: the built-in byte tokenizer."""
    vocab_size: Optional[int] = None
    """Token ids the model embeds (at least the tokenizer's)."""
    hidden_size: Optional[int] = None
    """Width of the residual stream."""
    intermediate_size: Optional[int] = None
    """Hidden width of the dense MLP layers."""
    moe_intermediate_size: Optional[int] = None
    """Hidden width of each routed (and shared) expert."""
    num_hidden_layers: Optional[int] = None
    """Decoder layers; the preset's index_topk_pattern is dropped unless given again for the new depth."""
    num_attention_heads: Optional[int] = None
    """MLA heads."""
    q_lora_rank: Optional[int] = None
    """Rank of the compressed query latent."""
    kv_lora_rank: Optional[int] = None
    """Rank of the compressed key/value latent (the sparse core's value width)."""
    qk_nope_head_dim: Optional[int] = None
    """Per-head query/key width without rope."""
    qk_rope_head_dim: Optional[int] = None
    """Per-head rotary query/key width (shared by the heads on the key side)."""
    v_head_dim: Optional[int] = None
    """Per-head value width."""
    index_topk: Optional[int] = None
    """Keys each query attends to (DSA's top-k)."""
    index_n_heads: Optional[int] = None
    """Heads of the DSA lightning indexer."""
    index_head_dim: Optional[int] = None
    """Width of each indexer head (its first qk_rope_head_dim dims are rotated)."""
    index_topk_pattern: Optional[str] = None
    """One letter per layer: F runs the layer's own indexer, S reuses the top-k of the last F layer."""
    first_k_dense_replace: Optional[int] = None
    """The first k layers have a dense MLP, the rest MoE."""
    n_routed_experts: Optional[int] = None
    """Routed experts per MoE layer."""
    n_shared_experts: Optional[int] = None
    """Shared experts per MoE layer (always on)."""
    num_experts_per_tok: Optional[int] = None
    """Routed experts each token is sent to."""
    n_group: Optional[int] = None
    """Expert groups of the group-limited router."""
    topk_group: Optional[int] = None
    """Groups each token's experts are chosen from."""
    routed_scaling_factor: Optional[float] = None
    """Scale of the routed experts' weights."""
    max_position_embeddings: Optional[int] = None
    """Longest position the rope tables are made for."""
    tie_word_embeddings: Optional[bool] = None
    """Use the embedding as the LM head."""
    initializer_range: Optional[float] = None
    """Standard deviation of the initial weight matrices."""
    num_nextn_predict_layers: Optional[int] = None
    """Multi-token-prediction (MTP) layers after the main ones, trained with --train.mtp_loss_weight (overrides the
    preset's value: 1 in glm5, else 0)."""
    mtp_shared_depths: Optional[int] = None
    """MTP depths that share the one MTP layer's parameters (GLM-5 trains 3): the layer applied this many times, each
    depth's loss weighted equally in the --train.mtp_loss_weight mean; speculative decoding drafts as many tokens.
    It needs one MTP layer (--model.num_nextn_predict_layers 1); 0 (default): one depth per MTP layer."""

    def overrides(self) -> dict:
        """The model fields set on the command line."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("preset", "init_from", "tokenizer_path") and getattr(self, f.name) is not None}

    def build(self) -> glm5f.GLM5Config:
        """The GLM5Config of this run (without reading init_from)."""
        return glm5f.preset(self.preset, **self.overrides())


@dataclass
class DataConfig:
    type: Optional[str] = None
    """text: the embedded corpus; synthetic: seeded bigram sequences; json_file: JSONL; preset_pt: torch.save'd
    batches; hf_datasets: a datasets.save_to_disk directory; chat: the embedded chat sample, or a JSONL of chat
    records with --data.path; preference: a JSONL of preference pairs for --train.objective dpo (glm5f/data/pairs.py;
    --data.batch_size counts pairs); rollouts: a JSONL of prompts with sampled completions and their rewards for
    --train.objective grpo (glm5f/data/rollouts.py; --data.batch_size counts groups); prompts: a JSONL of prompt records
    that the on-policy sampler completes with the current policy each batch (glm5f/posttrain/sampler.py; --data.batch_size
    counts prompts, each sampled --rl.group_size times). Every JSONL here may also be a parquet file or a folder of
    either. None: from --data.path (.jsonl[.gz], .parquet or a folder of them: json_file, .pt: preset_pt, a saved
    dataset: hf_datasets); text without a path."""
    path: Optional[str] = None
    """File or directory for json_file, preset_pt and hf_datasets (for chat: a JSONL of chat records); a record file
    may be JSON lines (.jsonl[.gz]) or parquet, or a folder of files of one kind, read in name order as one stream."""
    split: Optional[str] = None
    """Split of an hf_datasets DatasetDict."""
    batch_size: int = 16
    """Sequences per optimizer step (the global batch, over all micro-batches and ranks)."""
    seq_len: int = 128
    """Tokens per sequence (input ids and labels; at least 2)."""
    pack: bool = True
    """Pack documents back to back (positions restart per document); else one padded document per row."""
    share_prefixes: tyro.conf.FlagConversionOff[bool] = False
    """preference: each pair's prompt computed once, its answers branching from it (a tree row:
    glm5f/model/tree.py); rollouts and prompts: each group's prompt once, its completions branching from it
    (glm5f/data/rollout_trees.py). The same loss, metrics and gradients as without. Not yet under --parallel.cp."""
    seed: int = 0
    """Seed of the data order (shuffling, synthetic sequences); independent of --train.seed."""
    shuffle_buffer: int = 10000
    """json_file, hf_datasets: records are streamed and drawn at random from a buffer of this many (memory holds
    only these); each epoch is a permutation of the records. 1: the file's order."""
    chat_template: Optional[str] = None
    """A jinja chat template file for chat records ({"messages"} or ShareGPT {"conversations"}); default: the
    tokenizer directory's chat_template.jinja or tokenizer_config.json's, else glm5f's GLM-5-style one."""
    train_on: Literal["assistant", "last", "all"] = "assistant"
    """Chat records: the loss on every assistant turn's tokens, on the last assistant turn's only, or on all."""
    allow_changed: bool = False
    """Resume even though the data files differ from those the checkpoint was saved on (size or content), taking
    the saved position as it is; default: such a resume is an error."""
    format: Literal["glm5f", "slime", "verl", "skyrl", "prime_rl", "nemo_rl", "trl"] = "glm5f"
    """Rollouts data (--data.type rollouts): whose file it is: glm5f's records, or another engine's samples in its
    own field names (glm5f/data/engines.py; docs/posttraining.md has the table)."""
    group_key: Optional[str] = None
    """Another engine's rollouts (--data.format not glm5f), a sample per line: the field its group's samples share (a
    dotted path reaches into an object); default the engine's (verl: uid, slime: group_index, ...). A line holding
    a JSON list is a group."""
    skip_overlong: bool = False
    """rollouts, prompts: a record longer than --data.seq_len (a group with a completion that does not fit; a prompt
    leaving no room for --rl.max_new_tokens) is counted and skipped, the count and the file said at the start
    (verl's filter_overlong_prompts); default: such a record refuses the run. Every record skipped is an error."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """The optimizer (optim.OPTIMIZERS): adamw, or muon (Muon on the hidden matrices, AdamW on the embedding, head,
    norms, biases, router and indexer; one lr and weight decay for both)."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    warmup_steps: int = 20
    """Steps of linear warm-up from lr / warmup_steps to lr; 0: start at lr."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    schedule_steps: Optional[int] = None
    """Steps the warm-up + cosine schedule spans (it ends at lr * min_lr_ratio there). Default: --train.steps; set
    it when resuming with a larger --train.steps to keep the original schedule's total."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices and embeddings only; not norms, biases or the router bias)."""
    b1: float = 0.9
    """AdamW decay rate of the gradient mean (beta1)."""
    b2: float = 0.95
    """AdamW decay rate of the squared-gradient mean (beta2)."""
    eps: float = 1e-8
    """AdamW epsilon, added to the root of the squared-gradient mean."""
    clip_norm: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    bias_update_rate: float = 1e-3
    """Aux-loss-free router balancing: e_score_correction_bias += rate * sign(mean load - load); 0 disables."""
    muon_momentum: float = 0.95
    """Muon's momentum decay (its buffer is the running sum m = momentum * m + g)."""
    muon_nesterov: bool = True
    """Muon orthogonalises the Nesterov look-ahead g + momentum * m (else m)."""
    ns_steps: int = 5
    """Muon's Newton-Schulz iterations."""
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Muon's Newton-Schulz coefficients (a, b, c): X <- a X + (b A + c A A) X, A = X X^T."""
    muon_split: Literal["per_part", "per_head", "none"] = "per_part"
    """Muon Split: per_part orthogonalises q_b_proj per head and RoPE part, kv_b_proj per head and key / value,
    kv_a_proj_with_mqa as latent and RoPE key apart; per_head only per head; none each leaf whole."""


@dataclass
class TrainConfig:
    steps: int = 300
    """Total optimizer steps (a resumed run continues up to this)."""
    objective: str = "lm"
    """The main objective (glm5f.objectives.OBJECTIVES): lm, the next-token cross-entropy; dpo, DPO over preference
    pairs (--data.type preference, --dpo flags). The terms (MTP, indexer, balance) are added to it."""
    grad_accum: int = 1
    """Micro-batches per step; data.batch_size must divide by grad_accum (and by the data-parallel ranks)."""
    query_parts: int = 1
    """Sparse attention runs over this many parts of the queries, each holding the queries of one rank of a
    query_parts-way CP run (chunks r and 2 query_parts - 1 - r), each part's latent-row gradients summed apart and
    then added, as CP ranks sum theirs: each query's output and the key gradients rounded as a CP run rounds them
    (scripts/align.py's CP noise floor). 1: all queries at once."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Compute dtype; parameters and optimizer state stay fp32 (fp64 with float64, for exactness checks)."""
    reduce_dtype: Optional[Literal["float32", "float64"]] = None
    """Dtype of the sums that make gradients: every contraction with a weight (so each weight gradient's sum over
    tokens), the key gradients summed over queries and CP ranks, the sums over ranks and micro-batches. Results
    are rounded to --train.dtype op by op. None: --train.dtype's own (fp32 for bfloat16). float64 with float32:
    every parallel layout computes the one-process fp32 numbers (bit for bit in scripts/align.py); slower than
    fp32 sums (docs/training.md)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass."""
    compile: bool = False
    """torch.compile each decoder layer (regional: one graph per layer, no graph breaks; the sparse attention and
    indexer ops stay opaque). The first step compiles before it runs, and so does the first evaluation
    (docs/accelerator.md)."""
    seed: int = 0
    """Seed of the parameter initialisation and of torch's random state."""
    device: str = "auto"
    """auto (cuda if present, else cpu), cpu, cuda, npu."""
    log_every: int = 10
    """Print a progress line every N steps (when the output is not a terminal)."""
    skip_nonfinite: bool = False
    """On a NaN/inf loss or gradient norm, skip that step's update (logged) and go on; default: stop the run."""
    skip_memory_check: bool = False
    """Start even though the run needs more memory than the device has available (at least the part of its memory
    plan computed without tracing, against host MemAvailable on the CPU, a GPU's free memory; summed over the
    ranks this machine hosts), or launches more than 8 processes a CPU core; default: stop before allocating."""
    trainable: Optional[str] = None
    """Train only the parameters whose dotted path matches this regex (re.search), e.g. indexer; the others get no
    gradient, no optimizer state, and (routers) no bias balancing. Default: all."""
    indexer_loss: Literal["off", "dense", "sparse"] = "off"
    """Train the DSA lightning indexer on the KL from the main attention's head-summed probabilities (detached) to
    the index scores' softmax: dense over every visible key (warm-up), sparse over the selected top-k keys. The
    indexer's inputs are detached, so the rest of the model learns from the LM loss only. off: indexer frozen."""
    indexer_target: str = "own"
    """The indexer loss's target at a full layer: own (its own layer's attention) or mean (the mean of the target
    distributions of the full layer and every shared layer reusing its top-k, so it picks keys for all of them)."""
    indexer_loss_coeff: float = 0.001
    """Weight of the indexer loss (per valid query, summed over indexer layers) in the step's objective."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise auxiliary balance loss (per MoE layer, mean over sequences, summed
    over layers; logged as seq_aux_loss), beside the aux-loss-free bias update; 0: off."""
    mtp_loss_weight: Optional[float] = None
    """Weight of the multi-token-prediction loss (mean over MTP depths of each depth's token mean; mtp_loss in
    metrics.jsonl), added to the LM loss, when the model has MTP layers (--model.num_nextn_predict_layers).
    None: 0.1. Given for a model without MTP layers: a warning (there is no MTP loss to weight)."""


@dataclass
class ParallelConfig:
    dp_shard: int = 1
    """Data-parallel ranks, parameters and optimizer state sharded over them (FSDP)."""
    cp: int = 1
    """Context-parallel ranks: each sequence split over them."""
    ep: int = 1
    """Expert-parallel ranks, carved out of dp_shard x cp."""
    tp: int = 1
    """Tensor parallelism (not built yet: must be 1)."""
    timeout_s: int = 300
    """Seconds a collective waits for every rank before the run stops with an error naming the silent rank."""
    device_memory_gb: Optional[float] = None
    """Memory of one accelerator in GB (10^9 bytes) for --plan; default: the visible accelerator's (none on CPU)."""

    @property
    def world(self) -> int:
        return self.dp_shard * self.cp


@dataclass
class CheckpointConfig:
    dir: str = "runs/default"
    """Run directory: checkpoints/, metrics.jsonl, loss.png."""
    every: int = 100
    """Save every N steps (and at the end); 0: only at the end."""
    keep: int = 3
    """Newest checkpoints kept; 0 keeps all."""
    resume: Optional[str] = None
    """'latest' (the run directory's newest verified checkpoint, or a fresh start if none) or a checkpoint path."""
    trust_unverified: bool = False
    """Let --checkpoint.resume take a checkpoint that has no manifest.json (one written before checkpoints had
    manifests) without checking its files; a checkpoint whose files differ from its manifest is never taken."""
    export_hf: Optional[str] = None
    """Also write the final weights as a Transformers checkpoint to this directory (new, empty, or a previous
    export, which is replaced), with the run's tokenizer files and chat template."""
    export_peft: Optional[str] = None
    """LoRA runs: also write the final adapters as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) to this directory, checked writable before step 1."""
    overwrite: bool = False
    """Start over in a run directory that holds a previous run: delete its checkpoints/, metrics.jsonl, loss.png,
    config.yaml and tokenizer/."""
    replace_export: bool = False
    """Let --checkpoint.export_hf / export_peft replace a previous export that another run starts from
    (--model.init_from), or whose tokenizer files this run's export does not write. Files glm5f did not write are
    never replaced."""
    preempt_grace_s: Optional[float] = None
    """After SIGTERM the ranks finish their step and save one checkpoint together; if that takes longer than this
    many seconds, stop without saving (as a second SIGTERM does). None: no limit."""
    allow_changed: str = ""
    """On resume: the settings (section.field, comma-separated, e.g. dpo.beta,data.path) that may differ from the
    checkpoint's run; the run says so, and config.yaml keeps what each step range ran with. What changes without
    it, and what never: the README's resume section."""

    @property
    def allowed(self) -> tuple[str, ...]:
        """The --checkpoint.allow_changed names, without a leading --."""
        return tuple(n.strip().removeprefix("--") for n in self.allow_changed.split(",") if n.strip())


@dataclass
class LoraConfig:
    """LoRA: low-rank adapters trained beside the frozen base (glm5f.model.lora); --lora.rank 0 trains the base."""

    rank: int = 0
    """Adapter rank r; 0: no adapters (every leaf the run trains is a base leaf)."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (torch's global RNG, restored on resume), not on kv_b_proj's (its adapter
    is merged where MLA reads the matrix). With dropout > 0 the parallel layouts draw different masks, so their
    losses differ."""
    targets: str = DEFAULT_TARGETS
    """Regex (re.search) over module paths of the weights to adapt, e.g. 'self_attn\\.(q_b_proj|o_proj)$',
    'mlp\\.(gate|up|down)_proj$' (dense MLPs), 'shared_experts', 'mlp\\.experts\\.' (routed experts: [E, r, in]
    and [E, out, r] adapters through the grouped GEMM). Default: the attention projections."""
    base_dtype: Optional[Literal["float32", "bfloat16", "float64"]] = None
    """Dtype the frozen base is stored in (it gets no gradient, no optimizer state, no master copy); bfloat16
    halves it. Default: the master dtype (fp32; fp64 in fp64 runs)."""

    def spec(self) -> LoraSpec | None:
        return LoraSpec(self.rank, self.alpha, self.dropout, self.targets) if self.rank else None


@dataclass
class EvalConfig:
    every: int = 100
    """Held-out loss every N steps and at the end (eval_loss, eval_ppl in metrics.jsonl); 0: never."""
    batches: int = 2
    """Held-out batches of --data.batch_size x --data.seq_len per evaluation (the same ones each time)."""
    path: Optional[str] = None
    """Held-out data in --data.type's format (JSONL for text and synthetic runs). Default: text: every 20th
    document of the embedded corpus (never trained on); synthetic: sequences from a step training never reaches;
    json_file, hf_datasets, preset_pt: no evaluation unless --eval.path or --eval.split is given."""
    split: Optional[str] = None
    """Split of the hf_datasets DatasetDict at --eval.path (default --data.path) to evaluate on, e.g. test."""
    split_fraction: float = 0.0
    """Hold out this fraction of the --data.path records (json_file, chat, hf_datasets) for evaluation: every
    round(1 / fraction)-th record, counting from that one, is evaluated on and never trained on."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: Optional[Literal["table", "json", "search"]] = None
    """Print the per-rank memory plan of this run instead of running it (table, json, or search: the smallest
    meshes that fit --parallel.device_memory_gb); allocates nothing, starts no process, writes nothing."""


RUN_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def run_config(table: dict | None = None) -> type:
    """The run's Config class: RunConfig's sections, then one section per objective of `table` (default
    glm5f.objectives.OBJECTIVES) that has settings, its `config` dataclass under its `settings` name (--dpo.*,
    --rl.*), each defined once beside its objective's code."""
    rows = (OBJECTIVES if table is None else table).values()
    sections = {r.settings: r.config for r in rows if r.settings and r.config}
    config = dataclasses.make_dataclass("Config", [(name, cls, field(default_factory=cls))
                                                   for name, cls in sections.items()], bases=(RunConfig,))
    config.__module__ = __name__  # where pickle finds it
    return config


Config = run_config()


def current_config() -> type:
    """Config, made again (`run_config`) when the objective table's sections differ from its own: a row added to
    the table at run time brings its flags."""
    global Config
    have = {f.name: f.type for f in dataclasses.fields(Config) if f.name not in RUN_SECTIONS}
    want = {r.settings: r.config for r in OBJECTIVES.values() if r.settings and r.config}
    if have != want:
        Config = run_config()
    return Config


def with_data_type(cfg: Config) -> Config:
    """`cfg` with --data.type filled in from --data.path when not given (see data.infer_data_type), and checked
    to read that path (a ValueError naming both otherwise). Idempotent; the run records the filled-in type."""
    kind = cfg.data.type or infer_data_type(cfg.data.path)
    check_path_fits(kind, cfg.data.path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, type=kind))


def validate(cfg: Config, world_size: int | None = None) -> list[str]:
    """Everything wrong with a run config, each with what to change ([] when it is fine)."""
    errs = []
    try:
        cfg = with_data_type(cfg)
    except ValueError as e:
        errs.append(str(e))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, type=cfg.data.type or "text"))
    if cfg.model.preset not in glm5f.PRESETS:
        errs.append(f"--model.preset {cfg.model.preset!r} is unknown; choose one of {sorted(glm5f.PRESETS)}")
    for name, value, low in [("--train.steps", cfg.train.steps, 1), ("--train.grad_accum", cfg.train.grad_accum, 1),
                             ("--data.batch_size", cfg.data.batch_size, 1), ("--data.seq_len", cfg.data.seq_len, 2),
                             ("--checkpoint.every", cfg.checkpoint.every, 0), ("--checkpoint.keep", cfg.checkpoint.keep, 0),
                             ("--optim.warmup_steps", cfg.optim.warmup_steps, 0),
                             ("--train.log_every", cfg.train.log_every, 1),
                             ("--train.query_parts", cfg.train.query_parts, 1),
                             ("--eval.every", cfg.eval.every, 0), ("--eval.batches", cfg.eval.batches, 1),
                             ("--optim.schedule_steps", cfg.optim.schedule_steps or 0, 0),
                             ("--parallel.timeout_s", cfg.parallel.timeout_s, 1),
                             ("--data.shuffle_buffer", cfg.data.shuffle_buffer, 1),
                             ("--train.seq_aux_loss_coeff", cfg.train.seq_aux_loss_coeff, 0),
                             ("--train.indexer_loss_coeff", cfg.train.indexer_loss_coeff, 0),
                             ("--optim.bias_update_rate", cfg.optim.bias_update_rate, 0),
                             *((f"--parallel.{n}", getattr(cfg.parallel, n), 1) for n in ("dp_shard", "cp", "ep",
                                                                                          "tp"))]:
        if value < low:
            errs.append(f"{name} must be >= {low}, got {value}")
    if cfg.train.reduce_dtype and cfg.train.dtype == "float64" and cfg.train.reduce_dtype != "float64":
        errs.append(f"--train.reduce_dtype {cfg.train.reduce_dtype} is narrower than --train.dtype float64; "
                    f"drop it or use float64")
    if cfg.data.share_prefixes and (cfg.data.type not in ("preference", "rollouts", "prompts") or cfg.parallel.cp > 1):
        errs.append(f"--data.share_prefixes true shares DPO pairs' and GRPO groups' prompts (--data.type preference, "
                    f"rollouts or prompts; --parallel.cp 1) only; got --data.type {cfg.data.type} and --parallel.cp "
                    f"{cfg.parallel.cp}: drop it")
    if cfg.data.skip_overlong and cfg.data.type not in ("rollouts", "prompts"):
        errs.append(f"--data.skip_overlong skips rollouts groups and prompts that do not fit --data.seq_len; "
                    f"--data.type {cfg.data.type} refuses no long record (chat and preference records are cut, text "
                    f"is packed): drop it")
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
        errs.append("--checkpoint.overwrite deletes the checkpoints --checkpoint.resume would continue from; "
                    "pass one of them")
    if cfg.optim.lr <= 0:
        errs.append(f"--optim.lr must be positive, got {cfg.optim.lr}")
    errs += trackers.errors(cfg.metrics) + allow_changed_errors(cfg)
    row = OBJECTIVES.get(cfg.train.objective)
    if row is None:
        errs.append(f"--train.objective {cfg.train.objective!r} is unknown; choose one of {', '.join(OBJECTIVES)}")
    elif row.data_types is not None and cfg.data.type not in row.data_types:
        errs.append(f"--train.objective {cfg.train.objective} trains on --data.type {' or '.join(row.data_types)}, "
                    f"not {cfg.data.type}; pass one of them")
    elif not row.cp and cfg.parallel.cp > 1:
        errs.append(f"--train.objective {cfg.train.objective} does not run under --parallel.cp yet (an answer's "
                    f"log-probabilities would be summed across ranks); use --parallel.dp_shard or --parallel.ep")
    if cfg.data.type not in DATA_TYPES + owned_data_types():
        errs.append(f"--data.type {cfg.data.type!r} is unknown; choose one of "
                    f"{', '.join(DATA_TYPES + owned_data_types())}")
    if (cfg.data.format != "glm5f" or cfg.data.group_key) and cfg.data.type != "rollouts":
        errs.append(f"--data.format and --data.group_key describe a rollouts file, not --data.type {cfg.data.type}")
    elif cfg.data.group_key and cfg.data.format == "glm5f":
        errs.append("--data.group_key groups another engine's samples: glm5f's records hold their group; pass "
                    "--data.format")
    errs += objective_errors(cfg, row)
    if cfg.optim.name not in OPTIMIZERS:
        errs.append(f"--optim.name {cfg.optim.name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    if not 0 <= cfg.optim.muon_momentum < 1 or cfg.optim.ns_steps < 1:
        errs.append(f"--optim.muon_momentum must lie in [0, 1) and --optim.ns_steps be >= 1, got "
                    f"{cfg.optim.muon_momentum} and {cfg.optim.ns_steps}")
    if not all(math.isfinite(c) for c in cfg.optim.ns_coefficients):
        errs.append(f"--optim.ns_coefficients must be finite numbers, got {tuple(cfg.optim.ns_coefficients)}")
    if cfg.optim.schedule_steps is not None and cfg.optim.schedule_steps < cfg.optim.warmup_steps:
        errs.append(f"--optim.schedule_steps {cfg.optim.schedule_steps} ends inside the warm-up (--optim.warmup_steps "
                    f"{cfg.optim.warmup_steps}): the lr would climb to its peak and drop to its floor in one step; pass "
                    f"at least {cfg.optim.warmup_steps}, or a shorter --optim.warmup_steps")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        errs.append(f"--optim.min_lr_ratio must lie in [0, 1], got {cfg.optim.min_lr_ratio}")
    p = cfg.parallel
    if p.tp > 1:
        errs.append(f"--parallel.tp {p.tp}: tensor parallelism is not built yet; use dp_shard, cp and ep")
    if world_size is not None and p.world != world_size:
        errs.append(f"--parallel.dp_shard x --parallel.cp = {p.world} must equal the number of processes "
                    f"({world_size}); change them or the launch")
    if cfg.train.grad_accum >= 1 and p.dp_shard >= 1 and cfg.data.batch_size % (cfg.train.grad_accum * p.dp_shard):
        errs.append(f"--data.batch_size ({cfg.data.batch_size}) must divide by --train.grad_accum x "
                    f"--parallel.dp_shard ({cfg.train.grad_accum} x {p.dp_shard})")
    if cfg.data.type in PATH_TYPES and not cfg.data.path:
        errs.append(f"--data.type {cfg.data.type} needs --data.path")
    if cfg.data.chat_template is not None and not os.path.isfile(cfg.data.chat_template):
        errs.append(f"--data.chat_template {cfg.data.chat_template}: no such file (expected a jinja chat template)")
    if cfg.eval.split_fraction and not (0 < cfg.eval.split_fraction <= 0.5 and cfg.data.path and cfg.data.type in
                                        ("json_file", "chat", "hf_datasets") and not (cfg.eval.path or cfg.eval.split)):
        errs.append(f"--eval.split_fraction {cfg.eval.split_fraction} holds out a part (in (0, 0.5]) of the records "
                    f"of --data.path (json_file, chat or hf_datasets data), instead of --eval.path or --eval.split")
    if cfg.eval.split is not None and cfg.data.type != "hf_datasets":
        errs.append(f"--eval.split needs --data.type hf_datasets (got {cfg.data.type}); pass --eval.path instead")
    elif cfg.eval.split is not None and cfg.eval.path is None and cfg.eval.split == cfg.data.split:
        errs.append(f"--eval.split {cfg.eval.split} is the training split (--data.split): choose another split")
    if cfg.train.device not in ("auto", "cpu", "cuda", "npu") and not cfg.train.device.startswith(("cuda:", "npu:")):
        errs.append(f"--train.device must be auto, cpu, cuda or npu, got {cfg.train.device!r}")
    if cfg.model.preset not in glm5f.PRESETS and not cfg.model.init_from:
        return errs
    run = cfg.model.init_from
    if run and not os.path.isfile(os.path.join(run, "config.json")) and (
            os.path.isdir(os.path.join(run, "checkpoints")) or os.path.isfile(os.path.join(run, "meta.json"))):
        return errs + [f"--model.init_from {run} is a glm5f run (or checkpoint), not a Transformers checkpoint: "
                       f"continue it with --checkpoint.dir {run} --checkpoint.resume latest, or convert it "
                       f"(python scripts/convert.py {run} OUT) and start from --model.init_from OUT"]
    try:
        model = glm5f.GLM5Config.from_hf(cfg.model.init_from) if cfg.model.init_from else cfg.model.build()
    except (ValueError, TypeError, FileNotFoundError) as e:
        return errs + [f"the model config is invalid: {e}"]
    return errs + model_errors(cfg, model)


def parse(argv: list[str], description: str | None = None) -> Config:
    """The Config of a command line: `--config FILE` (a recipe, or a run's config.yaml) with the flags over it."""
    return recipe_file.parse(argv, current_config(), description)


def load_config(path: str) -> Config:
    """The Config of recipe file `path` (`glm5f.run.recipe_file.load_config`)."""
    return recipe_file.load_config(path, current_config())
