"""glm5f/model/decoder.py: causality through gradients, padding, the MTP layer against a Transformers reference, and the
forward's input checks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jacrev

import glm5f
import glm5f.model.decoder as model_mod
from conftest import env_of, rel_err, stable_topk, with_grad
from glm5f.model.env import Objectives
from glm5f.train.loss import Step, micro_loss, step_denoms, with_targets
from glm5f.parallel.layout import Layout

MTP_CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.integers(18, 28), st.integers(0, 2**31 - 1))
def test_causality_through_gradients(S, seed):
    """The output at position t has zero derivative with respect to every input after t (torch.func.jacrev)."""
    cfg = glm5f.preset("glm5-tiny")  # index_topk 16 < S: sparse attention, shared indexer layer, MoE
    params = glm5f.init_params(cfg, seed=seed % 991)
    ctx = env_of(cfg, (1, S))
    x = torch.randn(1, S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    probe = torch.randn(cfg.vocab_size, generator=torch.Generator().manual_seed(seed + 1))

    def per_position(x):
        return model_mod.apply_embeds(params, cfg, x, ctx)[0][0] @ probe  # [S]

    jac_SxS = jacrev(per_position)(x)[:, 0].abs().sum(-1)  # d out[t] / d x[s]
    assert torch.all(jac_SxS.triu(1) == 0)
    assert torch.all(jac_SxS.diagonal() > 0)
    t = S // 2
    g = grad(lambda x: per_position(x)[t])(x)
    assert torch.all(g[0, t + 1:] == 0) and g[0, : t + 1].abs().sum() > 0


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=3), st.integers(0, 2**31 - 1))
def test_padding_does_not_change_real_tokens(lengths, seed):
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=seed % 983)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    alone = [glm5f.forward(params, cfg, s[None])[0] for s in seqs]
    S = max(lengths)
    right = torch.zeros(len(seqs), S, dtype=torch.long)
    left = torch.zeros(len(seqs), S, dtype=torch.long)
    rmask, lmask = torch.zeros_like(right), torch.zeros_like(left)
    for i, s in enumerate(seqs):
        right[i, :len(s)], rmask[i, :len(s)] = s, 1
        left[i, S - len(s):], lmask[i, S - len(s):] = s, 1
    out_r = glm5f.forward(params, cfg, right, attention_mask=rmask)
    out_l = glm5f.forward(params, cfg, left, attention_mask=lmask,
                          position_ids=(lmask.cumsum(-1) - 1).clamp(min=0))
    for i, s in enumerate(seqs):
        assert (out_r[i, :len(s)] - alone[i]).abs().max() <= 1e-5
        assert (out_l[i, S - len(s):] - alone[i]).abs().max() <= 1e-5


def reference_mtp_logits(params, cfg, ids, hidden):
    """MTP depth 1 from the formula in fp64: enorm / hnorm / eh_proj by hand, the decoder layer as Transformers'
    (a one-layer GlmMoeDsaForCausalLM whose final norm is shared_head.norm and whose head is the main one, fed
    the projected embeddings)."""
    from torch.func import functional_call
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    L, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = params["model"]["layers"][L]
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # t_{i+1}; the last position is unused
    e = params["model"]["embed_tokens"]["weight"][nxt]
    x = torch.cat([rms(e, p["enorm"]["weight"]), rms(hidden, p["hnorm"]["weight"])], dim=-1) @ p["eh_proj"]["weight"].T
    one = dataclasses.replace(cfg, num_hidden_layers=1, mlp_layer_types=("sparse",), indexer_types=("full",),
                      num_nextn_predict_layers=0)
    hcfg = GlmMoeDsaConfig(**one.to_hf())
    hcfg._attn_implementation = "eager"
    hcfg._experts_implementation = "eager"  # the grouped-matmul one has no fp64
    model = GlmMoeDsaForCausalLM(hcfg).eval().double()
    block = {k: v for k, v in p.items() if k not in ("enorm", "hnorm", "eh_proj", "shared_head")}
    tree = {"model": {"embed_tokens": params["model"]["embed_tokens"], "layers": [block],
                      "norm": p["shared_head"]["norm"]}, "lm_head": params["lm_head"]}
    with stable_topk():  # its indexer's ties (ReLU zeros) broken as ours
        return functional_call(model, glm5f.hf_state_dict(tree, fused_experts=True), (), {"inputs_embeds": x}).logits


def test_mtp_forward_loss_and_gradients_match_the_formula():
    cfg, S = MTP_CFG, 40  # S > index_topk: the MTP layer's attention is sparse
    params = glm5f.core.params.map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=7))
    with torch.no_grad():
        params["model"]["layers"][3]["mlp"]["gate"]["e_score_correction_bias"].normal_(0, 0.1)
        for name in ("enorm", "hnorm"):  # non-trivial norm scales
            params["model"]["layers"][3][name]["weight"].uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = glm5f.IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(S).expand(2, S)}
    full = with_targets(batch, 1)
    step = Step(Objectives(mtp_depths=1), {"loss": 1.0, "mtp_loss": 1.0}, torch.float64)
    denoms = step_denoms(full, cfg, step.objectives)

    p = with_grad(params)
    objective, (sums, _) = micro_loss(p, full, denoms, cfg, Layout(torch.device("cpu")), step)
    ours = sums["mtp_loss"] / denoms["mtp_depths"]
    leaves = {k: v for k, v in glm5f.flatten(p).items()
              if k.startswith("model.layers.3.") and v.requires_grad and ".indexer." not in k}
    grads = torch.autograd.grad(ours, list(leaves.values()))

    # the reference: its own hidden state input (no gradient to the main model), its own targets
    with torch.no_grad():
        ctx = env_of(cfg, ids.shape, dtype=torch.float64)
        hidden = glm5f.apply(params, cfg, ids, ctx)[1]["hidden"]
    ref_logits = reference_mtp_logits(p, cfg, ids, hidden)
    from glm5f.model.head import mtp_inputs
    from glm5f.model.decoder import mtp_apply
    with torch.no_grad():
        our_logits = mtp_apply(params, cfg, hidden, [mtp_inputs(ids, 1)], ctx)[0][0]
    assert rel_err(our_logits[:, :-1], ref_logits[:, :-1].detach()) <= 1e-6
    targets = torch.full_like(labels, glm5f.IGNORE_INDEX)
    targets[:, :-2] = labels[:, 2:]  # t_{i+2} at i
    assert (targets != glm5f.IGNORE_INDEX).sum() == 2 * (S - 2) - 4
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=glm5f.IGNORE_INDEX)
    assert abs(ours.item() - ref.item()) <= 1e-6 * ref.item()
    ref_grads = torch.autograd.grad(ref, list(leaves.values()))
    for path, a, b in zip(leaves, grads, ref_grads):
        assert b.abs().max() > 0, path
        assert rel_err(a, b) <= 1e-6, f"{path}: relative gradient error {rel_err(a, b):.2e}"
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
            "model.layers.3.shared_head.norm.weight", "model.layers.3.mlp.experts.up_proj.weight"} <= set(leaves)
    # the objective adds the MTP loss (weight 1 here) to the LM loss
    assert abs(objective.item() - (sums["loss"] / denoms["targets"] + ours).item()) <= 1e-12


def test_token_ids_outside_vocab(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"\[0, vocab_size=512\).*\[3, 512\]"):
        glm5f.forward(params, cfg, torch.tensor([[3, 512]]))
    with pytest.raises(ValueError, match="found ids in"):
        glm5f.forward(params, cfg, torch.tensor([[-1, 4]]))


def test_wrong_input_shapes(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        glm5f.forward(params, cfg, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integer token ids"):
        glm5f.forward(params, cfg, torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"2D attention_mask must be \[batch, seq\] = \[1, 3\]"):
        glm5f.forward(params, cfg, torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="4D attention_mask"):
        glm5f.forward(params, cfg, torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 1, 3, 2))
    with pytest.raises(ValueError, match="position_ids must be"):
        glm5f.forward(params, cfg, torch.zeros(2, 3, dtype=torch.long), position_ids=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="labels must be"):
        glm5f.causal_lm_loss(torch.zeros(1, 3, 8), torch.zeros(1, 4, dtype=torch.long))
