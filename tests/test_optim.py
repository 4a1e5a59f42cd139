"""glm5f/train/optim.py: in-place AdamW against the out-of-place form it replaced (the same bits, in the same donated
tensors) and against torch.optim.AdamW, the decay rule, the schedule, clipping, the router bias rule and the leaves
--train.trainable selects."""

import pytest
import torch
from torch.utils import _pytree as pytree

import glm5f
from configs import OptimConfig, TrainConfig, validate
from conftest import cli
from glm5f.core.ops import wide_dtype
from glm5f.train.optim import (adamw_init, adamw_update, balance_router_bias, clip_by_global_norm, leaf_rule, lr_schedule,
                               schedule_change, trained_paths, value_and_grad)
from glm5f.core.params import flatten, unflatten


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


def test_adamw_matches_torch_optim():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg)
    state = adamw_init(params)
    ref_leaves = {p: t.clone().requires_grad_() for p, t in glm5f.flatten(params).items() if p in state["mu"]}
    # decayed: the matrices and embeddings, not the 1-D leaves; written out here, not read from leaf_rule
    decay = [t for t in ref_leaves.values() if t.ndim >= 2]
    no_decay = [t for t in ref_leaves.values() if t.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = {p: torch.randn(t.shape, generator=g) for p, t in ref_leaves.items()}
        for p, t in ref_leaves.items():
            t.grad = grads[p].clone()
        opt.step()
        params, state = adamw_update(params, grads, state, 1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    flat = glm5f.flatten(params)
    for p, t in ref_leaves.items():
        assert torch.allclose(flat[p], t.detach(), atol=1e-6), p
    assert leaf_rule("model.layers.0.self_attn.indexer.wk.weight", 2) == "frozen"
    assert leaf_rule("model.layers.1.mlp.gate.e_score_correction_bias", 1) == "balance"
    assert leaf_rule("model.norm.weight", 1) == "no_decay"


def test_value_and_grad_clip_schedule_and_balance():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    loss, grads = value_and_grad(lambda p: glm5f.causal_lm_loss(glm5f.forward(p, cfg, ids), ids))(params)
    assert ".indexer." not in "".join(grads) and "e_score" not in "".join(grads)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    clipped, before = clip_by_global_norm(grads, float(norm) / 2)
    assert torch.isclose(before, norm)
    assert torch.isclose(torch.sqrt(sum((g ** 2).sum() for g in clipped.values())), norm / 2, rtol=1e-4)
    assert lr_schedule(0, peak=1.0, warmup=10, total=100) == pytest.approx(0.1)
    assert lr_schedule(9, peak=1.0, warmup=10, total=100) == pytest.approx(1.0)
    assert lr_schedule(100, peak=1.0, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    counts = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])
    moved = glm5f.flatten(balance_router_bias(params, {key: counts}, 0.01))[key]
    assert moved.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_trainable_selects_leaves_and_bad_patterns_are_config_errors():
    params = glm5f.init_params(glm5f.preset("glm5-tiny", initializer_range=0.2, index_topk=8))
    assert not any(".indexer." in k for k in trained_paths(params))
    only = trained_paths(params, "indexer", indexer=True)
    assert len(only) == 10 and all(".indexer." in k for k in only)
    assert set(adamw_init(params, only)["mu"]) == set(only)
    assert trained_paths(params, r"layers\.0\.mlp") == [f"model.layers.0.mlp.{m}.weight"
                                                        for m in ("gate_proj", "up_proj", "down_proj")]
    errs = validate(cli("--train.trainable", "indexer"))
    assert len(errs) == 1 and "--train.trainable 'indexer' matches none" in errs[0]
    assert "--train.indexer_loss dense or sparse" in errs[0]
    assert any("--train.trainable 'nothing_here'" in e for e in validate(cli("--train.trainable", "nothing_here")))
    assert any("not a regular expression" in e for e in validate(cli("--train.trainable", "(")))
    assert validate(cli("--train.trainable", "indexer", "--train.indexer_loss", "dense")) == []


def test_a_schedule_change_during_the_warm_up_says_the_decay_after_it_changes():
    """During the warm-up the lr does not depend on the schedule's total: a longer run changes the decay after
    it (not 'from here'), and a run that ends inside the warm-up has nothing to say."""
    saved = {"optim": {"schedule_steps": None}, "train": {"steps": 30}}
    optim, train = OptimConfig(warmup_steps=20), TrainConfig(steps=60)
    assert schedule_change(saved, optim, train, 5) == (
        "the learning-rate schedule now ends at step 60, not 30 as in the checkpoint's run, so after the warm-up "
        "(step 20) the lr decays along another curve; pass --optim.schedule_steps 30 to keep the original schedule")
    assert schedule_change(saved, optim, TrainConfig(steps=15), 5) is None
    # 3e-3 (0.1 + 0.9 (1 + cos(pi 5/10)) / 2) and 3e-3 (0.1 + 0.9 (1 + cos(pi 5/40)) / 2)
    assert "so the lr jumps from 1.65e-03 to 2.90e-03 at step 26;" in schedule_change(saved, optim, train, 25)


def test_a_schedule_ending_inside_the_warm_up_and_non_finite_ns_coefficients_are_config_errors():
    errs = validate(cli("--optim.schedule_steps", "5", "--optim.warmup_steps", "20", "--optim.ns_coefficients",
                        "3.4", "nan", "inf"))
    assert errs == ["--optim.ns_coefficients must be finite numbers, got (3.4, nan, inf)",
                    "--optim.schedule_steps 5 ends inside the warm-up (--optim.warmup_steps 20): the lr would climb "
                    "to its peak and drop to its floor in one step; pass at least 20, or a shorter "
                    "--optim.warmup_steps"]
    assert validate(cli("--optim.schedule_steps", "20", "--optim.warmup_steps", "20")) == []
