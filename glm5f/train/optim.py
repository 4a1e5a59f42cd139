"""Optimizers as pure functions over the params tree (optax style): AdamW and Muon behind one interface
(`Optimizer`: init, update, state bytes), global-norm clipping, warmup + cosine schedule, the router bias rule.

How each leaf is treated comes from its `params.leaf_kinds()` label (`LeafKind.optim`) through `leaf_rule(path)`;
`--train.trainable` narrows the trained set further:
  decay     AdamW with weight decay       matrices and embeddings (under Muon: those it does not take)
  no_decay  AdamW without weight decay    norm scales and biases (1-D)
  muon      Muon (--optim.name muon)      the hidden matrices (label "hidden"), routed experts one by one
  frozen    untouched                     the DSA indexer, unless trained by its own loss (--train.indexer_loss)
  balance   bias += rate * sign(mean load - load), no gradient    the router's e_score_correction_bias
A LoRA run (--lora.rank) trains the adapters' factors only: the base is frozen, router biases included.
A new optimizer is a factory in `OPTIMIZERS` (this file); the labels it takes are a field of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils import _pytree as pytree

from glm5f.core.config import GLM5Config
from glm5f.core.layers import LeafKind
from glm5f.model.lora import is_adapter
from glm5f.core.ops import wide_dtype
from glm5f.parallel.layout import full_tensor, local_tensor
from glm5f.core.params import flatten, leaf_kind, unflatten


def leaf_rule(path: str, ndim: int, indexer: bool = False, takes: tuple[str, ...] = (), name: str = "") -> str:
    """How the leaf at `path` is optimized, from its `params.LEAF_KINDS` label; `indexer`: the DSA indexer is
    trained (by the indexer loss). An optimizer that takes the labels `takes` (Muon: "hidden") gives those leaves
    its own rule `name`; every other trained leaf is AdamW's ("decay" for matrices, "no_decay" for 1-D leaves)."""
    kind = leaf_kind(path).optim
    if kind == "balance":
        return "balance"
    if kind == "indexer" and not indexer:
        return "frozen"
    if kind in takes:
        return name
    return "decay" if ndim >= 2 else "no_decay"


def matches(pattern: str | None, path: str) -> bool:
    """Whether --train.trainable `pattern` (a regex, re.search; None: everything) selects the leaf at `path`."""
    return pattern is None or re.search(pattern, path) is not None


def trained_paths(params: dict, trainable: str | None = None, indexer: bool = False, lora: bool = False) -> list[str]:
    """Paths of the leaves AdamW updates (rule decay or no_decay, matched by the `trainable` regex), in tree
    order; with `lora`, the LoRA adapters' factors only (the base frozen)."""
    return [p for p, t in flatten(params).items()
            if leaf_rule(p, t.ndim, indexer) in ("decay", "no_decay") and matches(trainable, p)
            and (not lora or is_adapter(p))]


def value_and_grad(fn: Callable, has_aux: bool = False, paths: list[str] | None = None):
    """JAX-like value_and_grad over the trained leaves of the first argument (a params tree), by eager autograd.

    Returns g(params, *args) -> (fn's value or (value, aux), {path: gradient}); unused leaves get zeros. `paths`:
    the leaves to differentiate (default `trained_paths(params)`); the others are constants.
    """
    def wrapped(params: dict, *args, **kwargs):
        flat = flatten(params)
        trained = set(trained_paths(params) if paths is None else paths)
        live = {p: (t.detach().requires_grad_() if p in trained else t.detach()) for p, t in flat.items()}
        out = fn(unflatten(live, params), *args, **kwargs)
        value = out[0] if has_aux else out
        leaves = [live[p] for p in flat if p in trained]
        grads = torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad else [None] * len(leaves)
        grads = {p: (g if g is not None else torch.zeros_like(t)) for p, t, g in
                 zip((p for p in flat if p in trained), leaves, grads)}
        detached = pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
        return detached, grads
    return wrapped


