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
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import tyro

import glm5f
from glm5f.run import recipe_file
from glm5f.data import check_path_fits, infer_data_type, load_batches
from glm5f.model.lora import DEFAULT_TARGETS, LoraSpec, target_modules
from glm5f.train.optim import OPTIMIZERS, trained_paths
from glm5f.objectives import OBJECTIVES
from glm5f.data.tokens import make_tokenizer

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
    type: Optional[Literal["text", "synthetic", "json_file", "preset_pt", "hf_datasets", "chat", "preference",
                           "rollouts", "prompts"]] = None
    """text: the embedded corpus; synthetic: seeded bigram sequences; json_file: JSONL; preset_pt: torch.save'd
    batches; hf_datasets: a datasets.save_to_disk directory; chat: the embedded chat sample, or a JSONL of chat
    records with --data.path; preference: a JSONL of preference pairs for --train.objective dpo (glm5f/data/pairs.py;
    --data.batch_size counts pairs); rollouts: a JSONL of prompts with sampled completions and their rewards for
    --train.objective grpo (glm5f/data/rollouts.py; --data.batch_size counts groups); prompts: a JSONL of prompt records
    that the on-policy sampler completes with the current policy each batch (glm5f/posttrain/sampler.py; --data.batch_size
    counts prompts, each sampled --rl.group_size times). None: from --data.path (.jsonl[.gz]: json_file, .pt: preset_pt, a saved dataset:
    hf_datasets); text without a path."""
    path: Optional[str] = None
    """File or directory for json_file, preset_pt and hf_datasets (for chat: a JSONL of chat records)."""
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
    glm5f/model/tree.py); the same loss, metrics and gradients as without. Not yet under --parallel.cp, nor for
    rollouts or prompts."""
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
class DPOConfig:
    beta: float = 0.1
    """DPO: the weight of the implicit reward, in -logsigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))."""
    sft_weight: float = 0.0
    """DPO: the weight of the chosen answers' LM loss added to the DPO loss (RPO); 0: none."""
    reference: Optional[str] = None
    """DPO: the reference model, a Transformers checkpoint directory; default the run's starting weights (a LoRA
    run: its base with the adapters off, no second copy in memory)."""
    precompute_reference: bool = False
    """DPO, full training: compute the reference's log-probabilities of every pair once, in a pass before the first
    step, store them in the run directory (dpo_reference.safetensors, reused while the data and the reference are
    the same) and free the reference, instead of keeping a copy of it in memory."""


