"""In-place AdamW against the out-of-place form it replaced: the same bits, in the same (donated) tensors."""

import pytest
import torch
from torch.utils import _pytree as pytree

import glm5f
from glm5f.ops import wide_dtype
from glm5f.optim import adamw_init, adamw_update, leaf_rule, lr_schedule
from glm5f.params import flatten, unflatten


def out_of_place_adamw(params, grads, state, lr, *, b1, b2, eps, weight_decay):
    """The AdamW step as glm5f computed it before it worked in place (new params and moments; inputs untouched)."""
    flat = flatten(params)
    paths = list(state["mu"])
    count = state["count"] + 1
    t = int(count)
    p_old = [flat[p] for p in paths]
    g = [grads[p].to(wide_dtype(grads[p].dtype)) for p in paths]
    mu = torch._foreach_add(torch._foreach_mul([state["mu"][p] for p in paths], b1), g, alpha=1 - b1)
    nu = torch._foreach_add(torch._foreach_mul([state["nu"][p] for p in paths], b2),
                            torch._foreach_mul(g, g), alpha=1 - b2)
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(nu, 1 - b2 ** t)), eps)
    step = torch._foreach_div(torch._foreach_div(mu, 1 - b1 ** t), denom)
    # decayed: the matrices and embeddings; not the norms, biases or the router bias (1-D), written out here, not
    # read from the rule under test
    decay = [1 - lr * weight_decay if flat[p].ndim >= 2 else 1.0 for p in paths]
    p32 = torch._foreach_mul([x.to(wide_dtype(x.dtype)) for x in p_old], decay)
    new = torch._foreach_add(p32, step, alpha=-lr)
    updated = dict(flat)
    updated.update({p: n.to(o.dtype) for p, n, o in zip(paths, new, p_old)})
    return unflatten(updated, params), {"count": count, "mu": dict(zip(paths, mu)), "nu": dict(zip(paths, nu))}


def clone(tree):
    return pytree.tree_map(torch.clone, tree)


@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                                    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_in_place_adamw_is_the_out_of_place_step_bit_for_bit(param_dtype, grad_dtype):
    """Four steps (weight decay on matrices, none on norms, frozen indexer and router bias untouched), gradients
    of wide magnitude range: params and both moments equal the out-of-place reference exactly, and the returned
    trees hold the very tensors passed in (moments fp32 for bf16 params, fp64 for fp64)."""
    params = glm5f.init_params(glm5f.preset("glm5-tiny"), seed=3, dtype=param_dtype)
    state = adamw_init(params)
    ref_params, ref_state = clone(params), clone(state)
    g = torch.Generator().manual_seed(0)
    hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    for step, lr in enumerate([1e-2, 3e-3, 1e-3, 5e-2]):
        grads = {p: (torch.randn(t.shape, generator=g, dtype=torch.float64) * 10.0 ** (step - 2)).to(grad_dtype)
                 for p, t in flatten(params).items() if p in state["mu"]}
        grads_before = clone(grads)
        ids = {p: id(t) for p, t in flatten({"params": params, "mu": state["mu"], "nu": state["nu"]}).items()}
        ref_params, ref_state = out_of_place_adamw(ref_params, grads, ref_state, lr, **hp)
        params, state = adamw_update(params, grads, state, lr, **hp)
        assert {p: id(t) for p, t in flatten({"params": params, "mu": state["mu"], "nu": state["nu"]}).items()} == ids
        assert all(torch.equal(grads[p], grads_before[p]) for p in grads)  # gradients are only read
        assert int(state["count"]) == step + 1
        for name, ours, ref in [("params", params, ref_params), ("mu", state["mu"], ref_state["mu"]),
                                ("nu", state["nu"], ref_state["nu"])]:
            for p, t in flatten(ours).items():
                r = flatten(ref)[p]
                assert t.dtype == r.dtype and torch.equal(t, r), f"step {step + 1} {name} {p}"
    assert state["mu"]["lm_head.weight"].dtype == wide_dtype(param_dtype)
    assert not torch.equal(params["lm_head"]["weight"],
                           glm5f.init_params(glm5f.preset("glm5-tiny"), seed=3, dtype=param_dtype)["lm_head"]["weight"])


def test_schedule_is_linear_warmup_then_cosine():
    """Linear warm-up to the peak, then cosine to peak * min_ratio: at a quarter of the decay the cosine is at
    (1 + cos(pi / 4)) / 2 of the way down, not a linear 3/4."""
    peak, warmup, total, low = 2.0, 10, 110, 0.1
    assert [lr_schedule(i, peak=peak, warmup=warmup, total=total, min_ratio=low) for i in (0, 4, 9)] == \
        pytest.approx([0.2, 1.0, 2.0])
    quarter = lr_schedule(35, peak=peak, warmup=warmup, total=total, min_ratio=low)
    assert quarter == pytest.approx(peak * (low + (1 - low) * (1 + 2 ** -0.5) / 2))
    assert quarter != pytest.approx(peak * (low + (1 - low) * 0.75))
    assert lr_schedule(total + 5, peak=peak, warmup=warmup, total=total, min_ratio=low) == pytest.approx(peak * low)


def test_decay_rule_of_every_leaf():
    """leaf_rule: AdamW with decay on matrices and embeddings, without on 1-D leaves, the router bias balanced, the
    indexer frozen unless its loss trains it; checked against the list written out here."""
    params = glm5f.init_params(glm5f.preset("glm5-tiny"))
    for path, t in flatten(params).items():
        if path.endswith("e_score_correction_bias"):
            want = "balance"
        elif ".indexer." in path:
            want = "frozen"
        else:
            want = "decay" if t.ndim >= 2 else "no_decay"
        assert leaf_rule(path, t.ndim) == want, path
        if ".indexer." in path:
            assert leaf_rule(path, t.ndim, indexer=True) == ("decay" if t.ndim >= 2 else "no_decay"), path
