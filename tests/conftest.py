"""Shared helpers: Transformers reference models built from a GLM5Config, tie detection, gradient comparison."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import glm5f
from glm5f import attention as attn
from glm5f import kernels

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def hf_model(cfg: glm5f.GLM5Config, seed: int = 0, bias_std: float = 0.1):
    """A `GlmMoeDsaForCausalLM` (eager attention, eval) of `cfg` with random weights and a random router bias."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    hcfg = GlmMoeDsaConfig(**cfg.to_hf())
    hcfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(hcfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, bias_std)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """make(cfg, seed) -> (Transformers model, checkpoint dir written by its save_pretrained)."""
    def make(cfg, seed=0):
        model = hf_model(cfg, seed)
        path = tmp_path / f"hf-{seed}"
        model.save_pretrained(path)
        return model, path
    return make


def boundary_ties(params, cfg, input_ids, attention_mask=None) -> int:
    """How many (layer, query) rows have equal k-th and (k+1)-th index scores: there the top-k set is a matter
    of tie-breaking, which Transformers (torch.topk) leaves arbitrary."""
    count = 0
    orig = attn.indexer_topk

    def spy(q, w, keys, mask, k):
        nonlocal count
        S, T = q.shape[1], keys.shape[1]
        s = kernels._indexer_scores_torch(q, w, keys.to(q.dtype), 0, S, T)
        if mask.bias is not None:
            s = s + mask.bias
        s = s.masked_fill(~mask.rows(0, S), float("-inf"))
        kk = min(k, T - 1)
        top = s.topk(kk + 1, dim=-1).values
        count += int(((top[..., kk - 1] == top[..., kk]) & torch.isfinite(top[..., kk - 1])).sum())
        return orig(q, w, keys, mask, k)

    attn.indexer_topk = spy
    try:
        glm5f.forward(params, cfg, input_ids, attention_mask=attention_mask)
    finally:
        attn.indexer_topk = orig
    return count


@contextlib.contextmanager
def stable_topk():
    """torch.Tensor.topk as a stable descending sort (equal values: the lower index first, as glm5f's top-k), for
    references whose top-k would otherwise break the indexer's frequent ties arbitrarily."""
    orig = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = orig


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def with_grad(params: dict) -> dict:
    """A copy of params whose leaves require grad, all but the buffers (the router bias)."""
    return glm5f.params.map_with_path(
        lambda path, t: t.detach().clone().requires_grad_(not glm5f.params.is_buffer(path)), params)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when asked for (`-m slow`); CI runs the rest."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def env_of(cfg, shape, attention_mask=None, position_ids=None, dtype=torch.float32, **objectives):
    """The Env of a one-process forward over [B, S] tokens (mask and positions as `glm5f.forward` takes them),
    computing the objectives named (glm5f.env.Objectives' fields)."""
    from glm5f.env import Objectives

    B, S = shape
    batch = {"input_ids": torch.zeros(B, S, dtype=torch.long), "position_ids": position_ids}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    return glm5f.make_env(cfg, batch, dtype, objectives=Objectives(**objectives))[1]
