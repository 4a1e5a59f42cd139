"""glm5f/train/loss.py and the objectives it sums beside the LM loss: the lightning indexer's KL distillation loss
(glm5f/model/indexer_loss.py), the MoE sequence-wise balance loss in the step, and the MTP loss weight (the targets
and the chunked head: tests/test_head.py).

The indexer loss is checked against a naive fp64 implementation of its formula (per-head MLA scores over the keys
each query may see, head-summed and L1-normalised probabilities as the target, the log-softmax of the index scores
as the student), its gradient against autograd through that implementation.
"""

import dataclasses
import functools
import json

import pytest
import torch

import glm5f
from configs import Config, validate
from conftest import RUN_64, cli, env_of, forward_by_layers, naive_seq_aux, rel_err, run_step
from glm5f.ckpt import checkpoint
from glm5f.model.attention import LATENT_NORM_EPS, attention
from glm5f.kernels.dsa import topk_as_mask
from glm5f.train.loss import Step, step_grads, with_targets
from glm5f.model.head import cross_entropy_sum, mtp_targets
from glm5f.model.decoder import apply
from glm5f.core.ops import apply_rope, layer_norm, rms_norm
from glm5f.train.optim import value_and_grad
from glm5f.parallel.layout import Layout
from test_head import whole_logits_loss_sum
from train import main

# glm5-tiny with weights wide enough that attention and index scores are far from uniform, top-k 8 of 24 keys
CFG = glm5f.preset("glm5-tiny", initializer_range=0.2, index_topk=8)
B, S = 2, 24
MTP_CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer


def layer0_params(seed: int = 0) -> dict:
    """Layer 0's attention params in fp64, norm scales and biases perturbed (so their gradients are not special)."""
    p = glm5f.init_params(CFG, seed=seed, dtype=torch.float64)["model"]["layers"][0]["self_attn"]
    g = torch.Generator().manual_seed(seed)
    return glm5f.core.params.map_with_path(
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
def test_indexer_kl_and_its_gradients_match_the_formula(mode, kind, blocks):
    block_elems = 4000 if blocks == "many" else glm5f.model.indexer_loss.INDEXER_LOSS_BLOCK_ELEMS  # many: 1 to 3 queries
    am, pos, allowed, valid = inputs(kind)
    p = layer0_params()
    x = torch.randn(B, S, CFG.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ctx = env_of(CFG, (B, S), am, pos, torch.float64, indexer_loss=mode)
    live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
    _, carry, aux = attention(live, x, CFG, 0, ctx, None, kl_block_elems=block_elems)
    topk = carry.topk
    assert topk is not None and topk.shape[-1] == CFG.index_topk
    selected = topk_as_mask(topk, S)
    keyset = allowed & selected if mode == "sparse" else allowed
    ref_live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
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
def test_indexer_mean_target_and_its_gradients_match_the_formula(mode, kind):
    """--train.indexer_target mean on layers F S S: layer 0's indexer learns the mean of the three layers' targets
    (each over the same key set), its loss appearing at layer 2, the group's last."""
    cfg = dataclasses.replace(CFG, indexer_types=("full", "shared", "shared"))
    am, pos, allowed, valid = inputs(kind)
    g = torch.Generator().manual_seed(3)
    layers = glm5f.init_params(cfg, seed=1, dtype=torch.float64)["model"]["layers"]
    ps = [glm5f.core.params.map_with_path(lambda path, t: t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
                                     if t.ndim == 1 else t, layer["self_attn"]) for layer in layers]
    assert "indexer" in ps[0] and "indexer" not in ps[1] and "indexer" not in ps[2]
    xs = [torch.randn(B, S, CFG.hidden_size, generator=g, dtype=torch.float64) for _ in ps]
    ctx = env_of(cfg, (B, S), am, pos, torch.float64, indexer_loss=mode, indexer_target="mean")
    live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), ps[0])
    carry, auxes = None, []
    for i, (p, x) in enumerate(zip([live] + ps[1:], xs)):
        _, carry, aux = attention(p, x, cfg, i, ctx, carry, kl_block_elems=20000)  # several query blocks
        auxes.append(aux)
        assert bool(carry.targets) == (i < 2)  # the group's targets ride along until its last layer
    assert "indexer_loss" not in auxes[0] and "indexer_loss" not in auxes[1]
    selected = topk_as_mask(carry.topk, S)
    keyset = allowed & selected if mode == "sparse" else allowed
    target = sum(naive_target(p, x, ctx.cos, ctx.sin, keyset) for p, x in zip(ps, xs)) / 3
    ref_live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), ps[0])
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
    full_params = glm5f.init_params(every_full)  # every layer with its own indexer
    own, g_own, _ = run_step(full_params, batch, cli(*args), every_full)
    mean, g_mean, _ = run_step(full_params, batch, cli(*args, "--train.indexer_target", "mean"), every_full)
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


