"""glm5f/replay.py: a forward with recorded experts ("routing") equals Transformers with its router made to pick them,
gradients included; a forward with recorded keys ("indexer") equals attention over exactly those keys; replaying
the model's own choices changes nothing; bad records fail in one line."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

import glm5f
from conftest import hf_model_fp64, stable_topk, transformers_in_fp64, with_grad
from glm5f.params import map_with_path
from glm5f.replay import check_replay, replay_shapes, replay_slots


def fp64_params(cfg, seed):
    params = map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=seed))
    with torch.no_grad():  # a router bias that changes the choice (it only chooses, it never weights)
        for layer in replay_slots(cfg)["routing"]:
            params["model"]["layers"][layer]["mlp"]["gate"]["e_score_correction_bias"].normal_(0, 0.1)
    return params


def other_experts(cfg, B, S, seed, unrecorded=()):
    """routing [B, S, M, K]: distinct random experts per position and layer, -1 at the (b, s, slot) `unrecorded`."""
    M, K = replay_shapes(cfg)["routing"]
    g = torch.Generator().manual_seed(seed)
    routing = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:K] for _ in range(B * S * M)])
    routing = routing.view(B, S, M, K)
    for b, s, m in unrecorded:
        routing[b, s, m] = -1
    return routing


def replaying_router(self, hidden_states):
    """GlmMoeDsaTopkRouter.forward picking `self.replay` [N, K] (a row of -1: its own choice), the weights its
    scores for them, normalised and scaled as its own forward does."""
    router_logits, own_w, own_idx = ROUTER_FORWARD(self, hidden_states)
    recorded = getattr(self, "replay", None)
    if recorded is None:
        return router_logits, own_w, own_idx
    idx = torch.where(recorded[:, :1] >= 0, recorded, own_idx)
    w = router_logits.sigmoid().gather(1, idx)
    if self.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, w * self.routed_scaling_factor, idx


ROUTER_FORWARD = None


@pytest.fixture
def hf_router_replay(monkeypatch):
    global ROUTER_FORWARD
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    ROUTER_FORWARD = m.GlmMoeDsaTopkRouter.forward
    monkeypatch.setattr(m.GlmMoeDsaTopkRouter, "forward", replaying_router)


def test_routing_replay_equals_transformers_with_its_router_picking_the_recorded_experts(hf_router_replay):
    cfg = glm5f.preset("glm5-tiny")
    params = fp64_params(cfg, seed=1)
    B, S = 2, 24  # S > index_topk: sparse attention too
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    routing = other_experts(cfg, B, S, seed=3, unrecorded=[(0, 5, 0), (1, 0, 1), (1, 7, 0)])
    slots = replay_slots(cfg)["routing"]
    upstream = torch.randn(B, S, cfg.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    p = with_grad(params)
    routers = [p["model"]["layers"][layer]["mlp"]["gate"]["weight"] for layer in slots]

    ours = glm5f.forward(p, cfg, ids, routing=routing)
    ours_grads = torch.autograd.grad((ours * upstream).sum(), routers)
    with stable_topk(), transformers_in_fp64():
        model = hf_model_fp64(cfg)
        for layer, m in slots.items():
            model.model.layers[layer].mlp.gate.replay = routing[:, :, m].reshape(B * S, -1)
        ref = functional_call(model, glm5f.hf_state_dict(p, fused_experts=True), (ids,)).logits
        ref_grads = torch.autograd.grad((ref * upstream).sum(), routers)
    assert (ours - ref).abs().max() <= 1e-10
    for g, rg in zip(ours_grads, ref_grads):
        assert rg.abs().max() > 1e-3  # the router learns through the replayed experts' weights
        assert (g - rg).abs().max() <= 1e-10 * max(1.0, rg.abs().max().item())
    with torch.no_grad():
        own = glm5f.forward(params, cfg, ids)
    assert (own - ours).abs().max() > 1e-3  # the recorded experts are not the router's own


def test_routing_replay_uses_the_recorded_experts_with_the_routers_weights():
    """One MoE layer: the output is sum_k w_k expert_{e_k}(x) + shared(x) with e the record and w the router's
    normalised, scaled sigmoid scores of e, written out per token; "expert_idx" reports e."""
    from glm5f.env import Env
    from glm5f.moe import moe
    from glm5f.ops import swiglu_mlp

    cfg = glm5f.preset("glm5-tiny")
    params = fp64_params(cfg, seed=5)
    p = params["model"]["layers"][1]["mlp"]
    B, S, D = 2, 6, cfg.hidden_size
    x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    routing = other_experts(cfg, B, S, seed=7, unrecorded=[(1, 2, 0)])[:, :, 0]
    env = glm5f.make_env(cfg, {"input_ids": torch.zeros(B, S, dtype=torch.long)}, torch.float64)[1]
    assert isinstance(env, Env)
    out, idx, _ = moe(p, x, cfg, env, routing)
    own_out, own_idx, _ = moe(p, x, cfg, env)
    ref = torch.zeros_like(x)
    for b in range(B):
        for s in range(S):
            xs = x[b, s]
            scores = torch.sigmoid(p["gate"]["weight"] @ xs)
            chosen = routing[b, s] if routing[b, s, 0] >= 0 else own_idx.view(B, S, -1)[b, s]
            w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
            experts = p["experts"]
            for k, e in enumerate(chosen.tolist()):
                h = torch.nn.functional.silu(experts["gate_proj"]["weight"][e] @ xs) * (experts["up_proj"]["weight"][e] @ xs)
                ref[b, s] += w[k] * (experts["down_proj"]["weight"][e] @ h)
            ref[b, s] += swiglu_mlp(p["shared_experts"], xs)
            assert idx.view(B, S, -1)[b, s].tolist() == chosen.tolist()
    assert (out - ref).abs().max() <= 1e-12
    assert (own_out - out).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_replaying_the_models_own_routing_changes_nothing(preset):
    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=8)
    B, S = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(9))
    batch = {"input_ids": ids}
    local, env = glm5f.make_env(cfg, batch, torch.float64)
    with torch.no_grad():
        logits, aux = glm5f.apply(params, cfg, local["input_ids"], env)
        routing = torch.stack([aux["layers"][layer]["expert_idx"].view(B, S, -1) for layer in
                               replay_slots(cfg)["routing"]], 2)
        again = glm5f.forward(params, cfg, ids, routing=routing)
        other = glm5f.forward(params, cfg, ids, routing=other_experts(cfg, B, S, seed=10))
    assert torch.equal(again, logits)
    assert (other - logits).abs().max() > 1e-3


def test_bad_routing_fails_in_one_line():
    cfg = glm5f.preset("glm5-tiny")
    B, S = 2, 8
    ids = torch.zeros(B, S, dtype=torch.long)
    M, K = replay_shapes(cfg)["routing"]
    good = other_experts(cfg, B, S, seed=11)
    check_replay({"input_ids": ids, "routing": good}, cfg)
    check_replay({"input_ids": ids[0].tolist(), "routing": good[0].tolist()}, cfg)  # one sequence, as lists
    cases = {
        "must be (2, 8, 2, 2)": good[:, :, :1],
        "expert id 8: ids must lie in [0, n_routed_experts=8)": good.masked_fill(good == good[1, 3, 1, 0], 8),
        "expert id -2": good.masked_fill(good == good[0, 0, 0, 0], -2),
        "some of its experts -1": torch.cat([good[..., :1], torch.full_like(good[..., 1:], -1)], -1),
        "integer tensor": good.double(),
    }
    params = glm5f.init_params(cfg, seed=0)
    for message, routing in cases.items():
        for run in (lambda: check_replay({"input_ids": ids, "routing": routing}, cfg),
                    lambda: glm5f.forward(params, cfg, ids, routing=routing)):
            with pytest.raises(ValueError) as err:
                run()
            assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