def adamw_init(params: dict, paths: list[str] | None = None) -> dict:
    """{"count": 0, "mu": {path: zeros}, "nu": {path: zeros}} for the trained leaves `paths` (default
    `trained_paths(params)`; fp32 moments, fp64 for fp64 leaves). Leaves without state are never updated."""
    flat = flatten(params)
    paths = trained_paths(params) if paths is None else paths
    zeros = lambda: {p: torch.zeros_like(flat[p], dtype=wide_dtype(flat[p].dtype)) for p in paths}  # noqa: E731
    return {"count": torch.zeros((), dtype=torch.int64), "mu": zeros(), "nu": zeros()}


def adamw_update(params: dict, grads: dict[str, torch.Tensor], state: dict, lr: float, *, b1: float = 0.9,
                 b2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1) -> tuple[dict, dict]:
    """One AdamW step (decoupled weight decay on "decay" leaves), in place. Returns (params, state).

    params and state are donated, as JAX donates buffers: the trained leaves, state["mu"] and state["nu"] are
    consumed and updated where they lie, and the returned trees hold the same tensors (only "count" is new), so
    the step needs no second copy of them; keep a clone of anything whose old value is still wanted. grads are
    only read. Besides the moments, one temporary list the size of the trained leaves is alive at a time (g*g,
    then the denominator, then the step; an fp32 copy of each low-precision leaf in turn, and of the gradients
    that are not fp32 already). The float operations are those of the out-of-place form, in the same order, so
    the results are the same bit for bit. Works on DTensor leaves (the foreach ops run shard by shard).
    """
    flat = flatten(params)
    paths = list(state["mu"])
    count = state["count"] + 1
    if not paths:  # nothing of AdamW's to train (Muon takes every trained leaf)
        return params, {"count": count, "mu": state["mu"], "nu": state["nu"]}
    t = int(count)
    p_leaves = [flat[p] for p in paths]
    mu, nu = [state["mu"][p] for p in paths], [state["nu"][p] for p in paths]
    g = [grads[p].to(wide_dtype(grads[p].dtype)) for p in paths]
    torch._foreach_mul_(mu, b1)
    torch._foreach_add_(mu, g, alpha=1 - b1)
    tmp = torch._foreach_mul(g, g)
    del g
    torch._foreach_mul_(nu, b2)
    torch._foreach_add_(nu, tmp, alpha=1 - b2)
    del tmp  # freed before the next list is made
    tmp = list(torch._foreach_div(nu, 1 - b2 ** t))
    torch._foreach_sqrt_(tmp)
    torch._foreach_add_(tmp, eps)  # the denominator
    for i, m in enumerate(mu):  # the step (mu / bc1) / denominator, leaf by leaf into the denominator's place
        step = torch._foreach_div([m], 1 - b1 ** t)
        torch._foreach_div_(step, [tmp[i]])
        tmp[i] = step[0]
    decay = [1 - lr * weight_decay if leaf_rule(p, flat[p].ndim, indexer=True) == "decay" else 1.0 for p in paths]
    for group in ([i for i, x in enumerate(p_leaves) if x.dtype == wide_dtype(x.dtype)],
                  *([i] for i, x in enumerate(p_leaves) if x.dtype != wide_dtype(x.dtype))):
        # fp32 (fp64) leaves together, in place; each low-precision leaf through an fp32 copy, rounded back
        p32 = [p_leaves[i].to(wide_dtype(p_leaves[i].dtype)) for i in group]
        torch._foreach_mul_(p32, [decay[i] for i in group])
        torch._foreach_add_(p32, [tmp[i] for i in group], alpha=-lr)
        for i, new in zip(group, p32):
            if new is not p_leaves[i]:
                p_leaves[i].copy_(new)
    return params, {"count": count, "mu": state["mu"], "nu": state["nu"]}


# ---- the optimizer interface -------------------------------------------------------------------------------------

# Extra full-size copies of the trained leaves alive during the AdamW step: it updates params and moments in place
# through one temporary list (g*g, then the denominator, then the step; `adamw_update`).
ADAMW_UPDATE_COPIES = 1


