"""Shared helpers: Transformers reference models built from a GLM5Config, tie detection, gradient comparison."""

from __future__ import annotations

import contextlib
import json
import os
import textwrap

import pytest
import torch
import tyro

import glm5f
from configs import Config
from glm5f.model import attention as attn
from glm5f.kernels import dsa as kernels
from glm5f.run import launch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_configure(config):
    """The workers of the suite's in-process spawns are forked from one server that imported torch, glm5f, train.py
    and dist_checks once. A process that only imports this file (a launcher script of test_launch, train.py run as
    a script) keeps the default: a fresh interpreter per worker."""
    launch.START_METHOD = "forkserver"
    launch.FORKSERVER_PRELOAD = [*launch.FORKSERVER_PRELOAD, "configs", "train", "dist_checks"]


TINY_RUN = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "2"]
RUN_64 = ["--data.batch_size", "2", "--data.seq_len", "64", "--train.steps", "1"]  # one step of 2 x 64 tokens
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def run_script(*argv, stdin=None):
    """`python *argv` (a script of the repository and its flags, or `-c CODE`) run from the repository root on one
    thread, `stdin` as its input: the CompletedProcess, with its stdout and stderr as text."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=SCRIPT_ENV, capture_output=True, text=True,
                          timeout=300, input=stdin)


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


def assert_grads_match(paths, grads, ref_grads, rtol: float = 1e-4, zero_atol: float | None = None) -> int:
    """Each gradient within `rtol` relative of the reference's (with `zero_atol`, a zero reference gradient asks
    for a gradient of norm <= zero_atol); the indexer's leaves get none on either side (the reference runs its
    indexer under no_grad; so do we). Returns how many gradients were compared."""
    checked = 0
    for path, g, rg in zip(paths, grads, ref_grads):
        if ".indexer." in path:
            assert g is None and rg is None, path
            continue
        assert g is not None and rg is not None, path
        if zero_atol is not None and rg.norm() == 0:
            assert g.norm() <= zero_atol, path
        else:
            assert rel_err(g, rg) <= rtol, f"{path}: relative gradient error {rel_err(g, rg):.2e}"
        checked += 1
    return checked


def with_grad(params: dict) -> dict:
    """A copy of params whose leaves require grad, all but the buffers (the router bias)."""
    return glm5f.core.params.map_with_path(
        lambda path, t: t.detach().clone().requires_grad_(not glm5f.core.params.is_buffer(path)), params)


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
    computing the objectives named (glm5f.model.env.Objectives' fields)."""
    from glm5f.model.env import Objectives

    B, S = shape
    batch = {"input_ids": torch.zeros(B, S, dtype=torch.long), "position_ids": position_ids}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    return glm5f.make_env(cfg, batch, dtype, objectives=Objectives(**objectives))[1]


def cli(*args: str) -> Config:
    return tyro.cli(Config, args=list(args), use_underscores=True)


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def bpe_tokenizer(directory) -> str:
    """A small BPE tokenizer.json in `directory` (its path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    tok.save(str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


def naive_choice(biased: list[float], cfg: glm5f.GLM5Config) -> list[int]:
    """The experts one token picks: the topk_group groups with the best top-2 sums of the biased scores, then the
    num_experts_per_tok best experts inside them."""
    E, G = len(biased), cfg.n_group
    size = E // G
    group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(G)]
    groups = sorted(range(G), key=lambda g: -group_score[g])[:cfg.topk_group]
    eligible = [i for i in range(E) if i // size in groups]
    return sorted(eligible, key=lambda i: -biased[i])[:cfg.num_experts_per_tok]


def naive_seq_aux(gate: dict, x_BxSxD: torch.Tensor, valid_BxS: torch.Tensor, cfg: glm5f.GLM5Config):
    """sum over sequences with a valid token of sum_i f_i P_i (DeepSeek-V3) in fp64, the choices token by token."""
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    s_BxSxE = torch.sigmoid(x_BxSxD.double() @ gate["weight"].double().T)
    biased = (s_BxSxE.detach() + gate["e_score_correction_bias"].double()).tolist()
    total = torch.zeros((), dtype=torch.float64)
    for b in range(x_BxSxD.shape[0]):
        tokens = [t for t in range(x_BxSxD.shape[1]) if valid_BxS[b, t]]
        if not tokens:
            continue
        T, load = len(tokens), [0] * E
        for t in tokens:
            for i in naive_choice(biased[b][t], cfg):
                load[i] += 1
        f = torch.tensor(load, dtype=torch.float64) * E / (K * T)
        P = (s_BxSxE[b, tokens] / s_BxSxE[b, tokens].sum(-1, keepdim=True)).sum(0) / T
        total = total + (f * P).sum()
    return total


@pytest.fixture(scope="module")
def tiny():
    cfg = glm5f.preset("glm5-tiny")
    return cfg, glm5f.init_params(cfg)


def run_error(capsys, *args) -> str:
    """train.py's exit status must be 1; returns its stderr (the `error:` line)."""
    from train import main
    assert main(TINY_RUN + list(args)) == 1
    return capsys.readouterr().err


def run_step(params: dict, batch: dict, run, model_cfg: glm5f.GLM5Config):
    """`step_grads` of one process for the run `run` (a configs.Config) describes."""
    from glm5f.train.loss import Step, step_grads
    from glm5f.parallel.layout import Layout

    return step_grads(params, batch, model_cfg, Layout(torch.device("cpu")), Step.of(run.train, model_cfg))