@dataclass
class RLConfig:
    loss: Literal["dapo", "grpo"] = "dapo"
    """GRPO: how token losses become the step's: dapo, their sum over the global batch's completion tokens; grpo,
    the mean over completions of each one's token mean."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO: advantages are (reward - its group's mean) over the group's reward std (group), the global batch's
    (batch) or 1 (none); std with Bessel's correction, plus 1e-4."""
    epsilon_low: float = 0.2
    """GRPO: the ratio exp(logp - old) is clipped below at 1 - epsilon_low."""
    epsilon_high: float = 0.28
    """GRPO: the ratio is clipped above at 1 + epsilon_high."""
    tis_cap: float = 2.0
    """GRPO: cap of the truncated importance weight exp(old - rollout) that corrects for the rollout engine's
    log-probabilities (a completion's "logprobs"); 0: no weight."""
    kl_beta: float = 0.0
    """GRPO: weight of the KL estimate exp(ref - logp) - (ref - logp) - 1 to the reference (the run's starting
    weights; a LoRA run's base); 0: none, and no reference is kept."""
    updates_per_batch: int = 1
    """GRPO: optimizer steps taken on each batch of groups (each a --train.steps step); the ratio's old
    log-probabilities are the policy's before the batch's first one."""
    replay: str = ""
    """GRPO: what the forward takes from the rollouts' records instead of choosing it (comma-separated): routing,
    each MoE layer's experts; indexer, each DSA layer's selected keys (GLM-5.3: pools). Empty: none."""
    group_size: int = 8
    """Sampling (--data.type prompts): completions sampled per prompt (at least 2: a group's advantages compare
    them)."""
    temperature: float = 1.0
    """Sampling (--data.type prompts): the temperature (0: greedy); the recorded log-probabilities are at
    temperature 1."""
    top_p: float = 1.0
    """Sampling (--data.type prompts): nucleus sampling, from the most likely tokens holding this much
    probability."""
    max_new_tokens: int = 64
    """Sampling (--data.type prompts): most tokens sampled per completion (a stop token ends one sooner); a prompt
    and this many tokens must fit --data.seq_len."""
    reward: Optional[str] = None
    """Sampling (--data.type prompts): the reward function, module:function (imported with the working directory
    and PYTHONPATH on the path), called per completion with keyword arguments prompt, completion (text),
    prompt_ids, completion_ids and the prompt record's other fields; returns a finite number.
    glm5f.posttrain.rewards:lowercase_share is the toy task's (recipes/grpo-tiny.yaml)."""

    @property
    def replayed(self) -> tuple[str, ...]:
        """The --rl.replay names, in order."""
        return tuple(n.strip() for n in self.replay.split(",") if n.strip())


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
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    plan: Optional[Literal["table", "json", "search"]] = None
    """Print the per-rank memory plan of this run instead of running it (table, json, or search: the smallest
    meshes that fit --parallel.device_memory_gb); allocates nothing, starts no process, writes nothing."""


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
    if cfg.data.share_prefixes and (cfg.data.type != "preference" or cfg.parallel.cp > 1):
        errs.append(f"--data.share_prefixes true shares DPO pairs' prompts (--data.type preference, --parallel.cp 1) "
                    f"only; got --data.type {cfg.data.type} and --parallel.cp {cfg.parallel.cp}: drop it")
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
        errs.append("--checkpoint.overwrite deletes the checkpoints --checkpoint.resume would continue from; "
                    "pass one of them")
    if cfg.optim.lr <= 0:
        errs.append(f"--optim.lr must be positive, got {cfg.optim.lr}")
    row = OBJECTIVES.get(cfg.train.objective)
    if row is None:
        errs.append(f"--train.objective {cfg.train.objective!r} is unknown; choose one of {', '.join(OBJECTIVES)}")
    elif row.data_types is not None and cfg.data.type not in row.data_types:
        errs.append(f"--train.objective {cfg.train.objective} trains on --data.type {' or '.join(row.data_types)}, "
                    f"not {cfg.data.type}; pass one of them")
    elif not row.cp and cfg.parallel.cp > 1:
        errs.append(f"--train.objective {cfg.train.objective} does not run under --parallel.cp yet (an answer's "
                    f"log-probabilities would be summed across ranks); use --parallel.dp_shard or --parallel.ep")
    if cfg.data.type == "preference" and cfg.train.objective != "dpo":
        errs.append(f"--data.type preference holds pairs for --train.objective dpo, not {cfg.train.objective}")
    if cfg.data.type == "rollouts" and cfg.train.objective != "grpo":
        errs.append(f"--data.type rollouts holds sampled completions for --train.objective grpo, not "
                    f"{cfg.train.objective}")
    if cfg.data.type == "prompts" and cfg.train.objective != "grpo":
        errs.append(f"--data.type prompts is sampled for --train.objective grpo, not {cfg.train.objective}")
    r = cfg.rl
    unknown = [n for n in r.replayed if n not in ("routing", "indexer")]
    if unknown:
        errs.append(f"--rl.replay takes routing and/or indexer (comma-separated), found {', '.join(unknown)}")
    if cfg.data.type == "prompts":
        if not r.reward:
            errs.append("--data.type prompts needs --rl.reward module:function (the reward of a sampled completion)")
        if r.group_size < 2 or r.max_new_tokens < 1 or r.temperature < 0 or not 0 < r.top_p <= 1:
            errs.append(f"--rl.group_size must be >= 2, --rl.max_new_tokens >= 1, --rl.temperature >= 0 and "
                        f"--rl.top_p in (0, 1]; got {r.group_size}, {r.max_new_tokens}, {r.temperature}, {r.top_p}")
        if cfg.parallel.cp > 1:
            errs.append("--data.type prompts does not run under --parallel.cp (the decoder does not); sample with "
                        "scripts/rollouts.py and train on --data.type rollouts, or drop --parallel.cp")
    if not (0 <= r.epsilon_low < 1 and r.epsilon_high >= 0 and r.tis_cap >= 0 and r.kl_beta >= 0
            and r.updates_per_batch >= 1):
        errs.append(f"--rl.epsilon_low must lie in [0, 1), --rl.epsilon_high, --rl.tis_cap and --rl.kl_beta be >= 0 "
                    f"and --rl.updates_per_batch >= 1; got {r.epsilon_low}, {r.epsilon_high}, {r.tis_cap}, "
                    f"{r.kl_beta}, {r.updates_per_batch}")
    if cfg.dpo.reference and cfg.lora.rank:
        errs.append("--dpo.reference with --lora.rank: a LoRA run's reference is its base with the adapters off; "
                    "drop --dpo.reference, or train the full model (without --lora.rank)")
    if cfg.dpo.precompute_reference and cfg.lora.rank:
        errs.append("--dpo.precompute_reference with --lora.rank: a LoRA run's reference is its base with the "
                    "adapters off, already in memory at no cost; drop --dpo.precompute_reference")
    elif cfg.dpo.precompute_reference and cfg.train.objective != "dpo":
        errs.append(f"--dpo.precompute_reference is for --train.objective dpo, not {cfg.train.objective}; drop it")
    if cfg.dpo.beta <= 0 or cfg.dpo.sft_weight < 0:
        errs.append(f"--dpo.beta must be positive and --dpo.sft_weight >= 0, got {cfg.dpo.beta} and "
                    f"{cfg.dpo.sft_weight}")
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
    if cfg.data.type in ("json_file", "preset_pt", "hf_datasets", "preference", "rollouts",
                          "prompts") and not cfg.data.path:
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
    return errs + _layout_errors(cfg, model) + _trainable_errors(cfg, model) + _lora_errors(cfg, model) + \
        _tokenizer_errors(cfg, model)


def _tokenizer_errors(cfg: Config, model: glm5f.GLM5Config) -> list[str]:
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


def mesh_errors(cfg: Config, model: glm5f.GLM5Config) -> list[str]:
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


def _layout_errors(cfg: Config, model: glm5f.GLM5Config) -> list[str]:
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


def _trainable_errors(cfg: Config, model: glm5f.GLM5Config) -> list[str]:
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


def _lora_errors(cfg: Config, model: glm5f.GLM5Config) -> list[str]:
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


def parse(argv: list[str], description: str | None = None) -> Config:
    """The Config of a command line: `--config FILE` (a recipe, or a run's config.yaml) with the flags over it."""
    return recipe_file.parse(argv, Config, description)


def load_config(path: str) -> Config:
    """The Config of recipe file `path` (`glm5f.run.recipe_file.load_config`)."""
    return recipe_file.load_config(path, Config)
