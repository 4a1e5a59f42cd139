"""Training objectives beside the LM loss: the lightning indexer's KL distillation loss and --train.trainable.

The indexer loss is checked against a naive fp64 implementation of its formula (per-head MLA scores over the keys
each query may see, head-summed and L1-normalised probabilities as the target, the log-softmax of the index scores
as the student), its gradient against autograd through that implementation.
"""

import dataclasses

import pytest
import torch
import tyro

import glm5f
from configs import Config, validate
from glm5f import checkpoint
from conftest import env_of
from glm5f.attention import LATENT_NORM_EPS, attention
from glm5f.loss import Step, step_grads
from glm5f.kernels import topk_as_mask
from glm5f.ops import apply_rope, layer_norm, rms_norm
from glm5f.optim import adamw_init, trained_paths
from glm5f.parallel import Layout
from train import train

# glm5-tiny with weights wide enough that attention and index scores are far from uniform, top-k 8 of 24 keys
CFG = glm5f.preset("glm5-tiny", initializer_range=0.2, index_topk=8)
B, S = 2, 24


def cli(*args: str) -> Config:
    return tyro.cli(Config, args=list(args), use_underscores=True)


def run_step(params: dict, batch: dict, run: Config, model_cfg: glm5f.GLM5Config):
    """`step_grads` of one process for the run `run` describes."""
    return step_grads(params, batch, model_cfg, Layout(torch.device("cpu")), Step.of(run.train, model_cfg))


def layer0_params(seed: int = 0) -> dict:
    """Layer 0's attention params in fp64, norm scales and biases perturbed (so their gradients are not special)."""
    p = glm5f.init_params(CFG, seed=seed, dtype=torch.float64)["model"]["layers"][0]["self_attn"]
    g = torch.Generator().manual_seed(seed)
    return glm5f.params.map_with_path(
        lambda path, t: t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype) if t.ndim == 1 else t, p)


def inputs(kind: str):
    """(attention_mask, position_ids, allowed [B, S, T], valid [B, S]) of a batch: causal, padded or packed."""
    causal = torch.ones(S, S).tril().bool()[None].expand(B, S, S)
    if kind == "causal":
        return None, None, causal, torch.ones(B, S, dtype=torch.bool)
    if kind == "padding":  # the second row holds 17 tokens, then padding
        am = torch.ones(B, S, dtype=torch.long)
        am[1, 17:] = 0
        return am, None, causal & am.bool()[:, None, :], am.bool()
    # packed: row 0 documents of 10 and 14 tokens, row 1 of 5, 11 and 8
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                       torch.cat([torch.arange(5), torch.arange(11), torch.arange(8)])])
    seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    return None, pos, causal & (seg[:, :, None] == seg[:, None, :]), torch.ones(B, S, dtype=torch.bool)


def naive_target(p: dict, x: torch.Tensor, cos, sin, keyset_BxSxT):
    """One layer's indexer-loss target [B, S, T], fp64: main attention's probabilities, summed over heads, normalised."""
    c = CFG
    H, N, P, V, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    with torch.no_grad():
        q_lat = rms_norm(p["q_a_layernorm"]["weight"], x @ p["q_a_proj"]["weight"].T, LATENT_NORM_EPS)
        q = (q_lat @ p["q_b_proj"]["weight"].T).view(B, S, H, N + P)
        q_nope, q_rot = q[..., :N], apply_rope(q[..., N:], cos, sin)
        kv = x @ p["kv_a_proj_with_mqa"]["weight"].T
        ckv = rms_norm(p["kv_a_layernorm"]["weight"], kv[..., :R], LATENT_NORM_EPS)
        k_rot = apply_rope(kv[..., R:], cos, sin)
        k_nope = (ckv @ p["kv_b_proj"]["weight"].T).view(B, S, H, N + V)[..., :N]
        scores = (torch.einsum("bshn,bthn->bhst", q_nope, k_nope)
                  + torch.einsum("bshp,btp->bhst", q_rot, k_rot)) * c.softmax_scale
        probs = torch.softmax(scores.masked_fill(~keyset_BxSxT[:, None], float("-inf")), dim=-1)
        target = probs.sum(1)
        return target / target.sum(-1, keepdim=True)


