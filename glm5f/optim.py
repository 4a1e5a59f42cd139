"""Optimizer as pure functions over the params tree (optax style): AdamW with foreach ops, global-norm clipping,
warmup + cosine schedule, and the router's auxiliary-loss-free bias rule.

How each leaf is treated comes from `params.LEAF_KINDS` (`leaf_rule(path)`); `--train.trainable` narrows the trained
set further:
  decay     AdamW with weight decay       matrices and embeddings
  no_decay  AdamW without weight decay    norm scales and biases (1-D)
  frozen    untouched                     the DSA indexer, unless trained by its own loss (--train.indexer_loss)
  balance   bias += rate * sign(mean load - load), no gradient    the router's e_score_correction_bias
A LoRA run (--lora.rank) trains the adapters' factors only: the base is frozen, router biases included.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree as pytree

from glm5f.lora import is_adapter
from glm5f.ops import wide_dtype
from glm5f.parallel import full_tensor
from glm5f.params import flatten, leaf_kind, unflatten


def leaf_rule(path: str, ndim: int, indexer: bool = False) -> str:
    """How the leaf at `path` is optimized (its `params.LEAF_KINDS` entry); `indexer`: the DSA indexer is trained
    (by the indexer loss)."""
    kind = leaf_kind(path).optim
    if kind == "balance":
        return "balance"
    if kind == "indexer" and not indexer:
        return "frozen"
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
    """On resume at `step`: a line saying the learning rate jumps because the schedule's total differs from the
    saved run's (e.g. a larger --train.steps), with the flag that keeps the original; None when it is the same
    (or the checkpoint does not say)."""
    if not saved_run:
        return None
    o, t = saved_run.get("optim") or {}, saved_run.get("train") or {}
    before = o.get("schedule_steps") or t.get("steps")
    now = schedule_total(optim_cfg, train_cfg)
    if before is None or before == now:
        return None
    kw = dict(peak=optim_cfg.lr, warmup=optim_cfg.warmup_steps, min_ratio=optim_cfg.min_lr_ratio)
    old_lr, new_lr = lr_schedule(step, total=before, **kw), lr_schedule(step, total=now, **kw)
    change = (f"so the lr jumps from {old_lr:.2e} to {new_lr:.2e} at step {step + 1}" if old_lr != new_lr else
              "so the lr decays along another curve from here")
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