def padded_batch(cfg: glm5f.GLM5Config, B: int = 4, S: int = 16, seed: int = 0) -> dict:
    """Random tokens, rows right-padded to different lengths (attention_mask 0, labels -100), the last wholly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor([S, S - 5, 3, 0])[:B, None]).long()
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, glm5f.IGNORE_INDEX),
            "position_ids": torch.arange(S).expand(B, S), "attention_mask": mask}


def test_train_step_objective_matches_the_formula():
    """The step's seq_aux_loss metric (mean over sequences, summed over MoE layers) and its gradients of
    loss + coeff * seq_aux_loss wrt every trained leaf equal autograd of the naive formula applied to each MoE
    layer's input, over a padded batch cut into two micro-batches (fp64, rel 1e-6)."""
    coeff = 0.5
    cfg = cli("--train.dtype", "float64", "--train.grad_accum", "2", "--train.seq_aux_loss_coeff", str(coeff))
    model_cfg = cfg.model.build()
    params = glm5f.init_params(model_cfg, seed=1, dtype=torch.float64)
    for layer in params["model"]["layers"]:
        if "gate" in layer["mlp"]:
            layer["mlp"]["gate"]["weight"] = layer["mlp"]["gate"]["weight"] * 200  # scores spread beyond 0.5
            layer["mlp"]["gate"]["e_score_correction_bias"].normal_(0, 0.1)
    batch = padded_batch(model_cfg)
    metrics, grads, _ = run_step(params, batch, cfg, model_cfg)

    seen = []
    full = with_targets(batch)
    n_seq = int((full["valid"].sum(1) > 0).sum())

    def objective(params):
        seen.clear()
        ctx = env_of(model_cfg, full["input_ids"].shape, full["attention_mask"], full["position_ids"], torch.float64)
        logits = forward_by_layers(params, model_cfg, full["input_ids"], ctx, moe_inputs=seen)
        ce, n = cross_entropy_sum(logits, full["targets"])
        aux = sum(naive_seq_aux(gate, x, full["valid"], model_cfg) for gate, x in seen) / n_seq
        return ce / n + coeff * aux, aux

    (_, aux), want = value_and_grad(objective, has_aux=True)(params)
    assert len(seen) == sum(model_cfg.is_moe(i) for i in range(model_cfg.num_hidden_layers)) >= 2
    assert abs(metrics["seq_aux_loss"] - float(aux)) <= 1e-6 * float(aux)
    assert grads.keys() == want.keys()
    for k, g in want.items():
        assert rel_err(grads[k], g) <= 1e-6, f"{k}: relative gradient error {rel_err(grads[k], g):.2e}"
    gate = "model.layers.1.mlp.gate.weight"
    _, no_aux, _ = run_step(params, batch, cli("--train.dtype", "float64", "--train.grad_accum", "2"), model_cfg)
    assert rel_err(grads[gate], no_aux[gate]) > 1e-3  # the loss does move the router


def test_coeff_zero_leaves_the_step_as_before():
    """--train.seq_aux_loss_coeff 0 (the default): the step's metrics and gradients are, bit for bit, those of the
    plain LM loss (autograd of the cross-entropy mean), and no seq_aux_loss is logged."""
    cfg = cli("--data.seq_len", "16")
    assert cfg.train.seq_aux_loss_coeff == 0.0
    model_cfg = cfg.model.build()
    params = glm5f.init_params(model_cfg, seed=2)
    batch = padded_batch(model_cfg)
    metrics, grads, _ = run_step(params, batch, cfg, model_cfg)
    full = with_targets(batch)

    def lm_loss(params):
        ctx = env_of(model_cfg, full["input_ids"].shape, full["attention_mask"], full["position_ids"])
        ce, n = cross_entropy_sum(apply(params, model_cfg, full["input_ids"], ctx)[0], full["targets"])
        return ce / n.clamp(min=1)

    loss, want = value_and_grad(lm_loss)(params)
    assert metrics.keys() == {"loss"} and metrics["loss"] == float(loss)
    for k, g in want.items():
        assert torch.equal(grads[k], g), k
    assert validate(cli("--train.seq_aux_loss_coeff", "-1")) == ["--train.seq_aux_loss_coeff must be >= 0, got -1.0"]