def naive_indexer_kl(p: dict, x: torch.Tensor, cos, sin, keyset_BxSxT, selected_BxSxT, valid_BxS, target=None):
    """(KL sum, recall sum) of the indexer loss from its formula, fp64, every head expanded, no blocks. The target
    is p's own layer's (naive_target) unless given."""
    c = CFG
    I, J, P = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    if target is None:
        target = naive_target(p, x, cos, sin, keyset_BxSxT)
    q_lat = rms_norm(p["q_a_layernorm"]["weight"], x @ p["q_a_proj"]["weight"].T, LATENT_NORM_EPS)
    ip = p["indexer"]
    qi = (q_lat @ ip["wq_b"]["weight"].T).view(B, S, I, J)
    qi = torch.cat([apply_rope(qi[..., :P], cos, sin), qi[..., P:]], dim=-1)
    ki = layer_norm(ip["k_norm"], x @ ip["wk"]["weight"].T)
    ki = torch.cat([apply_rope(ki[..., :P], cos, sin), ki[..., P:]], dim=-1)
    w = x @ ip["weights_proj"]["weight"].T * I ** -0.5
    index = torch.einsum("bsi,bsit->bst", w, torch.relu(torch.einsum("bsij,btj->bsit", qi, ki) / J ** 0.5))
    log_student = torch.log_softmax(index.masked_fill(~keyset_BxSxT, float("-inf")), dim=-1)
    terms = torch.where(keyset_BxSxT, target * (torch.log(target) - log_student), 0.0)
    recall = torch.where(keyset_BxSxT & selected_BxSxT, target, 0.0).sum(-1)
    return (terms.sum(-1) * valid_BxS).sum(), (recall * valid_BxS).sum()


