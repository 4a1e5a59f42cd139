"""Memory plan of a run: per-rank bytes of parameters, gradients, optimizer state, FSDP's gathered weights and
activations, from shapes and the run's sharding rules alone (nothing is allocated, no process group starts).

    python train.py --plan table --model.preset glm5 --parallel.dp_shard 256 --parallel.ep 64 --data.seq_len 4096

What it models is what the code does: `micro_loss` gathers the embedding, final norm, head and MTP layers once per
micro-batch and each decoder layer as it runs; with activation checkpointing a layer's gathered weights are freed
after its forward and gathered again for its backward, without it autograd keeps them all; AdamW updates in place
with one temporary list (`ADAMW_UPDATE_COPIES`), Muon one leaf or one exchange batch of matrices at a time (the
optimizer says: `optim.Optimizer.state_bytes` and `update_bytes`); what autograd keeps for the backward is traced
from the layers themselves (see "activations"). B rows and S queries of this rank, T keys (the whole sequence).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard
from torch.multiprocessing.reductions import StorageWeakRef

from glm5f.core.config import GLM5Config
from glm5f.model.env import make_env
from glm5f.core.layers import LeafKind, kinds, layer_spec
from glm5f.model.head import head_chunk_rows, head_loss_sum, shift_labels
from glm5f.model.decoder import decoder_layer, main_head
from glm5f.core.ops import wide_dtype
from glm5f.train.optim import ADAMW_UPDATE_COPIES, Held, Optimizer, adamw, leaf_rule, make_optimizer
from glm5f.model.lora import DEFAULT_TARGETS, LoraSpec, adapter_shapes, is_adapter
from glm5f.parallel.layout import Layout, cp_positions, mesh_shapes, placements
from glm5f.core.params import Leaf, abstract_params, flatten, leaf_dtype, leaf_kind, map_with_path, param_layout
from glm5f.objectives import OBJECTIVES

GB = 10**9  # --parallel.device_memory_gb and the table count decimal gigabytes (an H200 has 141 GB)


@dataclass(frozen=True)
class RunShape:
    """What of a run the plan depends on (the `Config` fields, as plain values)."""

    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    dtype: str = "float32"
    reduce_dtype: str | None = None
    remat: bool = False
    lora_rank: int = 0
    lora_targets: str = DEFAULT_TARGETS
    base_dtype: str | None = None
    objective: str = "lm"
    settings: object = None  # the objective's flags (its Config section), for its plan_bytes
    data_type: str | None = None
    precompute_reference: bool = False

    @property
    def lora(self) -> LoraSpec | None:
        return LoraSpec(self.lora_rank, targets=self.lora_targets) if self.lora_rank else None

    @property
    def world(self) -> int:
        return self.dp_shard * self.cp

    @property
    def micro_batch(self) -> int:
        """Rows of one micro-batch on one rank."""
        return max(1, self.batch_size // (self.grad_accum * self.dp_shard))

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(the activations' dtype, the compute weights': --train.reduce_dtype, default the activations')."""
        act = getattr(torch, self.dtype)
        return act, getattr(torch, self.reduce_dtype) if self.reduce_dtype else act


def run_shape(cfg) -> RunShape:
    """The RunShape of a train.py `Config`."""
    p, t = cfg.parallel, cfg.train
    lo = getattr(cfg, "lora", None)
    return dataclasses.replace(
        RunShape(p.dp_shard, p.cp, p.ep, cfg.data.batch_size * rows_per_item(cfg), cfg.data.seq_len, t.grad_accum,
                 t.dtype, t.reduce_dtype, t.activation_checkpointing,
                 *((lo.rank, lo.targets, lo.base_dtype) if lo else ())),
        objective=getattr(t, "objective", "lm"), settings=objective_settings(cfg), data_type=cfg.data.type,
        precompute_reference=bool(getattr(objective_settings(cfg), "precompute_reference", False)))


def rows_per_item(cfg) -> int:
    """Rows of a batch per --data.batch_size item: the main objective's (`Objective.rows_per_item`: a GRPO
    group's completions), else 1."""
    row = OBJECTIVES.get(getattr(cfg.train, "objective", "lm"))
    return row.rows_per_item(cfg) if row is not None else 1


def objective_settings(cfg) -> object:
    """The flags of the run's main objective (its Config section, e.g. cfg.rl), None when it has none."""
    row = OBJECTIVES.get(getattr(cfg.train, "objective", "lm"))
    return getattr(cfg, row.settings, None) if row is not None and row.settings else None