class Held(NamedTuple):
    """A trained leaf as one rank holds it, what `Optimizer.update_bytes` reads: its rule (`Optimizer.rule`), its
    LeafKind, its whole shape, the shape of this rank's piece, and how its FSDP shards split it (`fsdp_split`)."""

    rule: str
    kind: LeafKind
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    fsdp: tuple[int | None, int]

    @property
    def local(self) -> int:
        return math.prod(self.local_shape)


def fsdp_split(t: torch.Tensor) -> tuple[int | None, int]:
    """(the dim a leaf's FSDP shards split, None if they do not; the ranks of its FSDP group): its placement on
    its mesh's first dim, "fsdp" (every rank), or "edp" for routed experts (the ranks sharing one copy of an EP
    rank's experts; `parallel.placements`). A plain tensor: (None, 1)."""
    if not isinstance(t, DTensor):
        return None, 1
    first = t.placements[0]
    return (first.dim if isinstance(first, Shard) else None), t.device_mesh.size(0)


@dataclass(frozen=True)
class Optimizer:
    """An optimizer as pure functions over the params tree (optax's `GradientTransformation`, updating in place as
    `adamw_update` does: params and state donated, gradients only read).

    init(params, paths) -> state: the state of the trained leaves `paths`, a tree of tensors (checkpoints keep
    it whole, resharded like the params). update(params, grads, state, lr) -> (params, state): one step.
    state_bytes(rule, n, itemsize): the state of a leaf of `n` elements under its `leaf_rule`, in bytes, its
    moments `itemsize` bytes an element. update_bytes(leaves, itemsize): the most the update holds beyond params,
    gradients and state, for the trained leaves as this rank holds them (a list of `Held`). takes: the
    `LeafKind.optim` labels whose leaves get the rule `name`. meta: what a checkpoint records of the state (a
    resume checks it)."""

    name: str
    init: Callable[[dict, list[str]], dict]
    update: Callable[[dict, dict, dict, float], tuple[dict, dict]]
    state_bytes: Callable[[str, int, int], int]
    update_bytes: Callable[[list[Held], int], int]
    takes: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    def rule(self, path: str, ndim: int, indexer: bool = False) -> str:
        """`leaf_rule` of the leaf at `path` under this optimizer."""
        return leaf_rule(path, ndim, indexer, self.takes, self.name)


def adamw(o=None, model_cfg: GLM5Config | None = None) -> Optimizer:
    """AdamW (`adamw_update`) with --optim's b1, b2, eps and weight_decay (None: adamw_update's defaults): two
    moments a trained element."""
    hp = {} if o is None else dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    return Optimizer(
        "adamw", init=adamw_init, update=lambda params, grads, state, lr: adamw_update(params, grads, state, lr, **hp),
        state_bytes=lambda rule, n, itemsize: 2 * n * itemsize,
        update_bytes=lambda leaves, itemsize: ADAMW_UPDATE_COPIES * sum(leaf.local for leaf in leaves) * itemsize,
        meta={"name": "adamw"})


# Newton-Schulz defaults (those of torch.optim.Muon and Moonlight): a quintic iteration whose coefficients push
# the slope at zero up, 5 steps; the input is first divided by max(its Frobenius norm, NS_EPS).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(x_NxRxC: torch.Tensor, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """Each of the N matrices [R, C] brought near U V^T (its singular values to about 1) by `steps` iterations of
    X <- a X + (b A + c A A) X, A = X X^T, on the wide orientation (R <= C), after X / max(|X|_F, eps); in the
    input's dtype, all N in one batched iteration."""
    a, b, c = coefficients
    tall = x_NxRxC.shape[-2] > x_NxRxC.shape[-1]
    x = x_NxRxC.mT if tall else x_NxRxC
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram_NxRxR = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram_NxRxR, gram_NxRxR, gram_NxRxR, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


MUON_SPLITS = ("per_part", "per_head", "none")