@pytest.mark.parametrize("blocks", ["one", "many"])
@pytest.mark.parametrize("kind", ["causal", "padding", "packed"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_kl_and_its_gradients_match_the_formula(mode, kind, blocks, monkeypatch):
    if blocks == "many":  # query blocks of 1 to 3 queries
        monkeypatch.setattr(glm5f.indexer_loss, "INDEXER_LOSS_BLOCK_ELEMS", 4000)
    am, pos, allowed, valid = inputs(kind)
    p = layer0_params()
    x = torch.randn(B, S, CFG.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ctx = env_of(CFG, (B, S), am, pos, torch.float64, indexer_loss=mode)
    live = glm5f.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
    _, carry, aux = attention(live, x, CFG, 0, ctx, None)
    topk = carry.topk
    assert topk is not None and topk.shape[-1] == CFG.index_topk
    selected = topk_as_mask(topk, S)
    keyset = allowed & selected if mode == "sparse" else allowed
    ref_live = glm5f.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
    ref_loss, ref_recall = naive_indexer_kl(ref_live, x, ctx.cos, ctx.sin, keyset, selected, valid)
    loss, recall = float(ref_loss.detach()), float(ref_recall)
    assert loss > 0.5  # far from a trivial (near-zero) loss
    assert abs(float(aux["indexer_loss"].detach()) - loss) <= 1e-6 * loss
    assert abs(float(aux["indexer_recall"]) - recall) <= 1e-6 * recall
    if mode == "dense":
        assert recall < 0.95 * int(valid.sum())  # the top-k misses some of the target's mass
    leaves = {k: t for k, t in glm5f.flatten(live).items() if t.requires_grad}
    ref_leaves = {k: t for k, t in glm5f.flatten(ref_live).items() if t.requires_grad}
    assert sorted(leaves) == ["indexer.k_norm.bias", "indexer.k_norm.weight", "indexer.weights_proj.weight",
                              "indexer.wk.weight", "indexer.wq_b.weight"]
    grads = torch.autograd.grad(aux["indexer_loss"], list(leaves.values()))
    ref_grads = torch.autograd.grad(ref_loss, [ref_leaves[k] for k in leaves])
    for name, g, r in zip(leaves, grads, ref_grads):
        assert float(r.norm()) > 0, name
        assert float((g - r).norm() / r.norm()) <= 1e-6, name


@pytest.mark.parametrize("kind", ["causal", "padding"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_mean_target_and_its_gradients_match_the_formula(mode, kind, monkeypatch):
    """--train.indexer_target mean on layers F S S: layer 0's indexer learns the mean of the three layers' targets
    (each over the same key set), its loss appearing at layer 2, the group's last."""
    monkeypatch.setattr(glm5f.indexer_loss, "INDEXER_LOSS_BLOCK_ELEMS", 20000)  # several query blocks
    cfg = dataclasses.replace(CFG, indexer_types=("full", "shared", "shared"))
    am, pos, allowed, valid = inputs(kind)
    g = torch.Generator().manual_seed(3)
    layers = glm5f.init_params(cfg, seed=1, dtype=torch.float64)["model"]["layers"]
    ps = [glm5f.params.map_with_path(lambda path, t: t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
                                     if t.ndim == 1 else t, layer["self_attn"]) for layer in layers]
    assert "indexer" in ps[0] and "indexer" not in ps[1] and "indexer" not in ps[2]
    xs = [torch.randn(B, S, CFG.hidden_size, generator=g, dtype=torch.float64) for _ in ps]
    ctx = env_of(cfg, (B, S), am, pos, torch.float64, indexer_loss=mode, indexer_target="mean")
    live = glm5f.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), ps[0])
    carry, auxes = None, []
    for i, (p, x) in enumerate(zip([live] + ps[1:], xs)):
        _, carry, aux = attention(p, x, cfg, i, ctx, carry)
        auxes.append(aux)
        assert bool(carry.targets) == (i < 2)  # the group's targets ride along until its last layer
    assert "indexer_loss" not in auxes[0] and "indexer_loss" not in auxes[1]
    selected = topk_as_mask(carry.topk, S)
    keyset = allowed & selected if mode == "sparse" else allowed
    target = sum(naive_target(p, x, ctx.cos, ctx.sin, keyset) for p, x in zip(ps, xs)) / 3
    ref_live = glm5f.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), ps[0])
    ref_loss, ref_recall = naive_indexer_kl(ref_live, xs[0], ctx.cos, ctx.sin, keyset, selected, valid, target)
    own_loss, _ = naive_indexer_kl(ps[0], xs[0], ctx.cos, ctx.sin, keyset, selected, valid)
    loss = float(ref_loss.detach())
    assert loss > 0.5 and abs(loss - float(own_loss)) > 0.05 * loss  # the mean target is not layer 0's own
    assert abs(float(auxes[2]["indexer_loss"].detach()) - loss) <= 1e-6 * loss
    assert abs(float(auxes[2]["indexer_recall"]) - float(ref_recall)) <= 1e-6 * float(ref_recall)
    leaves = {k: t for k, t in glm5f.flatten(live).items() if t.requires_grad}
    ref_leaves = glm5f.flatten(ref_live)
    grads = torch.autograd.grad(auxes[2]["indexer_loss"], list(leaves.values()))
    ref_grads = torch.autograd.grad(ref_loss, [ref_leaves[k] for k in leaves])
    for name, gr, r in zip(leaves, grads, ref_grads):
        assert float(r.norm()) > 0, name
        assert float((gr - r).norm() / r.norm()) <= 1e-6, name


def test_indexer_mean_target_without_shared_layers_is_own_and_works_under_checkpointing():
    params, batch = glm5f.init_params(CFG), batch_of("packed")
    args = ["--model.preset", "glm5-tiny", "--model.index_topk", "8", "--model.initializer_range", "0.2",
            "--train.indexer_loss", "dense"]
    every_full = dataclasses.replace(CFG, indexer_types=("full",) * 3)
    own, g_own, _ = run_step(params, batch, cli(*args), every_full)
    mean, g_mean, _ = run_step(params, batch, cli(*args, "--train.indexer_target", "mean"), every_full)
    assert own == mean and set(g_own) == set(g_mean)
    for k in g_own:
        assert torch.equal(g_own[k], g_mean[k]), k
    # glm5-tiny's layers are F F S: layer 1's group holds layer 2; under activation checkpointing the same numbers
    shared, g, _ = run_step(params, batch, cli(*args, "--train.indexer_target", "mean"), CFG)
    remat, g_remat, _ = run_step(params, batch, cli(*args, "--train.indexer_target", "mean",
                                                      "--train.activation_checkpointing"), CFG)
    own_shared, _, _ = run_step(params, batch, cli(*args), CFG)
    assert shared == remat and shared["indexer_loss"] != own_shared["indexer_loss"]
    for k in g:
        assert torch.equal(g[k], g_remat[k]), k
    assert any("--train.indexer_target must be own or mean" in e
               for e in validate(cli("--train.indexer_target", "both")))


def batch_of(kind: str, seed: int = 0) -> dict:
    am, pos, _, _ = inputs(kind)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "labels": ids.clone(),
             "position_ids": torch.arange(S).expand(B, S) if pos is None else pos}
    if am is not None:
        batch["attention_mask"] = am
        batch["labels"] = ids.masked_fill(am == 0, glm5f.IGNORE_INDEX)
    return batch


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_loss_leaves_every_other_gradient_unchanged(mode):
    params = glm5f.init_params(CFG)
    batch = batch_of("padding")
    args = ["--model.preset", "glm5-tiny", "--model.index_topk", "8", "--model.initializer_range", "0.2"]
    off, g_off, _ = run_step(params, batch, cli(*args), CFG)
    on, g_on, _ = run_step(params, batch, cli(*args, "--train.indexer_loss", mode), CFG)
    indexer = {k for k in glm5f.flatten(params) if ".indexer." in k}
    assert set(g_off) == set(g_on) - indexer and len(indexer) == 10 and indexer <= set(g_on)
    for k in g_off:
        assert torch.equal(g_off[k], g_on[k]), k
    assert all(float(g_on[k].norm()) > 0 for k in indexer)
    assert on["loss"] == off["loss"] and set(off) == {"loss"}
    assert on["indexer_loss"] > 0 and 0 < on["indexer_recall"] <= 1 + 1e-6