def test_mtp_weight_scales_the_gradient_the_main_model_gets():
    """Weight 0: the main leaves' gradients are bit for bit those of the model without an MTP layer; weight w:
    they move by w times the MTP loss's gradient (checked against two weights)."""
    base = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(MTP_CFG, seed=1)
    main_params = glm5f.init_params(base, seed=1)
    ids = torch.randint(0, MTP_CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(24).expand(2, 24)}
    layout, run = Layout(torch.device("cpu")), Config()
    grads = {}
    for w in (0.0, 0.5, 1.0):
        run.train.mtp_loss_weight = w
        metrics, grads[w], _ = step_grads(params, batch, MTP_CFG, layout, Step.of(run.train, MTP_CFG))
    _, plain, _ = step_grads(main_params, batch, base, layout, Step.of(run.train, base))
    for k, g in plain.items():
        assert torch.equal(grads[0.0][k], g), k
    k = "model.layers.2.self_attn.o_proj.weight"
    mtp_part = grads[1.0][k] - grads[0.0][k]
    assert mtp_part.abs().max() > 0
    assert rel_err(grads[0.5][k] - grads[0.0][k], 0.5 * mtp_part) <= 1e-4


def step_with_head(monkeypatch, head_fn, params, batch, run, model_cfg, spec=None, adapters=None):
    """`step_grads` with micro_loss's head loss `head_fn`; LoRA's adapters trained when given."""
    monkeypatch.setattr(glm5f.train.loss, "head_loss_sum", head_fn)
    model = glm5f.model.lora.attach(params, adapters) if adapters else params
    return step_grads(model, batch, model_cfg, Layout(torch.device("cpu")), Step.of(run.train, model_cfg, spec))


@pytest.mark.parametrize("variant", ["untied", "tied", "lora"])
def test_step_with_head_chunks_equals_the_whole_logits(variant, monkeypatch):
    """A training step (the main head and an MTP depth, two micro-batches, padding) with heads of 3-token chunks:
    its metrics and gradients equal those of the whole-logits head within 1e-12 in fp64, tied embeddings (the
    head's gradient meets the embedding's) and LoRA (a frozen head) included; in fp32 within twice the
    whole-logits step's own error of the fp64 one plus 8 fp32 epsilons."""
    args = ["--model.num_nextn_predict_layers", "1", "--train.grad_accum", "2", "--train.mtp_loss_weight", "0.5"]
    args += ["--model.tie_word_embeddings", "True"] if variant == "tied" else []
    args += ["--lora.rank", "4"] if variant == "lora" else []
    steps = {}
    for dtype in ("float64", "float32"):
        run = cli(*args, "--train.dtype", dtype)
        model_cfg, spec = run.model.build(), run.lora.spec()
        params = glm5f.init_params(model_cfg, seed=1, dtype=getattr(torch, dtype))
        adapters = None
        if spec:
            g = torch.Generator().manual_seed(2)
            adapters = {k: (t + 0.1 * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype))
                        for k, t in glm5f.model.lora.init_adapters(params, spec, 0, getattr(torch, dtype)).items()}
        batch = padded_batch(model_cfg)
        chunked = functools.partial(glm5f.model.head.head_loss_sum, chunk_elems=3 * model_cfg.vocab_size)
        for name, fn in (("chunks", chunked), ("whole", whole_logits_loss_sum)):
            steps[dtype, name] = step_with_head(monkeypatch, fn, params, batch, run, model_cfg, spec, adapters)
    (m, g, _), (wm, wg, _) = steps["float64", "chunks"], steps["float64", "whole"]
    assert m.keys() == wm.keys() == {"loss", "mtp_loss"} and g.keys() == wg.keys()
    assert all(abs(m[k] - wm[k]) <= 1e-12 * abs(wm[k]) for k in m)
    assert ("lm_head.weight" in g) == (variant == "untied")
    for k in g:
        assert rel_err(g[k], wg[k]) <= 1e-12, f"{k}: {rel_err(g[k], wg[k]):.2e}"
    (_, g32, _), (_, wg32, _) = steps["float32", "chunks"], steps["float32", "whole"]
    for k in g:
        if float(wg[k].norm()) > 0:
            floor = rel_err(wg32[k].double(), wg[k])
            # twice the whole-logits step's own fp32 error, plus a few fp32 roundings of the chunked sums
            assert rel_err(g32[k].double(), wg[k]) <= 2 * floor + 8 * torch.finfo(torch.float32).eps, k