def muon_blocks(path: str | LeafKind, shape: tuple[int, ...], cfg: GLM5Config,
                split: str = "per_part") -> tuple[int, list[int]]:
    """Muon Split of the leaf at `path` (or of its LeafKind; its last two dims a matrix [rows, cols]; routed
    experts one matrix each): (blocks along the rows, the rows of each part of a block). A leaf whose
    `LeafKind.parts` names its rows' parts: "per_part" cuts it per head (rows of axis "heads") and each head into
    those parts (q_b_proj: each head's no-RoPE and RoPE rows; kv_b_proj: each head's key and value rows;
    kv_a_proj_with_mqa: the latent and the shared RoPE key); "per_head" per head only (kv_a_proj_with_mqa whole);
    "none" whole. Any other leaf is whole."""
    kind, rows = leaf_kind(path) if isinstance(path, str) else path, shape[-2]
    if split not in MUON_SPLITS:
        raise ValueError(f"--optim.muon_split must be one of {', '.join(MUON_SPLITS)}, found {split!r}")
    if split == "none" or not kind.parts:
        return 1, [rows]
    heads = cfg.num_attention_heads if kind.axes[-2] == "heads" else 1
    parts = [getattr(cfg, name) for name in kind.parts]
    if heads * sum(parts) != rows:
        raise ValueError(f"{path if isinstance(path, str) else kind}: {rows} rows do not split into {heads} blocks "
                         f"of {' + '.join(kind.parts)} = {sum(parts)} rows; fix its LeafKind.parts in "
                         f"params.LEAF_KINDS")
    return heads, [rows // heads] if split == "per_head" else parts


def orthogonalised(u: torch.Tensor, path: str, cfg: GLM5Config, split: str = "per_part", steps: int = NS_STEPS,
                   coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """Muon's update of the leaf at `path` from its momentum `u` (whole matrices: [rows, cols], or experts
    [E, rows, cols]): each block of `muon_blocks` orthogonalised apart (`orthogonalise_blocks`)."""
    return orthogonalise_blocks(u, muon_blocks(path, tuple(u.shape), cfg, split)[1], steps, coefficients, eps)


def orthogonalise_blocks(u: torch.Tensor, parts: list[int], steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS,
                         eps: float = NS_EPS) -> torch.Tensor:
    """Muon's update of `u` [..., rows, cols], its rows whole blocks of sum(parts) rows (a whole leaf, or the whole
    heads of a shard): each part of each block orthogonalised apart (all blocks' part of one shape in one batched
    iteration) and scaled by 0.2 sqrt(max(its rows, cols)), the RMS of an AdamW update (Moonlight's rule)."""
    x_NxRxC = u.reshape(-1, sum(parts), u.shape[-1])  # every block of every matrix
    out_NxRxC = torch.empty_like(x_NxRxC)
    start = 0
    for n in parts:
        o = newton_schulz(x_NxRxC[:, start:start + n], steps, coefficients, eps)
        out_NxRxC[:, start:start + n] = o * (0.2 * math.sqrt(max(n, x_NxRxC.shape[-1])))
        start += n
    return out_NxRxC.reshape(u.shape)


# ---- Muon under FSDP / EP: each matrix orthogonalised whole, on one rank --------------------------------------------

class Cut(NamedTuple):
    """How the FSDP ranks of a Muon leaf cut each of its matrices: matrix dim `dim` (-2 rows, -1 columns), rank r
    holding sizes[r] of it (DTensor's rule: ceil-sized pieces in rank order, the last ones short or empty)."""

    dim: int
    sizes: tuple[int, ...]


def muon_cut(shape: tuple[int, ...], block_rows: int, dim: int | None, ranks: int) -> Cut | None:
    """The Cut of a Muon leaf of `shape` (matrices [rows, cols] on its last two dims, each of blocks of
    `block_rows` rows: `muon_blocks`) whose shards split dim `dim` over `ranks` ranks (None: not split); None where
    each rank holds whole blocks and orthogonalises them itself, with no communication: one process, routed experts
    split along the expert dim (EP), or rows split at block boundaries (whole heads of a Muon Split leaf)."""
    if dim is None or ranks == 1 or dim < len(shape) - 2:
        return None
    pieces = [Shard.local_shard_size_and_offset(shape[dim], ranks, r) for r in range(ranks)]
    if dim == len(shape) - 2 and all(n % block_rows == 0 and (n == 0 or at % block_rows == 0) for n, at in pieces):
        return None
    return Cut(dim - len(shape), tuple(n for n, _ in pieces))


def muon_batches(leaves: list[tuple[object, int, int]]) -> list[list[int]]:
    """The exchange batches of the cut Muon leaves [(key: the same for leaves of one matrix shape and cut,
    matrices it holds, ranks cutting them)]: the leaves of one key in order, a batch closed once it holds as many
    matrices as ranks (so each rank orthogonalises about one); lists of indices into `leaves`, the keys in order
    of their first leaf. Every rank of a group computes the same batches."""
    by_key: dict = {}
    for i, (key, _, _) in enumerate(leaves):
        by_key.setdefault(key, []).append(i)
    batches = []
    for indices in by_key.values():
        batch, matrices = [], 0
        for i in indices:
            batch.append(i)
            matrices += leaves[i][1]
            if matrices >= leaves[i][2]:
                batches.append(batch)
                batch, matrices = [], 0
        if batch:
            batches.append(batch)
    return batches


def exchange_orthogonalised(pieces: list[torch.Tensor], parts: list[tuple[int, ...]], cut: Cut, group, rank: int,
                            first: int, ns: dict) -> list[torch.Tensor]:
    """Muon's update of K matrices of one shape cut over the ranks of `group` as `cut` says, each orthogonalised
    whole on one rank: matrix j on rank (first + j) % ranks (round robin). `pieces`: this rank's piece of each,
    `parts`: each one's Muon Split parts. One all-to-all gives each owner every rank's piece of its matrices, the
    owner orthogonalises them (those of one `parts` in one batched iteration, `orthogonalise_blocks`), a second
    gives each rank its piece of every result. Returns this rank's pieces of the K updates."""
    ranks, d, K = len(cut.sizes), cut.dim, len(pieces)
    owner = [(first + j) % ranks for j in range(K)]
    mine = [j for j in range(K) if owner[j] == rank]
    order = sorted(range(K), key=lambda j: owner[j])  # what this rank sends, grouped by destination
    held = [owner.count(r) for r in range(ranks)]

    def cut_to(n: int) -> tuple[int, ...]:  # the shape of a matrix with n of its cut dim
        return tuple(n if i == d % 2 else s for i, s in enumerate(pieces[0].shape))
    numel = [math.prod(cut_to(n)) for n in cut.sizes]
    send = torch.cat([pieces[j].reshape(-1) for j in order])
    recv = send.new_empty(len(mine) * sum(numel))
    dist.all_to_all_single(recv, send, [len(mine) * n for n in numel], [h * numel[rank] for h in held], group=group)
    del send
    from_rank = recv.split([len(mine) * n for n in numel])
    result = {}
    for p in dict.fromkeys(parts[j] for j in mine):  # the owned matrices of one Muon Split in one iteration
        ks = [k for k, j in enumerate(mine) if parts[j] == p]
        x_KxRxC = recv.new_empty(len(ks), *cut_to(sum(cut.sizes)))
        for i, k in enumerate(ks):  # matrix k's pieces from every rank, joined whole
            torch.cat([from_rank[r][k * numel[r]:(k + 1) * numel[r]].view(cut_to(n)) for r, n in enumerate(cut.sizes)],
                      dim=d, out=x_KxRxC[i])
        result.update(zip((mine[k] for k in ks), orthogonalise_blocks(x_KxRxC, list(p), **ns).unbind(0)))
        del x_KxRxC
    del recv, from_rank
    offsets = [sum(cut.sizes[:r]) for r in range(ranks)]
    back = torch.cat([result[j].narrow(d, offsets[r], cut.sizes[r]).reshape(-1) for r in range(ranks) for j in mine]
                     or [pieces[0].new_empty(0)])
    del result
    got = back.new_empty(K * numel[rank])
    dist.all_to_all_single(got, back, [h * numel[rank] for h in held], [len(mine) * n for n in numel], group=group)
    out = [None] * K
    for i, j in enumerate(order):
        out[j] = got[i * numel[rank]:(i + 1) * numel[rank]].view(pieces[0].shape)
    return out


def muon(o, model_cfg: GLM5Config) -> Optimizer:
    """Muon on the leaves labelled "hidden" (their momentum one tensor a leaf, fp32, sharded like the leaf), AdamW
    (--optim's b1, b2, eps) on the other trained leaves; the same learning rate and decoupled weight decay.

    Under FSDP / EP each matrix (or Muon Split block) is orthogonalised once, on one rank: a rank holding whole
    blocks (its EP experts, whole heads) orthogonalises its own with no communication (`muon_cut`); the other
    leaves go in batches of one matrix shape (`muon_batches`), each matrix orthogonalised whole by one rank of its
    FSDP group and sent back in pieces (`exchange_orthogonalised`)."""
    takes, hp = ("hidden",), dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    ns = dict(steps=o.ns_steps, coefficients=tuple(o.ns_coefficients))

    def parts_of(path: str | LeafKind, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(muon_blocks(path, shape, model_cfg, o.muon_split)[1])

    def init(params: dict, paths: list[str]) -> dict:
        flat = flatten(params)
        own = [p for p in paths if leaf_rule(p, flat[p].ndim, True, takes, "muon") == "muon"]
        state = adamw_init(params, [p for p in paths if p not in own])
        state["momentum"] = {p: torch.zeros_like(flat[p], dtype=wide_dtype(flat[p].dtype)) for p in own}
        return state

    def update(params: dict, grads: dict, state: dict, lr: float) -> tuple[dict, dict]:
        params, adam = adamw_update(params, grads, {k: state[k] for k in ("count", "mu", "nu")}, lr, **hp)
        flat, momentum = flatten(params), state["momentum"]

        def look_ahead(path: str) -> torch.Tensor:  # this rank's piece of the Nesterov momentum; m updated in place
            m, g = local_tensor(momentum[path]), local_tensor(grads[path])
            m.mul_(o.muon_momentum).add_(g.to(m.dtype))  # a running sum (torch.optim.Muon keeps (1 - momentum) m)
            return g.to(m.dtype).add(m, alpha=o.muon_momentum) if o.muon_nesterov else m

        def apply(path: str, step: torch.Tensor) -> None:
            p = local_tensor(flat[path])
            p32 = p.to(step.dtype)
            p32.mul_(1 - lr * o.weight_decay).add_(step, alpha=-lr)
            if p32 is not p:
                p.copy_(p32)

        exchanged = []  # (path, Cut, matrices this rank holds) of the leaves whose matrices are cut over ranks
        for path, m in momentum.items():
            parts = parts_of(path, tuple(m.shape))
            cut = muon_cut(tuple(m.shape), sum(parts), *fsdp_split(m))
            if cut is None:  # whole blocks here: leaf by leaf, no communication
                apply(path, orthogonalise_blocks(look_ahead(path), list(parts), **ns))
            else:
                exchanged.append((path, cut, math.prod(local_tensor(m).shape[:-2])))
        keys = [((momentum[p].device_mesh.mesh_dim_names, cut, tuple(momentum[p].shape[-2:]), momentum[p].dtype), n,
                 len(cut.sizes)) for p, cut, n in exchanged]
        turn = 0  # the rank owning the next matrix (round robin over the batches)
        for batch in muon_batches(keys):
            leaves = [exchanged[i] for i in batch]
            cut, mesh = leaves[0][1], momentum[leaves[0][0]].device_mesh
            pieces = []  # this rank's piece of each matrix of the batch
            for p, _, _ in leaves:
                u = look_ahead(p)
                pieces += u.reshape(-1, *u.shape[-2:]).unbind(0)
            del u
            parts = [parts_of(p, tuple(momentum[p].shape)) for p, _, n in leaves for _ in range(n)]
            steps = exchange_orthogonalised(pieces, parts, cut, mesh.get_group(0), mesh.get_local_rank(0),
                                            turn % len(cut.sizes), ns)
            del pieces
            turn += len(steps)
            for p, _, n in leaves:
                apply(p, torch.stack(steps[:n]).reshape(local_tensor(momentum[p]).shape))
                del steps[:n]
        return params, {**adam, "momentum": momentum}

    def state_bytes(rule: str, n: int, itemsize: int) -> int:
        return (1 if rule == "muon" else 2) * n * itemsize

    def update_bytes(leaves: list[Held], itemsize: int) -> int:
        # AdamW's list first; then each Muon leaf whose rank holds whole blocks, one at a time: its Nesterov
        # momentum and the momentum's copy, inside Newton-Schulz the normalised and the next iterate with A and
        # bA + cAA, the result and its scaled copy (each at most the leaf's piece); then each exchange batch: its
        # pieces of the Nesterov momentum and the buffer sending them (or the pieces coming back), the matrices
        # this rank owns whole (received, joined, Newton-Schulz's as above, the result and the buffer sending it)
        adam = ADAMW_UPDATE_COPIES * sum(leaf.local for leaf in leaves if leaf.rule != "muon")
        most, exchanged = [adam], []  # (key, matrices held, ranks, elements held, elements of one matrix)
        for leaf in leaves:
            cut = leaf.rule == "muon" and muon_cut(leaf.shape, sum(parts_of(leaf.kind, leaf.shape)), *leaf.fsdp)
            if leaf.rule == "muon" and cut is None:
                most.append(8 * leaf.local)
            elif cut:
                exchanged.append(((cut, leaf.shape[-2:]), math.prod(leaf.local_shape[:-2]), len(cut.sizes),
                                  leaf.local, math.prod(leaf.shape[-2:])))
        for batch in muon_batches([x[:3] for x in exchanged]):
            owned = -(-sum(exchanged[i][1] for i in batch) // exchanged[batch[0]][2]) * exchanged[batch[0]][4]
            most.append(2 * sum(exchanged[i][3] for i in batch) + 7 * owned)
        return max(most) * itemsize

    return Optimizer("muon", init, update, state_bytes, update_bytes, takes,
                     meta={"name": "muon", "momentum": "sum",
                           "momentum_rule": "m = momentum * m + g (a running sum; torch.optim.Muon keeps the "
                                            "running average (1 - momentum) * m)"})


# The optimizers --optim.name names: a factory (OptimConfig, GLM5Config) -> Optimizer each.
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {"adamw": adamw, "muon": muon}


def make_optimizer(o, model_cfg: GLM5Config, lora: bool = False) -> Optimizer:
    """The optimizer --optim.name names, with the other --optim flags. A LoRA run (`lora`) trains its factors with
    AdamW whatever the name: Muon takes the hidden matrices, which a LoRA run freezes (`unused_flags` says so)."""
    if o.name not in OPTIMIZERS:
        raise ValueError(f"--optim.name must be one of {', '.join(OPTIMIZERS)}, found {o.name!r}")
    return OPTIMIZERS["adamw" if lora else o.name](o, model_cfg)


MUON_FLAGS = ("muon_momentum", "muon_nesterov", "ns_steps", "ns_coefficients", "muon_split")  # read only by Muon


def unused_flags(o, lora: bool = False) -> list[str]:
    """A warning for each --optim flag of OptimConfig `o` that the run's optimizer (`make_optimizer`) does not
    read: --optim.name muon in a LoRA run (`lora`), and Muon's own flags given (not at their defaults) when AdamW
    trains."""
    if lora and o.name == "muon":
        return ["--optim.name muon does not apply to a LoRA run: Muon takes the hidden matrices, which LoRA "
                "freezes, so the adapter factors train with AdamW (its checkpoints record adamw); drop "
                "--optim.name muon"]
    if o.name == "muon":
        return []
    default = type(o)()
    why = "a LoRA run trains with AdamW" if lora else "--optim.name adamw does not use it"
    fix = "drop it" if lora else "drop it or pass --optim.name muon"
    return [f"--optim.{name} {getattr(o, name)} is not used: it is Muon's, and {why}; {fix}" for name in MUON_FLAGS
            if _differs(getattr(o, name), getattr(default, name))]


def _differs(a, b) -> bool:
    return (tuple(a) != tuple(b)) if isinstance(b, tuple) else a != b


def global_norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of squared entries) over every gradient, summed in fp64 (so the clip factor does not depend on
    how the gradients are sharded), returned in fp32 (fp64 for fp64 gradients)."""
    grads = list(grads.values())
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    total = torch.linalg.vector_norm(torch.stack([full_tensor(n) for n in norms]))  # sharded norms gathered
    return total.to(wide_dtype(grads[0].dtype)) if grads else total


def clip_by_global_norm(grads: dict[str, torch.Tensor], max_norm: float):
    """(grads scaled so their global norm is at most max_norm, the norm before clipping). max_norm <= 0: no clip.
    grads are donated: scaled in place (no second copy of them), the returned dict is the same."""
    norm = global_norm(grads)
    if max_norm <= 0:
        return grads, norm
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    torch._foreach_mul_(list(grads.values()), scale)
    return grads, norm


def lr_schedule(step: int, *, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps to `peak`, then cosine decay to peak * min_ratio at `total` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_total(optim_cfg, train_cfg) -> int:
    """The step the cosine schedule ends at: --optim.schedule_steps, else --train.steps."""
    return optim_cfg.schedule_steps if optim_cfg.schedule_steps is not None else train_cfg.steps


def schedule_change(saved_run: dict | None, optim_cfg, train_cfg, step: int) -> str | None:
    """On resume at `step`: a line saying the learning rate jumps (or, in the warm-up, decays after it along
    another curve) because the schedule's total differs from the saved run's (e.g. a larger --train.steps), with
    the flag that keeps the original; None when it is the same, the run ends inside the warm-up, or the
    checkpoint does not say."""
    if not saved_run:
        return None
    o, t = saved_run.get("optim") or {}, saved_run.get("train") or {}
    before = o.get("schedule_steps") or t.get("steps")
    now = schedule_total(optim_cfg, train_cfg)
    if before is None or before == now:
        return None
    kw = dict(peak=optim_cfg.lr, warmup=optim_cfg.warmup_steps, min_ratio=optim_cfg.min_lr_ratio)
    old_lr, new_lr = lr_schedule(step, total=before, **kw), lr_schedule(step, total=now, **kw)
    if old_lr != new_lr:
        change = f"so the lr jumps from {old_lr:.2e} to {new_lr:.2e} at step {step + 1}"
    elif step < optim_cfg.warmup_steps:  # the warm-up does not depend on the total
        if train_cfg.steps <= optim_cfg.warmup_steps:
            return None  # this run ends inside the warm-up: its lr is the checkpoint's run's
        change = f"so after the warm-up (step {optim_cfg.warmup_steps}) the lr decays along another curve"
    else:
        change = "so the lr decays along another curve from here"
    return (f"the learning-rate schedule now ends at step {now}, not {before} as in the checkpoint's run, {change}; "
            f"pass --optim.schedule_steps {before} to keep the original schedule")


def balance_router_bias(params: dict, expert_counts: dict[str, torch.Tensor], rate: float) -> dict:
    """Auxiliary-loss-free load balancing: each MoE layer's e_score_correction_bias moves by
    rate * sign(mean load - load) (under-loaded experts up, over-loaded down). expert_counts maps the bias leaf
    path to that layer's token counts per expert for the step. rate 0 leaves params as they are."""
    if rate == 0 or not expert_counts:
        return params
    flat = dict(flatten(params))
    for path, counts in expert_counts.items():
        load = counts.to(torch.float32)
        delta = rate * torch.sign(load.mean() - load).to(flat[path].dtype)
        if isinstance(flat[path], DTensor):  # the same delta, laid out like the leaf
            delta = distribute_tensor(delta, flat[path].device_mesh, flat[path].placements)
        flat[path] = flat[path] + delta
    return unflatten(flat, params)