def test_indexer_loss_under_activation_checkpointing():
    params, batch = glm5f.init_params(CFG), batch_of("packed")
    args = ["--model.preset", "glm5-tiny", "--model.index_topk", "8", "--model.initializer_range", "0.2",
            "--train.indexer_loss", "dense"]
    plain, g, _ = run_step(params, batch, cli(*args), CFG)
    remat, g_remat, _ = run_step(params, batch, cli(*args, "--train.activation_checkpointing"), CFG)
    assert plain == remat
    for k in g:
        assert torch.equal(g[k], g_remat[k]), k


def test_trainable_selects_leaves_and_bad_patterns_are_config_errors():
    params = glm5f.init_params(CFG)
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


def test_indexer_warmup_trains_only_the_indexer(tmp_path):
    """The warm-up (`--train.trainable indexer --train.indexer_loss dense`) on the embedded text, from weights wide
    enough that the frozen model's attention is not near-uniform (as a trained model's is not)."""
    recs = train(cli("--train.trainable", "indexer", "--train.indexer_loss", "dense", "--train.steps", "20",
                     "--model.initializer_range", "0.2", "--data.batch_size", "4", "--data.seq_len", "64",
                     "--optim.warmup_steps", "2", "--optim.lr", "1e-2", "--eval.every", "0",
                     "--checkpoint.dir", str(tmp_path)))
    first, last = recs[:3], recs[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "indexer_loss") < 0.8 * mean(first, "indexer_loss")
    assert mean(last, "indexer_recall") > mean(first, "indexer_recall") + 0.02
    assert len({r["loss"] for r in recs}) > 1  # the data changes, the LM loss is still reported
    model_cfg = glm5f.preset("glm5-tiny", initializer_range=0.2)
    init = glm5f.init_params(model_cfg)
    trained = trained_paths(init, "indexer", indexer=True)
    state = {"params": glm5f.init_params(model_cfg, seed=1), "optim": adamw_init(init, trained)}
    checkpoint.load(checkpoint.latest(str(tmp_path)), state)
    final = glm5f.flatten(state["params"])
    for k, t in glm5f.flatten(init).items():
        if k in trained:
            assert not torch.equal(final[k], t), k
        else:
            assert torch.equal(final[k], t), k  # including the routers' e_score_correction_bias