# ---- parameters, gradients, optimizer state -----------------------------------------------------------------------

def local_shape(shape: tuple[int, ...], placements: list, mesh_shape: tuple[int, ...],
                coords: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a rank at mesh coordinates `coords` holds of a tensor laid out with `placements` (DTensor's
    rule: each Shard(d) cuts dim d into mesh_shape[i] chunks of ceil(size / chunks), the last ones short or empty)."""
    out = list(shape)
    for pl, k, c in zip(placements, mesh_shape, coords):
        if isinstance(pl, Shard):
            out[pl.dim] = Shard.local_shard_size_and_offset(out[pl.dim], k, c)[0]
    return tuple(out)


def mesh_coords(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinates of `rank` in a mesh (as init_device_mesh numbers its ranks)."""
    coords = []
    for k in reversed(mesh_shape):
        rank, c = divmod(rank, k)
        coords.append(c)
    return tuple(reversed(coords))


def leaf_groups(cfg: GLM5Config, lora: LoraSpec | None = None) -> Counter:
    """Counter of (shape, logical axes, stays fp32, trained, base, parts, unit) -> how many leaves: the plan's unit
    of work (a few dozen groups for the full GLM-5, whose 78 layers repeat the same shapes). trained: the leaf's
    `LeafKind.optim` label where it is trained (which optimizer rule it gets), "" where not. base: a leaf of a LoRA
    run's frozen base (stored in --lora.base_dtype, never trained); with `lora` its adapters are leaves too (the
    trained ones). parts: its `LeafKind.parts` (Muon Split). unit is what the leaf is gathered with: None for the
    leaves gathered once per micro-batch (embedding, final norm, head, MTP layers), else (kind, n) for a decoder
    layer of one of the n layers sharing that kind's leaves (`apply` gathers one at a time).
    """
    layers: dict[int, list] = {}
    groups = Counter()
    shapes = {path: tuple(leaf.shape) for path, leaf in
              flatten(param_layout(cfg), is_leaf=lambda x: isinstance(x, Leaf)).items()}
    if lora is not None:
        shapes.update(adapter_shapes(abstract_params(cfg), lora))
    for path, shape in shapes.items():
        kind = leaf_kind(path)
        base = lora is not None and not is_adapter(path)
        trained = kind.optim if not base and leaf_rule(path, len(shape)) in ("decay", "no_decay") else ""
        key = (shape, kind.axes, kind.fp32, trained, base, kind.parts)  # fp32: stays fp32 whatever the dtype
        parts = path.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) < cfg.num_hidden_layers:
            layers.setdefault(int(parts[2]), []).append(key)
        else:
            groups[key + (None,)] += 1
    kinds = Counter(tuple(sorted(keys)) for keys in layers.values())
    for i, (keys, n) in enumerate(kinds.items()):
        for key in keys:
            groups[key + ((i, n),)] += n
    return groups