# ---- MTP depths sharing one layer (--model.mtp_shared_depths) ------------------------------------------------------

def test_shared_mtp_depths_equal_a_naive_loop_over_one_layer():
    """Three MTP depths through the one MTP layer (fp64, padded batch, two micro-batches): the step's mtp_loss
    and the gradients of every leaf equal autograd of a plain loop that runs the layer's decoder layer three times,
    depth d on depth d-1's output and the embedding of t_{i+d}, each depth's token mean weighted equally within
    --train.mtp_loss_weight. The checkpoint's tree holds one MTP layer."""
    w = 0.5
    run = cli("--model.num_nextn_predict_layers", "1", "--model.mtp_shared_depths", "3", "--train.dtype", "float64",
              "--train.grad_accum", "2", "--train.mtp_loss_weight", str(w))
    cfg = run.model.build()
    L, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    params = glm5f.init_params(cfg, seed=3, dtype=torch.float64)
    assert len(params["model"]["layers"]) == L + 1 and cfg.mtp_depths == 3
    batch = padded_batch(cfg, S=20)
    metrics, grads, counts = run_step(params, batch, run, cfg)
    full = with_targets(batch)
    # the shared layer's router bias balances over the tokens of all three depths
    routed = counts[f"model.layers.{L}.mlp.gate.e_score_correction_bias"].sum()
    assert float(routed) == 3 * int(full["valid"].sum()) * cfg.num_experts_per_tok

    def objective(params):
        ctx = env_of(cfg, full["input_ids"].shape, full["attention_mask"], full["position_ids"], torch.float64)
        logits, aux = apply(params, cfg, full["input_ids"], ctx)
        ce, n = cross_entropy_sum(logits, full["targets"])
        p = params["model"]["layers"][L]
        h, depth_means = aux["hidden"], []
        for d in (1, 2, 3):
            ids = torch.nn.functional.pad(full["input_ids"][:, d:], (0, d))
            e = params["model"]["embed_tokens"]["weight"][ids]
            x = torch.cat([rms_norm(p["enorm"]["weight"], e, eps), rms_norm(p["hnorm"]["weight"], h, eps)], -1)
            h = glm5f.decoder_layer(p, x @ p["eh_proj"]["weight"].T, cfg, L, ctx, None)[0]
            lg = rms_norm(p["shared_head"]["norm"]["weight"], h, eps) @ params["lm_head"]["weight"].T
            t = mtp_targets(full["labels"], d, full["position_ids"], full["valid"])
            s, m = cross_entropy_sum(lg, t)
            depth_means.append(s / m)
        mtp = sum(depth_means) / 3
        return ce / n + w * mtp, mtp

    (_, mtp), want = value_and_grad(objective, has_aux=True)(params)
    assert abs(metrics["mtp_loss"] - float(mtp)) <= 1e-12 * float(mtp)
    assert grads.keys() == want.keys()
    for k, g in want.items():
        assert rel_err(grads[k], g) <= 1e-10, f"{k}: relative gradient error {rel_err(grads[k], g):.2e}"
    assert float(want[f"model.layers.{L}.eh_proj.weight"].norm()) > 0


# ---- GLM-5.3: the pooled indexer's loss ------------------------------------------------------------------------

CFG53 = glm5f.preset("glm53-tiny", initializer_range=0.2)  # layer 1: DSA with pools of 2 and the tail, top 4 pools