def forward_by_layers(params: dict, cfg: glm5f.GLM5Config, input_ids_BxS: torch.Tensor, env, attend=None,
                      moe_inputs: list | None = None) -> torch.Tensor:
    """Logits [B, S, V] of the model written out layer by layer (pre-norm attention and MLP, each with a residual),
    with `attend` (attention's signature) in place of glm5f's attention when given; each MoE layer's (gate params,
    input) appended to `moe_inputs` when given. A reference for tests that replace or watch one part of a layer."""
    from glm5f.model.decoder import lm_head
    from glm5f.model.moe import moe
    from glm5f.core.ops import rms_norm, swiglu_mlp

    attend = attend or attn.attention
    x_BxSxD = torch.nn.functional.embedding(input_ids_BxS, params["model"]["embed_tokens"]["weight"])
    carry = None
    for i, p in enumerate(params["model"]["layers"][:cfg.num_hidden_layers]):
        a_BxSxD, carry, _ = attend(p["self_attn"], rms_norm(p["input_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps),
                                   cfg, i, env, carry)
        x_BxSxD = x_BxSxD + a_BxSxD
        h_BxSxD = rms_norm(p["post_attention_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
        if cfg.is_moe(i):
            if moe_inputs is not None:
                moe_inputs.append((p["mlp"]["gate"], h_BxSxD))
            x_BxSxD = x_BxSxD + moe(p["mlp"], h_BxSxD, cfg, env)[0]
        else:
            x_BxSxD = x_BxSxD + swiglu_mlp(p["mlp"], h_BxSxD)
    return lm_head(params, cfg, x_BxSxD)


# train.py whose rank `rank` runs `action` (one Python statement; os, signal, time imported) in its `at`-th step,
# before the step's forward and backward: a hung, stopped or interrupting rank, in a real process.
STEP_HOOK = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import glm5f.train.step, train
    real, calls = glm5f.train.step.step_grads, []
    def step_grads(*a, **k):
        calls.append(1)
        if os.environ.get("RANK") == "{rank}" and len(calls) == {at}:
            {action}
        return real(*a, **k)
    glm5f.train.step.step_grads = step_grads
    if __name__ == "__main__":
        sys.exit(train.main(sys.argv[1:]))
""")


def step_hook_script(tmp_path, rank: int, at: int, action: str) -> str:
    """The path of a train.py wrapper (STEP_HOOK) whose rank `rank` runs `action` in its `at`-th step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / f"hook_rank{rank}_step{at}.py"
    path.write_text(STEP_HOOK.format(root=root, rank=rank, at=at, action=action))
    return str(path)


def random_batch(cfg, B, S, padded, seed=0, right=7, left=10):
    """(ids, mask, labels) of random tokens; padded: row 0 ends in `right` padding tokens, row 1 starts with `left`
    (and the label predicted from its last padding position is ignored), so a parity test sees both paddings."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = ids.clone()
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, S - right:] = 0
        mask[1, :left] = 0
        labels[mask == 0] = glm5f.IGNORE_INDEX
        labels[1, left] = glm5f.IGNORE_INDEX  # predicted from a padding position
    return ids, mask, labels


class _Wide:
    """The `torch` a Transformers module sees inside `transformers_in_fp64`: torch itself, but its float32 is
    float64 (`torch.float`, which its rope tables use, stays fp32: glm5f's rope tables are fp32 too)."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def transformers_in_fp64():
    """Transformers' GLM-5 modules name torch.float32 where they upcast (norms, router, softmax): inside
    this context (and for a model built inside it) they upcast to float64 instead, so an fp64 model computes in
    fp64 throughout. (The indexer's scores stay fp32; they only choose keys, and the tests use tie-free inputs.)"""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    m.torch = _Wide()
    try:
        yield
    finally:
        m.torch = torch


def hf_model_fp64(cfg: glm5f.GLM5Config, seed: int = 0):
    """`hf_model` in fp64 (eager experts: the grouped matmul has no fp64); build and run it inside
    `transformers_in_fp64` for fp64 arithmetic throughout."""
    model = hf_model(cfg, seed)
    model.config._experts_implementation = "eager"
    for module in model.modules():
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    return model.double()


def saved_policy(directory, cfg: glm5f.GLM5Config, seed: int = 0):
    """`hf_model_fp64(cfg, seed)`, built inside `transformers_in_fp64`, saved to `directory` with save_pretrained
    (fp32) and returned in fp64: a checkpoint for --model.init_from and its Transformers reference."""
    with transformers_in_fp64():
        policy = hf_model_fp64(cfg, seed=seed)
    policy.float().save_pretrained(directory)
    return policy.double()


@pytest.fixture
def hf_router_replay(monkeypatch):
    """GlmMoeDsaTopkRouter.forward made to pick `router.replay` [N, K] where set (a row of -1: its own choice),
    weighted by its scores for them, normalised and scaled as its own forward does."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    own_forward = m.GlmMoeDsaTopkRouter.forward

    def forward(self, hidden_states):
        router_logits, own_w, own_idx = own_forward(self, hidden_states)
        recorded = getattr(self, "replay", None)
        if recorded is None:
            return router_logits, own_w, own_idx
        idx = torch.where(recorded[:, :1] >= 0, recorded, own_idx)
        w = router_logits.sigmoid().gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, w * self.routed_scaling_factor, idx

    monkeypatch.setattr(m.GlmMoeDsaTopkRouter, "forward", forward)