def state_bytes(cfg: GLM5Config, run: RunShape, rank: int = 0, groups: Counter | None = None,
                optimizer: Optimizer | None = None) -> dict[str, int]:
    """Bytes one rank holds of: "params" (the stored fp32 masters, every leaf; a LoRA run's base in its
    --lora.base_dtype), "trained" (its trained leaves, in the master dtype: what gradients take), "optimizer"
    (the state of `optimizer`, default AdamW: two moments a trained element, Muon one on its leaves), "update"
    (what the optimizer's update holds on top), "gathered" (the weights micro_loss builds for
    the forward, in their compute dtype: the full leaf, the ep share of routed experts; 0 in one process, where
    the forward reads the stored leaves, unless the compute dtype differs), "gathered_once" (its part gathered
    once per micro-batch), "largest_layer_gathered" (one decoder layer's, the largest) and "largest_gathered" (one
    leaf's).
    """
    groups = leaf_groups(cfg, run.lora) if groups is None else groups
    act, weight = run.dtypes
    master = torch.promote_types(act, torch.float32)
    shapes = mesh_shapes(run.dp_shard, run.cp, run.ep)
    optimizer = optimizer or adamw()
    out = dict(params=0, trained=0, optimizer=0, update=0, gathered=0, gathered_once=0, largest_layer_gathered=0,
               largest_gathered=0)
    updated = []  # each trained leaf as this rank holds it (`optim.Held`), for the optimizer's update
    per_layer = Counter()
    stored_base = getattr(torch, run.base_dtype) if run.lora_rank and run.base_dtype else master
    for (shape, axes, fp32, trained, base, parts, unit), count in groups.items():
        mesh, stored, gathered, _ = placements(axes)
        if run.world > 1:
            coords = mesh_coords(rank, shapes[mesh])
            held = local_shape(shape, stored, shapes[mesh], coords)
            full = math.prod(local_shape(shape, gathered, shapes[mesh], coords))
        else:
            held, full = shape, math.prod(shape)
        local = math.prod(held)
        w_bytes = (wide_dtype(weight) if fp32 else weight).itemsize
        stored_dtype = stored_base if base else master
        out["params"] += count * local * (wide_dtype(stored_dtype) if fp32 else stored_dtype).itemsize
        out["trained"] += count * local * master.itemsize * bool(trained)
        if trained:
            rule = optimizer.name if trained in optimizer.takes else "decay"
            out["optimizer"] += count * optimizer.state_bytes(rule, local, master.itemsize)
            fsdp = (stored[0].dim if isinstance(stored[0], Shard) else None, shapes[mesh][0])
            updated += [Held(rule, LeafKind(axes, fp32, trained, parts), shape, held, fsdp)] * count
        entering = torch.promote_types(stored_dtype, weight) if run.reduce_dtype else stored_dtype  # micro_loss's
        copy = run.world > 1 or w_bytes != (wide_dtype(entering) if fp32 else entering).itemsize
        out["gathered"] += count * full * w_bytes * copy
        if unit is None:
            out["gathered_once"] += count * full * w_bytes * copy
        else:
            per_layer[unit] += count * full * w_bytes * copy
        out["largest_gathered"] = max(out["largest_gathered"], full * w_bytes)
    out["largest_layer_gathered"] = max((b // n for (_, n), b in per_layer.items()), default=0)
    out["update"] = optimizer.update_bytes(updated, master.itemsize)
    return out


# ---- activations --------------------------------------------------------------------------------------------------
# What autograd keeps is traced, not modelled: each kind of decoder layer (each distinct `layers.layer_spec`: dense
# or MoE MLP, own indexer or shared top-k) and the head run on FakeTensors (shapes and dtypes: no memory, no
# compute) under saved_tensors_hooks, and the storages they save are counted, so a new kernel or adapter changes the
# plan with no edit here. Each storage's bytes are bilinear in the rows B and this rank's queries S (per row, per
# query, per key, or per layer), so four traces give every micro-batch and CP split of a sequence length
# (`traced_activations`). Two things stay analytic (`layer_transient`, from each kind's `layers.Kind.transient`):
# the buffers inside the custom ops of glm5f.kernels.dsa (a trace sees their outputs only), and how routed rows split
# over experts and EP ranks, which depends on the data: the trace gives every expert its rows in one grouped GEMM
# ([M, in] inputs), as balanced routing does.

class TraceLayout(Layout):
    """CP rank 0 of a run, to trace its layers: its positions of each sequence, keys over all T positions and
    per-chunk values over all chunks as fresh tensors (as the CP all-gather makes them), every expert local."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp = cp

    def share(self, B: int, S: int) -> tuple[slice, torch.Tensor | None]:
        return slice(None), None if self.cp == 1 else cp_positions(S, self.cp, 0)

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        return self.chunks(local)

    def chunks(self, local: torch.Tensor) -> torch.Tensor:
        return local if self.cp == 1 else local.repeat(1, self.cp, *[1] * (local.ndim - 2))


def saved_bytes(fn, outside: set) -> tuple[object, list[int]]:
    """(fn(), the bytes of each storage autograd saves for the backward while fn runs, in the order saved, but
    those in `outside`); a storage saved by several ops counts once, as memory holds it."""
    saved = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in outside:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), list(saved.values())


def trace(cfg: GLM5Config, run: RunShape, B: int) -> dict[object, list[int]]:
    """What a micro-batch of B rows keeps for the backward on CP rank 0 of run.cp, traced: for each kind of
    decoder layer (its `layers.LayerSpec`), the bytes of each storage it saves, then of what it keeps when
    checkpointed (its input and the top-k it passes on, 0 for none); "head": what the final norm, head and
    cross-entropy save; "rope": the rope tables (saved by every layer, held once)."""
    act, weight = run.dtypes
    T, layout = run.seq_len, param_layout(cfg)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "position_ids": torch.arange(T).expand(B, T)}
    local, env = make_env(cfg, batch, act, TraceLayout(run.cp))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        mask = dataclasses.replace(env.mask, **{f.name: fake(getattr(env.mask, f.name))
                                                for f in dataclasses.fields(env.mask)})
        # the accelerators' attention: the sparse core (the CPU's dense top-k form is not what the plan sizes)
        env = dataclasses.replace(env, cos=fake(env.cos), sin=fake(env.sin), mask=mask, topk_dense=False)
        outside = {StorageWeakRef(t.untyped_storage()) for t in [env.cos, env.sin, *vars(mask).values()]
                   if isinstance(t, torch.Tensor)}

        def weights(tree: dict) -> dict:  # the compute weights, trained ones requiring gradients, kept outside
            p = map_with_path(lambda path, leaf: torch.empty(leaf.shape, dtype=leaf_dtype(path, weight))
                              .requires_grad_(leaf_rule(path, len(leaf.shape)) in ("decay", "no_decay")),
                              tree, is_leaf=lambda x: isinstance(x, Leaf))
            outside.update(StorageWeakRef(t.untyped_storage()) for t in flatten(p).values())
            return p

        def hidden(streams: int = 1) -> torch.Tensor:  # a layer's input: [B, S, D], or its residual's streams
            shape = (*local["input_ids"].shape, *((streams,) if streams > 1 else ()), cfg.hidden_size)
            return torch.empty(shape, dtype=act, requires_grad=True)

        out, carry = {"rope": [env.cos.nbytes + env.sin.nbytes]}, None
        mtp = [cfg.mtp_layer(d) for d in range(1, cfg.mtp_depths + 1)]
        for i in list(range(cfg.num_hidden_layers)) + mtp:  # an MTP layer runs as a decoder layer of its kind
            kind = layer_spec(cfg, i)
            if kind in out:
                continue
            carry = None if i in mtp else carry
            p, x_BxSxD = weights(layout["model"]["layers"][i]), hidden(cfg.hc_mult if kind.residual == "hyper" else 1)
            (_, selection, _), saved = saved_bytes(lambda: decoder_layer(p, x_BxSxD, cfg, i, env, carry), outside)
            passed = 0 if selection is None or selection is carry or selection.topk is None else selection.topk.nbytes
            out[kind] = saved + [x_BxSxD.nbytes, passed]
            carry = selection
        top = weights({**layout, "model": {k: v for k, v in layout["model"].items() if k != "layers"}})
        x_BxSxD = hidden()
        out["head"] = saved_bytes(lambda: head_loss_sum(main_head(top, cfg), x_BxSxD, shift_labels(local["input_ids"]),
                                                        cfg.rms_norm_eps), outside)[1]
    return out


def traced_activations(cfg: GLM5Config, run: RunShape, cache: dict | None = None) -> dict[object, list[int]]:
    """`trace` of the run's micro-batch (B rows, S = T / cp queries) from traces at B = 2, 3 (B = 1 lays some saved
    tensors out as views of larger ones: it is traced itself) and, under CP, S = T / 2, T / 4 (the layers' CP
    paths, e.g. KDA's, are other ops than one process's), each storage's bytes bilinear in B and S; the traces are
    kept in `cache`."""
    cache = {} if cache is None else cache
    B, T = run.micro_batch, run.seq_len
    bs = (1, 1) if B == 1 else (2, 3)
    cps = (1, 1) if run.cp == 1 else (2, 4) if T % 8 == 0 else (2, 2)  # cp_positions: 2 cp chunks
    for b, cp in {(b, cp) for b in bs for cp in cps}:
        key = ("trace", T, run.dtype, run.reduce_dtype, b, cp)
        if key not in cache:
            cache[key] = trace(cfg, dataclasses.replace(run, cp=cp), b)
    at = lambda b, cp: cache["trace", T, run.dtype, run.reduce_dtype, b, cp]  # noqa: E731
    v = (B - bs[0]) / (bs[1] - bs[0]) if bs[1] != bs[0] else 0  # where B and S lie between the traced sizes
    u = (T // run.cp - T // cps[0]) / (T // cps[1] - T // cps[0]) if cps[1] != cps[0] else 0
    out = {}
    for kind in at(bs[0], cps[0]):
        sizes = [at(b, cp)[kind] for cp in cps for b in bs]
        if len({len(x) for x in sizes}) > 1:
            raise RuntimeError(f"the memory plan's traces of layer kind {kind} saved different numbers of tensors "
                               f"at two sizes: extending them to the run's size needs the same ops at every size")
        out[kind] = [round(a + v * (b - a) + u * (c - a) + v * u * (d - c - b + a)) for a, b, c, d in zip(*sizes)]
    return out


def layer_transient(cfg: GLM5Config, layer: int, B: int, S: int, T: int, run: RunShape, largest: int) -> int:
    """The largest buffers decoder layer `layer` holds on top of what it saves: in the forward those its kinds
    make inside glm5f.kernels.dsa ops (`layers.Kind.transient`: the indexer's chunk of scores with its top-k keys, the
    sparse core's block of gathered rows); in the backward twice the largest saved storage (its gradient and one
    temporary) plus its kinds' backward buffers."""
    act, weight = run.dtypes
    spec = layer_spec(cfg, layer)
    fwd, bwd = 0, 2 * largest
    for kind in kinds(spec):
        f, b = kind.transient(cfg, spec, B, S, T, act, weight)
        fwd, bwd = max(fwd, f), bwd + b
    return max(fwd, bwd)


def activation_bytes(cfg: GLM5Config, run: RunShape, remat: bool | None = None, cache: dict | None = None) -> dict:
    """Peak activation bytes of one micro-batch on one rank: "layers" (what the decoder layers and MTP depths keep
    for the backward, with the rope tables), "logits" (what the final norm, head and cross-entropy keep: each
    head's hidden states, its logits made in chunks by `head.head_loss_sum`), "transient" (the largest
    short-lived buffers on top), "peak" (their sum) and "logits_transient" (the heads' transient: one chunk's).
    With `remat` (default: the run's) a layer keeps only its input and top-k, and one layer at a time is
    recomputed in the backward. `cache`: see `traced_activations`."""
    remat = run.remat if remat is None else remat
    traced = traced_activations(cfg, run, cache)
    B = run.micro_batch
    S, T = run.seq_len // run.cp, run.seq_len
    per_layer = []  # (saved, transient, kept when checkpointed) of each decoder layer, then of each MTP depth's
    for i in list(range(cfg.num_hidden_layers)) + [cfg.mtp_layer(d) for d in range(1, cfg.mtp_depths + 1)]:
        *saved, x, passed = traced[layer_spec(cfg, i)]
        per_layer.append((sum(saved), layer_transient(cfg, i, B, S, T, run, max(saved)), x + passed))
    # each head (the main one, each MTP depth's) keeps its hidden states; one chunk of logits is alive at a time
    rope, logits = sum(traced["rope"]), sum(traced["head"]) * (1 + cfg.mtp_depths)
    act, weight = run.dtypes
    a, w, lat = act.itemsize, wide_dtype(act).itemsize, torch.promote_types(act, weight).itemsize
    # the backward of a chunk (`head.HeadLosses`): its logits (and their cast to the activations' dtype), the
    # log-probabilities the cross-entropy saved, the gradients of the loss and of the log-softmax, in fp32
    chunk = min(B * S, head_chunk_rows(cfg.vocab_size)) * cfg.vocab_size
    logits_transient = chunk * (lat + (a if a < lat else 0) + 3 * w)
    # checkpointed, a layer keeps its input and top-k, and its saved tensors come back in the backward one at a time
    layers = sum(kept if remat else saved for saved, _, kept in per_layer)
    transient = max([tr + (saved if remat else 0) for saved, tr, _ in per_layer] + [logits_transient])
    return dict(layers=layers + rope, logits=logits, transient=transient, peak=layers + rope + logits + transient,
                logits_transient=logits_transient)


# ---- the plan -----------------------------------------------------------------------------------------------------

def phases(s: dict, run: RunShape, activations: int, objective: int = 0) -> dict[str, int]:
    """Rank 0's bytes in each phase of a step, less the runtime, from its `state_bytes` `s`, the activations' peak
    and what the main objective holds beyond the LM step (`objective`, in both phases): "forward_backward" (params,
    optimizer state, the previous micro-batches' gradients, the gathered weights and the activations), "update"
    (params, optimizer state, gradients and the optimizer's temporaries), and two of their lines: "gathered" and
    "reduce_copy" (the copies --train.reduce_dtype makes)."""
    master = wide_dtype(run.dtypes[0])
    # --train.reduce_dtype wider than the masters: the step's params copy in it, gradients in it until the end
    ratio = run.dtypes[1].itemsize // master.itemsize if run.reduce_dtype else 1
    reduce_extra = s["params"] * ratio + s["trained"] * (ratio - 1) if ratio > 1 else 0
    grads, state = s["trained"], s["optimizer"]
    # with activation checkpointing one decoder layer's gathered weights are alive at a time (recomputed with the
    # layer in the backward); without it autograd keeps every layer's for the backward
    gathered = s["gathered_once"] + s["largest_layer_gathered"] if run.remat else s["gathered"]
    fwd_bwd = (s["params"] + state + reduce_extra + (grads if run.grad_accum > 1 else 0) + gathered
               + activations + s["largest_gathered"] * (run.world > 1) + objective)
    return dict(forward_backward=fwd_bwd, update=s["params"] + state + grads + s["update"] + objective,
                gathered=gathered,
                reduce_copy=reduce_extra)


def kept_activation_bytes(cfg: GLM5Config, run: RunShape) -> int:
    """What a micro-batch keeps for the backward whether its layers are recomputed or not, by formula (nothing
    traced, so it costs nothing at any size): each decoder layer's and MTP depth's input [B, S, D] (its residual's
    streams [B, S, hc_mult, D] under hyper-connections) and the rope tables (cos and sin [B, S, rope_dim / 2]), in
    the activations' dtype. A lower bound of `activation_bytes`'s peak with or without checkpointing."""
    B, S = run.micro_batch, run.seq_len // run.cp
    layers = list(range(cfg.num_hidden_layers)) + [cfg.mtp_layer(d) for d in range(1, cfg.mtp_depths + 1)]
    streams = sum(cfg.hc_mult if layer_spec(cfg, i).residual == "hyper" else 1 for i in layers)
    rope = 2 * ((cfg.qk_rope_head_dim + 1) // 2)
    return B * S * (streams * cfg.hidden_size + rope) * run.dtypes[0].itemsize


def least_total(cfg: GLM5Config, run: RunShape, optimizer: Optimizer | None = None,
                activations: bool = True) -> dict[str, int]:
    """A lower bound of `plan`'s total less the runtime, in closed form (nothing traced: fast for any model and
    sequence length): the plan's update phase exactly, its forward/backward with the activations it counts cut
    to `kept_activation_bytes` (0 without `activations`). {"update", "forward_backward", "activations", "total"},
    in bytes; a run whose plan fits a memory size has this total within it too."""
    s = state_bytes(cfg, run, 0, None, optimizer or adamw())
    kept = kept_activation_bytes(cfg, run) if activations else 0
    phase = phases(s, run, kept, OBJECTIVES[run.objective].plan_bytes(cfg, run, s))
    return dict(update=phase["update"], forward_backward=phase["forward_backward"], activations=kept,
                total=max(phase["update"], phase["forward_backward"]))


def plan(cfg: GLM5Config, run: RunShape, runtime_bytes: int = 0, device_bytes: int | None = None,
         groups: Counter | None = None, cache: dict | None = None, optimizer: Optimizer | None = None) -> dict:
    """The memory plan of rank 0 (the largest shards) of a run: every line in bytes, and which phase peaks.

    total = runtime + max(forward/backward, update): forward/backward holds params, optimizer state, the previous
    micro-batches' gradients (grad_accum > 1), the gathered weights and the activations at their peak (the start of
    the backward); the update holds params, optimizer state, gradients and the optimizer's temporaries; both hold
    what the main objective (`objectives.OBJECTIVES[run.objective]`) needs beyond the LM step (its `plan_bytes`).
    `optimizer`: default AdamW. `groups` (`leaf_groups(cfg)`) and `cache` (a dict of activations and traces by
    micro-batch shape) save work over many plans.
    """
    optimizer = optimizer or adamw()
    s = state_bytes(cfg, run, 0, groups, optimizer)
    grads, state = s["trained"], s["optimizer"]
    cache = {} if cache is None else cache
    key = (run.micro_batch, run.seq_len, run.cp, run.dtype, run.reduce_dtype)
    if key not in cache:
        cache[key] = activation_bytes(cfg, run, True, cache), activation_bytes(cfg, run, False, cache)
    with_remat, without_remat = cache[key]
    acts = with_remat if run.remat else without_remat
    objective = OBJECTIVES[run.objective].plan_bytes(cfg, run, s)
    phase = phases(s, run, acts["peak"], objective)
    fwd_bwd, step_end, gathered, reduce_extra = (phase["forward_backward"], phase["update"], phase["gathered"],
                                                 phase["reduce_copy"])
    total = runtime_bytes + max(fwd_bwd, step_end)
    return dict(world=run.world, dp_shard=run.dp_shard, cp=run.cp, ep=run.ep, params_bytes=s["params"],
                grads_bytes=grads, optimizer=optimizer.name, optimizer_bytes=state, gathered_bytes=gathered,
                reduce_copy_bytes=reduce_extra, objective=run.objective, objective_bytes=objective,
                activations_bytes=acts["peak"],
                activations_remat_bytes=with_remat["peak"], activations_no_remat_bytes=without_remat["peak"],
                activation_layers_bytes=acts["layers"], activation_logits_bytes=acts["logits"],
                activation_logits_transient_bytes=acts["logits_transient"],
                activation_transient_bytes=acts["transient"], optimizer_update_transient_bytes=s["update"],
                runtime_bytes=runtime_bytes, forward_backward_bytes=runtime_bytes + fwd_bwd,
                update_bytes=runtime_bytes + step_end, peak_phase="forward/backward" if fwd_bwd >= step_end else
                "update", total_bytes=total, device_bytes=device_bytes,
                fits=None if device_bytes is None else total <= device_bytes)


def process_rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set size now ("VmRSS"), or its peak since it started ("VmHWM"), from /proc; 0 where
    there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def device_memory(cfg, device: torch.device) -> tuple[int | None, str]:
    """(bytes per rank, where the figure comes from): --parallel.device_memory_gb, else the visible accelerator's,
    else none on the CPU."""
    gb = getattr(cfg.parallel, "device_memory_gb", None)
    if gb:
        return int(gb * GB), "--parallel.device_memory_gb"
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory, torch.cuda.get_device_name()
    return None, "no device limit"


def _gb(x: int | None) -> str:
    return "-" if x is None else f"{x / GB:10.3f} GB"


def format_table(p: dict, model_name: str, run: RunShape, limit_note: str) -> str:
    """The plan as a table of lines, one per item, in GB (10^9 bytes)."""
    master = wide_dtype(run.dtypes[0])
    rows = [
        (f"parameters ({str(master).replace('torch.', '')} master shards)" if not run.lora_rank else
         f"parameters (base {run.base_dtype or str(master).replace('torch.', '')} + LoRA r{run.lora_rank})",
         p["params_bytes"]),
        ("gradients (trained leaves)" if not run.lora_rank else "gradients (the adapters)", p["grads_bytes"]),
        ({"adamw": "optimizer (AdamW mu + nu)", "muon": "optimizer (Muon momentum, AdamW mu + nu)"}.get(
            p["optimizer"], f"optimizer ({p['optimizer']} state)"), p["optimizer_bytes"]),
        (f"gathered parameters ({'one layer at a time' if run.remat else 'all layers'})", p["gathered_bytes"]),
    ]
    if p["reduce_copy_bytes"]:
        rows.append(("params + grads in --train.reduce_dtype", p["reduce_copy_bytes"]))
    if p["objective_bytes"]:
        rows.append((f"objective {p['objective']} (beyond the LM step)", p["objective_bytes"]))
    elif run.precompute_reference:
        rows.append((f"objective {p['objective']} (reference precomputed)", 0))
    rows += [
        (f"activations {'with' if run.remat else 'without'} checkpointing", p["activations_bytes"]),
        ("  decoder layers (kept for backward)", p["activation_layers_bytes"]),
        ("  final norm + logits + cross-entropy", p["activation_logits_bytes"]),
        ("  largest transient", p["activation_transient_bytes"]),
        ("    (the head's chunk of logits)", p["activation_logits_transient_bytes"]),
        (f"  (activations {'without' if run.remat else 'with'} checkpointing)",
         p["activations_no_remat_bytes" if run.remat else "activations_remat_bytes"]),
        (f"AdamW update transient ({ADAMW_UPDATE_COPIES} cop{'y' if ADAMW_UPDATE_COPIES == 1 else 'ies'})"
         if p["optimizer"] == "adamw" else f"{p['optimizer']} update transient", p["optimizer_update_transient_bytes"]),
    ]
    if p["runtime_bytes"]:
        rows.append(("runtime (python + torch, measured)", p["runtime_bytes"]))
    rows += [("peak in forward/backward", p["forward_backward_bytes"]), ("peak in the update", p["update_bytes"]),
             (f"total (peak: {p['peak_phase']})", p["total_bytes"])]
    head = (f"memory plan of {model_name}: dp_shard {run.dp_shard} x cp {run.cp} = {run.world} ranks, ep {run.ep}; "
            f"micro-batch {run.micro_batch} x {run.seq_len // run.cp} tokens per rank ({run.dtype}); per rank (rank 0)")
    lines = [head] + [f"  {name:<44}{_gb(v)}" for name, v in rows]
    if p["device_bytes"] is None:
        lines.append(f"  {'device memory':<44}{limit_note}")
    else:
        verdict = "fits" if p["fits"] else "does NOT fit"
        lines.append(f"  {'device memory (' + limit_note + ')':<44}{_gb(p['device_bytes'])}  -> {verdict}")
    return "\n".join(lines)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def search(cfg: GLM5Config, run: RunShape, device_bytes: int, runtime_bytes: int = 0, max_world: int = 8192,
           show: int = 8, optimizer: Optimizer | None = None) -> list[dict]:
    """Plans of the smallest meshes that fit `device_bytes` per rank: world sizes in powers of two up to
    max_world, every cp (the sequence cut into 2 cp equal chunks; cp 1 where a layer kind runs without CP),
    dp_shard = world / cp dividing the batch, every ep dividing the ranks and the experts; for each dp_shard x cp
    its ep of least memory, the `show` best by (world, total)."""
    groups, cache = leaf_groups(cfg, run.lora), {}
    specs = [layer_spec(cfg, i) for i in range(cfg.num_hidden_layers)]
    has_moe = any(kind.experts for spec in specs for kind in kinds(spec))
    max_cp = max_world if all(kind.cp for spec in specs for kind in kinds(spec)) else 1
    found = []
    for world in _powers_of_two(max_world):
        for cp in _powers_of_two(min(world, max_cp)):
            dp = world // cp
            if run.seq_len % (2 * cp) or run.batch_size % (run.grad_accum * dp):
                continue
            eps = [e for e in range(1, world + 1) if world % e == 0 and has_moe and cfg.n_routed_experts % e == 0]
            plans = [plan(cfg, dataclasses.replace(run, dp_shard=dp, cp=cp, ep=ep), runtime_bytes, device_bytes,
                          groups, cache, optimizer) for ep in eps or [1]]
            best = min(plans, key=lambda p: p["total_bytes"])
            if best["fits"]:
                found.append(best)
        if len(found) >= show:
            break
    return sorted(found, key=lambda p: (p["world"], p["total_bytes"]))[:show]


def print_plan(cfg, mode: str, model_cfg: GLM5Config, device: torch.device, model_name: str) -> None:
    """--plan table | json | search for a train.py `Config` (prints; allocates nothing)."""
    run = run_shape(cfg)
    optimizer = make_optimizer(cfg.optim, model_cfg)
    device_bytes, note = device_memory(cfg, device)
    runtime = process_rss_bytes() if device.type == "cpu" else 0
    if mode == "search":
        if device_bytes is None:
            raise ValueError("--plan search needs a memory size to fit: pass --parallel.device_memory_gb (e.g. 141)")
        found = search(cfg=model_cfg, run=run, device_bytes=device_bytes, runtime_bytes=runtime, optimizer=optimizer)
        print(f"smallest meshes for {model_name} at batch {run.batch_size} x {run.seq_len} tokens ({run.dtype}"
              f"{', activation checkpointing' if run.remat else ''}) within {device_bytes / GB:.0f} GB per rank:")
        if not found:
            print("  none up to 8192 ranks")
        for p in found:
            print(f"  dp_shard {p['dp_shard']:>5} x cp {p['cp']:>3} = {p['world']:>5} ranks, ep {p['ep']:>3}: "
                  f"{p['total_bytes'] / GB:7.1f} GB (params {p['params_bytes'] / GB:.1f}, gathered "
                  f"{p['gathered_bytes'] / GB:.1f}, optimizer {p['optimizer_bytes'] / GB:.1f}, activations "
                  f"{p['activations_bytes'] / GB:.1f}; peak in {p['peak_phase']})")
        return
    p = plan(model_cfg, run, runtime, device_bytes, optimizer=optimizer)
    if mode == "json":
        print(json.dumps(dict(p, model=model_name, device_memory_source=note)))
    else:
        print(format_table(p, model_name, run, note))