def naive_pool_ends(valid_BxS, seg_BxS, kpool):
    """[B, S] bool, a loop: the last token of each complete pool, pools tiling each document from its first real
    token, a pool complete when its kpool tokens are all real and in the document."""
    ends = torch.zeros_like(valid_BxS)
    for b in range(valid_BxS.shape[0]):
        start = None
        for t in range(valid_BxS.shape[1]):
            if t == 0 or seg_BxS[b, t] != seg_BxS[b, t - 1]:
                start = None
            if start is None and valid_BxS[b, t]:
                start = t
            if start is not None and (t - start + 1) % kpool == 0:
                toks = range(t - kpool + 1, t + 1)
                ends[b, t] = all(bool(valid_BxS[b, u]) and seg_BxS[b, u] == seg_BxS[b, t] for u in toks)
    return ends


def naive_pooled_kl(p, x, allowed_BxSxT, valid_BxS, seg_BxS, selected_BxSxT, mode):
    """(KL sum, recall sum) of the pooled indexer's loss from its definition (docs/objectives.md), fp64, loops over
    pools.
    selected_BxSxT: the tokens the layer attends (the pooled selection with its tail)."""
    c = CFG53
    H, N, I, J, K = c.num_attention_heads, c.qk_nope_head_dim, c.index_n_heads, c.index_head_dim, c.index_kpool
    eps = c.rms_norm_eps
    with torch.no_grad():  # the target: MLA (NoPE) probabilities over the key set, head-summed, normalised
        q = (rms_norm(p["q_a_layernorm"]["weight"], x @ p["q_a_proj"]["weight"].T, eps)
             @ p["q_b_proj"]["weight"].T).view(B, S, H, N + c.v_head_dim * 0)[..., :N]
        lat = rms_norm(p["kv_a_layernorm"]["weight"], x @ p["kv_a_proj_with_mqa"]["weight"].T, eps)
        k = (lat @ p["kv_b_proj"]["weight"].T).view(B, S, H, N + c.v_head_dim)[..., :N]
        keyset = allowed_BxSxT & selected_BxSxT if mode == "sparse" else allowed_BxSxT
        scores = torch.einsum("bshn,bthn->bhst", q, k) * c.softmax_scale
        target = torch.softmax(scores.masked_fill(~keyset[:, None], float("-inf")), -1).nan_to_num(0).sum(1)
        target = target / target.sum(-1, keepdim=True).clamp(min=1e-300)
    ip = p["indexer"]
    q_lat = rms_norm(p["q_a_layernorm"]["weight"], x @ p["q_a_proj"]["weight"].T, eps)
    qi = (q_lat @ ip["wq_b"]["weight"].T).view(B, S, I, J)
    w = x @ ip["weights_proj"]["weight"].T * I ** -0.5
    keys = layer_norm(ip["k_norm"], x @ ip["wk"]["weight"].T)
    gate = x @ ip["index_kpool_compress_gate"].T
    ends = naive_pool_ends(valid_BxS, seg_BxS, K)
    loss = recall = 0.0
    for b in range(B):
        for s in range(S):
            if not valid_BxS[b, s]:
                continue
            pools = [e for e in range(S) if ends[b, e] and allowed_BxSxT[b, s, e]]
            if mode == "sparse":  # the chosen pools: those whose tokens are all selected
                pools = [e for e in pools if bool(selected_BxSxT[b, s, e - K + 1:e + 1].all())]
            if not pools:
                recall += 1.0
                continue
            mass = torch.stack([target[b, s, e - K + 1:e + 1].sum() for e in pools])
            score = []
            for e in pools:
                weights = torch.softmax(gate[b, e - K + 1:e + 1] + ip["index_kpool_compress_ape"], dim=0)
                key = (weights * keys[b, e - K + 1:e + 1]).sum(0)
                score.append((w[b, s] * torch.relu(qi[b, s] @ key / J ** 0.5)).sum())
            t = mass / mass.sum()
            loss = loss + (t * (torch.log(t) - torch.log_softmax(torch.stack(score), 0))).sum()
            chosen = [bool(selected_BxSxT[b, s, e - K + 1:e + 1].all()) for e in pools]
            recall += float(t[torch.tensor(chosen)].sum())
    return loss, recall


