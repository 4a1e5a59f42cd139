"""glm5f/model/moe.py: the grouped experts against a per-expert oracle, and one MoE layer's sequence-wise auxiliary
balance loss against a naive fp64 reading of its formula (in the step: test_loss.py; under CP: test_distributed.py)."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import vmap

import glm5f
from conftest import env_of, naive_seq_aux, rel_err
from glm5f.model.env import Objectives
from glm5f.model.moe import moe, routed_experts
from glm5f.core.ops import swiglu_mlp

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 7), st.floats(0.0, 0.6), st.integers(0, 2**31 - 1))
def test_layer_loss_and_gradients_match_the_formula(B, S, pad, seed):
    """One MoE layer in fp64: its seq_aux_loss and the gradient of it wrt every leaf and the input equal the naive
    formula's (rel 1e-6), padding and wholly padded sequences included; the layer's output does not change."""
    cfg = glm5f.preset("glm5-tiny")
    g = torch.Generator().manual_seed(seed)
    p = glm5f.init_params(cfg, seed=seed % 997, dtype=torch.float64)["model"]["layers"][1]["mlp"]
    p["gate"]["weight"] = torch.randn(p["gate"]["weight"].shape, generator=g, dtype=torch.float64)
    p["gate"]["e_score_correction_bias"] = 0.3 * torch.randn(cfg.n_routed_experts, generator=g, dtype=torch.float64)
    x = torch.randn(B, S, cfg.hidden_size, generator=g, dtype=torch.float64) * 0.3
    valid = (torch.rand(B, S, generator=g) >= pad).long()
    leaves = {k: t.requires_grad_() for k, t in glm5f.flatten(p).items() if "correction_bias" not in k}
    x.requires_grad_()
    env = env_of(cfg, (B, S), dtype=torch.float64)
    plain, plain_idx, plain_aux = moe(p, x, cfg, env)
    out, idx, aux = moe(p, x, cfg, dataclasses.replace(env, objectives=Objectives(seq_aux=True), valid_BxS=valid))
    assert plain_aux == {} and torch.equal(out, plain) and torch.equal(idx, plain_idx)
    ref = naive_seq_aux(p["gate"], x, valid, cfg)
    loss, want_loss = float(aux["seq_aux_loss"].detach()), float(ref.detach())
    assert aux["seq_aux_loss"].dtype == torch.float64
    assert abs(loss - want_loss) <= 1e-6 * max(abs(want_loss), 1e-30)
    if not valid.any():
        assert float(aux["seq_aux_loss"]) == 0.0
        return
    ours = torch.autograd.grad(aux["seq_aux_loss"], [x, *leaves.values()], allow_unused=True)
    want = torch.autograd.grad(ref, [x, *leaves.values()], allow_unused=True)
    for name, a, b in zip(["x", *leaves], ours, want):
        if b is None:  # the experts: the loss does not reach them
            assert a is None or not a.any(), name
        else:
            assert rel_err(a, b) <= 1e-6, f"{name}: relative gradient error {rel_err(a, b):.2e}"


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(1, 64), st.sampled_from([5, 8, 16]), st.sampled_from([3, 4, 8]),
       st.integers(1, 8), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_grouped_moe_equals_per_expert_oracle(N, D, F_, E, K, _, seed):
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    experts = {"gate_proj": {"weight": torch.randn(E, F_, D, generator=g) * D ** -0.5},
               "up_proj": {"weight": torch.randn(E, F_, D, generator=g) * D ** -0.5},
               "down_proj": {"weight": torch.randn(E, D, F_, generator=g) * F_ ** -0.5}}
    x = torch.randn(N, D, generator=g)
    idx = torch.rand(N, E, generator=g).argsort(-1)[:, :K]
    w = torch.rand(N, K, generator=g)
    leaves = [x, w, *(experts[k]["weight"] for k in ("gate_proj", "up_proj", "down_proj"))]
    for t in leaves:
        t.requires_grad_()

    def oracle(x, w, gate, up, down):
        every_NxD = vmap(lambda g_, u_, d_: swiglu_mlp(
            {"gate_proj": {"weight": g_}, "up_proj": {"weight": u_}, "down_proj": {"weight": d_}}, x))(gate, up, down)
        return (every_NxD[idx, torch.arange(N)[:, None]] * w[..., None]).sum(1)

    ours = routed_experts(experts, x, idx, w, E)
    ref = oracle(*leaves)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn(N, D, generator=g)
    for a, b in zip(torch.autograd.grad((ours * cot).sum(), leaves), torch.autograd.grad((ref * cot).sum(), leaves)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
