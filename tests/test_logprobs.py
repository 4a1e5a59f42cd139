"""glm5f/model/logprobs.py: each token's log-probability through the chunked head equals Transformers' log-softmax of
its logits (fp64), its gradients equal autograd's through the whole logits, and a layout's shares are one
process's."""

import pytest
import torch
from torch.func import functional_call

import glm5f
from conftest import hf_model_fp64, stable_topk, transformers_in_fp64, with_grad
from glm5f.model.logprobs import head_logprobs, token_logprobs
from glm5f.model.decoder import main_head
from glm5f.core.params import map_with_path


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_token_logprobs_equal_transformers_log_softmax_fp64(preset):
    cfg = glm5f.preset(preset)
    params = map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=1))
    g = torch.Generator().manual_seed(2)
    B, S = 2, 48
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    targets[0, :5] = glm5f.IGNORE_INDEX
    with torch.no_grad():
        ours = token_logprobs(params, cfg, ids, targets)
        if preset == "glm5-tiny":
            with stable_topk(), transformers_in_fp64():
                model = hf_model_fp64(cfg)
                logits = functional_call(model, glm5f.hf_state_dict(params, fused_experts=True), (ids,)).logits
        else:  # GLM-5.3's reference is the parity suite's: here glm5f's own full logits
            logits = glm5f.forward(params, cfg, ids)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ref = torch.where(targets == glm5f.IGNORE_INDEX, 0.0, ref)
    assert ours.dtype == torch.float64 and ours.shape == (B, S)
    assert (ours - ref).abs().max() <= 1e-12
    assert (ours[0, :5] == 0).all()
    # the default targets are the next tokens; the last position has none
    nxt = token_logprobs(params, cfg, ids)
    assert nxt[:, -1].eq(0).all() and (nxt[:, :-1] - token_logprobs(params, cfg, ids, torch.cat(
        [ids[:, 1:], torch.full((B, 1), glm5f.IGNORE_INDEX)], 1))[:, :-1]).abs().max() == 0


def test_chunked_gradients_equal_autograd_through_the_whole_logits():
    cfg = glm5f.preset("glm5-tiny")
    params = with_grad(map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=4)))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    targets[1, 3] = glm5f.IGNORE_INDEX
    w = torch.randn(2, 10, dtype=torch.float64, generator=g)
    head = main_head(params, cfg)
    leaves = [x, head["norm"], head["weight"]]
    ours = torch.autograd.grad((head_logprobs(head, x, targets, cfg.rms_norm_eps, chunk_elems=3 * cfg.vocab_size)
                                * w).sum(), leaves)
    logits = glm5f.model.decoder.head_logits(head, x, cfg.rms_norm_eps)
    ref_lp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ref = torch.autograd.grad((torch.where(targets == glm5f.IGNORE_INDEX, 0.0, ref_lp) * w).sum(), leaves)
    for a, b in zip(ours, ref):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, b.abs().max().item())


def test_targets_of_another_shape_are_refused():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="targets must be"):
        token_logprobs(params, cfg, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))


def test_replayed_experts_reach_the_log_probabilities():
    """token_logprobs with "routing" equals the log-softmax of glm5f.forward with the same experts (fp64), and
    differs from the router's own choice."""
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset("glm5-tiny")
    params = map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    M, K = replay_shapes(cfg)["routing"]
    routing = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:K] for _ in range(2 * 12 * M)])
    routing = routing.view(2, 12, M, K)
    got = glm5f.token_logprobs(params, cfg, ids, routing=routing)
    logits = glm5f.forward(params, cfg, ids, routing=routing)
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (got[:, :-1] - want).abs().max() <= 1e-12
    assert (got - glm5f.token_logprobs(params, cfg, ids)).abs().max() > 1e-3