@pytest.mark.parametrize("blocks", ["one", "many"])
@pytest.mark.parametrize("kind", ["causal", "padding", "packed"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_pooled_indexer_kl_and_its_gradients_match_the_definition(mode, kind, blocks):
    """GLM-5.3's DSA layer with --train.indexer_loss: the loss, recall and every indexer leaf's gradient (the pool
    terms included) equal the naive fp64 definition's (docs/objectives.md, "Indexer loss"), over one or many query
    blocks."""
    block_elems = 4000 if blocks == "many" else glm5f.model.indexer_loss.INDEXER_LOSS_BLOCK_ELEMS
    am, pos, allowed, valid = inputs(kind)
    seg = torch.zeros(B, S, dtype=torch.long) if pos is None else \
        (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    layer = 1
    assert glm5f.core.layers.layer_spec(CFG53, layer).indexer == "pooled"
    g = torch.Generator().manual_seed(0)
    p = glm5f.core.params.map_with_path(  # the constant inits (norms, pool terms) perturbed
        lambda path, t: t + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype),
        glm5f.init_params(CFG53, seed=0, dtype=torch.float64)["model"]["layers"][layer]["self_attn"])
    x = torch.randn(B, S, CFG53.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    env = env_of(CFG53, (B, S), am, pos, torch.float64, indexer_loss=mode)
    live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
    _, carry, aux = attention(live, x, CFG53, layer, env, None, kl_block_elems=block_elems)
    selected = torch.zeros(B, S, S + 1, dtype=torch.bool).scatter_(
        2, torch.where(carry.allowed, carry.topk, S), True)[..., :S]
    assert (selected.sum(-1) < allowed.sum(-1))[valid].any(), "the selection must be sparse for some query"
    ref_live = glm5f.core.params.map_with_path(lambda path, t: t.clone().requires_grad_(".indexer." in f".{path}"), p)
    ref_loss, ref_recall = naive_pooled_kl(ref_live, x, allowed, valid, seg, selected, mode)
    loss = float(ref_loss.detach())
    assert loss > 0.1
    assert abs(float(aux["indexer_loss"].detach()) - loss) <= 1e-10 * loss
    assert abs(float(aux["indexer_recall"]) - ref_recall) <= 1e-10 * ref_recall
    if mode == "dense":
        assert ref_recall < int(valid.sum()) - 0.5  # the chosen pools miss some of the target's mass
    leaves = {k: t for k, t in glm5f.flatten(live).items() if t.requires_grad}
    assert {"indexer.index_kpool_compress_ape", "indexer.index_kpool_compress_gate"} <= set(leaves)
    grads = torch.autograd.grad(aux["indexer_loss"], list(leaves.values()))
    ref_grads = torch.autograd.grad(ref_loss, [glm5f.flatten(ref_live)[k] for k in leaves])
    for name, gr, r in zip(leaves, grads, ref_grads):
        assert float(r.norm()) > 0, name
        assert float((gr - r).norm() / r.norm()) <= 1e-9, name


def test_mtp_loss_weight_given_for_a_model_without_mtp_layers_is_one_warning(tmp_path, capsys):
    """--train.mtp_loss_weight on a model without MTP layers: one warning line (no MTP loss exists to weight).
    Not given: no warning, and a model with MTP layers trains with 0.1 (the same losses as --train.mtp_loss_weight
    0.1, and Step.of's weight)."""
    tiny = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64[:4], "--train.steps", "2",
            "--eval.every", "0"]
    assert main(tiny + ["--train.mtp_loss_weight", "0.5", "--checkpoint.dir", str(tmp_path / "set")]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "mtp_loss_weight" in line] == [
        "warning: --train.mtp_loss_weight 0.5 is not used: the model has no MTP layers "
        "(--model.num_nextn_predict_layers), so there is no mtp_loss to weight; drop the flag or train a model "
        "with them"], err
    mtp = tiny + ["--model.num_nextn_predict_layers", "1"]
    assert main(tiny + ["--checkpoint.dir", str(tmp_path / "plain")]) == 0
    assert main(mtp + ["--checkpoint.dir", str(tmp_path / "default")]) == 0
    assert main(mtp + ["--train.mtp_loss_weight", "0.1", "--checkpoint.dir", str(tmp_path / "given")]) == 0
    assert "mtp_loss_weight" not in capsys.readouterr().err
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("default", "given")}
    assert [(r["loss"], r["mtp_loss"]) for r in records["default"]] == \
        [(r["loss"], r["mtp_loss"]) for r in records["given"]]
    run = checkpoint.read_meta(checkpoint.latest(str(tmp_path / "default")))["run"]
    assert run["train"]["mtp_loss_weight"] is None
    assert Step.of(Config().train, glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)).coeffs["mtp_loss"] == 0.1
