"""The multi-token-prediction (MTP) layer: forward and loss against a reference, checkpoints, speculative decoding."""

import dataclasses
import json
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import glm5f
from conftest import boundary_ties, env_of, hf_model, rel_err, stable_topk, with_grad
from configs import Config
from glm5f import decode
from glm5f.optim import adamw_init, adamw_update, balance_router_bias
from glm5f.parallel import Layout
from glm5f.metrics import read_metrics
from glm5f.env import Objectives
from glm5f.loss import Step, micro_loss, mtp_targets, step_denoms, step_grads, with_targets
from train import main

CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


def naive_targets(labels, depth, position_ids, valid):
    """Python loops over the rule: the label of t_{i+depth+1}, same document as i, none of i, i+depth,
    i+depth+1 padding."""
    B, S = labels.shape
    out = torch.full_like(labels, glm5f.IGNORE_INDEX)
    for b in range(B):
        doc, d = [], 0
        for i in range(S):
            if i and position_ids[b, i] != position_ids[b, i - 1] + 1:
                d += 1
            doc.append(d)
        for i in range(S - depth - 1):
            j = i + depth + 1
            if doc[j] == doc[i] and valid[b, i] and valid[b, i + depth] and valid[b, j]:
                out[b, i] = labels[b, j]
    return out


@SETTINGS
@given(st.integers(0, 2**16), st.integers(1, 3), st.integers(2, 14), st.booleans())
def test_targets_stay_within_documents_and_skip_padding(seed, depth, S, padded):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (2, S), generator=g)
    labels[torch.rand(2, S, generator=g) < 0.2] = glm5f.IGNORE_INDEX
    starts = torch.rand(2, S, generator=g) < 0.25  # packed documents: positions restart
    pos = torch.zeros(2, S, dtype=torch.long)
    for b in range(2):
        for i in range(1, S):
            pos[b, i] = 0 if starts[b, i] else pos[b, i - 1] + 1
    valid = (torch.rand(2, S, generator=g) > 0.2).long() if padded else torch.ones(2, S, dtype=torch.long)
    assert torch.equal(mtp_targets(labels, depth, pos, valid), naive_targets(labels, depth, pos, valid))


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


def test_forward_loss_and_gradients_match_the_formula():
    cfg, S = CFG, 40  # S > index_topk: the MTP layer's attention is sparse
    params = glm5f.params.map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=7))
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
    from glm5f.loss import mtp_inputs
    from glm5f.model import mtp_apply
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


def test_config_preset_and_param_count():
    assert glm5f.preset("glm5").num_nextn_predict_layers == 1
    assert glm5f.preset("glm5-tiny").num_nextn_predict_layers == 0
    assert glm5f.GLM5Config.from_hf(CFG.to_hf()) == CFG
    D, base = CFG.hidden_size, glm5f.preset("glm5-tiny")
    layer = sum(v.numel() for k, v in glm5f.flatten(glm5f.init_params(CFG)).items()
                if k.startswith("model.layers.3.") and not k.endswith("e_score_correction_bias"))
    assert glm5f.param_count(CFG, include_mtp=False) == glm5f.param_count(base)
    assert glm5f.param_count(CFG) == glm5f.param_count(base) + layer
    assert layer > 2 * D * D + 3 * D
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 0"):
        glm5f.preset("glm5-tiny", num_nextn_predict_layers=-1)


def mtp_checkpoint(path, cfg, copies):
    """A Transformers save_pretrained checkpoint of `cfg` with the MTP layer's tensors added, as released
    checkpoints carry them (with DeepSeek-V3's embedding / head copies when `copies`)."""
    model = hf_model(cfg, seed=2)
    model.save_pretrained(path)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"]
    tensors = load_file(os.path.join(path, files[0]))
    assert not any(k.startswith("model.layers.3.") for k in tensors)  # Transformers has no MTP layer
    mtp = {k: v.contiguous().clone() for k, v in glm5f.hf_state_dict(glm5f.init_params(cfg, seed=5)).items()
           if k.startswith("model.layers.3.")}
    mtp["model.layers.3.mlp.gate.e_score_correction_bias"].normal_(0, 0.1)
    if copies:
        g = torch.Generator().manual_seed(9)
        for k in ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"):
            mtp[k] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
    save_file({**tensors, **mtp}, os.path.join(path, files[0]), metadata={"format": "pt"})
    assert json.load(open(os.path.join(path, "config.json")))["num_nextn_predict_layers"] == 1
    return model, sorted(mtp)


@pytest.mark.parametrize("copies", [False, True], ids=["glm5-layout", "with-embed-head-copies"])
def test_checkpoint_with_mtp_loads_trains_saves_and_round_trips(tmp_path, copies):
    from transformers import AutoModelForCausalLM

    _, mtp_keys = mtp_checkpoint(tmp_path / "in", CFG, copies)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing ignored, nothing dropped
        cfg, params = glm5f.load_hf(tmp_path / "in")
    assert cfg == CFG
    glm5f.check_params(params, cfg)
    assert glm5f.params.mtp_copies(params, cfg) == (("embed_tokens", "shared_head.head") if copies else ())
    exported = set(glm5f.hf_state_dict(params))
    assert set(mtp_keys) <= exported and not [k for k in exported if k.startswith("model.layers.4.")]
    before = {k: v.clone() for k, v in glm5f.flatten(params).items()}
    stored = load_file(tmp_path / "in" / "model.safetensors")
    for k in mtp_keys:
        assert torch.equal(glm5f.hf_state_dict(params)[k], stored[k]), k

    run = Config()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(32).expand(4, 32)}
    layout = Layout(torch.device("cpu"))
    metrics, grads, counts = step_grads(params, batch, cfg, layout, Step.of(run.train, cfg))
    assert math.isfinite(metrics["mtp_loss"]) and metrics["mtp_loss"] > 0
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in counts  # the MTP layer joins router balancing
    assert float(counts["model.layers.3.mlp.gate.e_score_correction_bias"].sum()) == 4 * 32 * cfg.num_experts_per_tok
    params, _ = adamw_update(params, grads, adamw_init(params), 1e-3)
    params = balance_router_bias(params, counts, 1e-3)
    after = glm5f.flatten(params)
    for k in ("model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
              *(["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"] if copies else [])):
        assert not torch.equal(after[k], before[k]), f"{k} did not train"

    glm5f.save_hf(tmp_path / "out", cfg, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg2, again = glm5f.load_hf(tmp_path / "out")
    assert cfg2 == cfg
    flat2 = glm5f.flatten(again)
    assert flat2.keys() == after.keys()
    for k, v in after.items():
        assert v.dtype == flat2[k].dtype and torch.equal(v, flat2[k]), k

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    # inputs without top-k ties in the indexer (the reference breaks them arbitrarily)
    test_ids = next(t for t in (torch.randint(0, cfg.vocab_size, (2, 40), generator=g) for _ in range(50))
                    if boundary_ties(params, cfg, t) == 0)
    with torch.no_grad():
        assert (model(test_ids).logits - glm5f.forward(params, cfg, test_ids)).abs().max() <= 1e-5


def test_config_with_mtp_but_no_tensors_loads_without_them(hf_checkpoint):
    _, path = hf_checkpoint(CFG)  # Transformers' own save drops the MTP layer
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1 but the weights hold no model.layers.3"):
        cfg, params = glm5f.load_hf(path)
    assert cfg.num_nextn_predict_layers == 0 and len(params["model"]["layers"]) == 3


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.integers(0, 2**16), st.integers(1, 10), st.integers(0, 8), st.integers(1, 2), st.integers(1, 2))
def test_speculative_decoding_is_greedy_decoding(seed, prompt_len, new, batch, depths):
    cfg = dataclasses.replace(CFG, num_nextn_predict_layers=depths)
    params = glm5f.init_params(cfg, seed=seed % 97)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    stats = {}
    out = glm5f.generate(params, cfg, prompt, new, draft="mtp", stats=stats)
    assert torch.equal(out, glm5f.generate(params, cfg, prompt, new))
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["accepted"] <= stats["proposed"]
    assert stats["proposed"] <= batch * depths * max(new - 1, 0)


@pytest.mark.parametrize("wrong_every", [0, 2, 3], ids=["all-right", "every-2nd-wrong", "every-3rd-wrong"])
def test_accepted_drafts_are_kept_and_rejected_ones_dropped(monkeypatch, wrong_every):
    """A draft that knows the greedy answer (but for every `wrong_every`-th proposal, one token off): the output
    stays greedy, and the acceptance rate counts exactly the drafts that were right up to the first wrong one."""
    cfg = dataclasses.replace(CFG, num_nextn_predict_layers=3)
    params = glm5f.init_params(cfg, seed=11)
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    n = 25
    greedy = glm5f.generate(params, cfg, prompt, n)
    calls, expected = [0], [0, 0]

    def oracle(params_, cfg_, tokens, hidden, positions, valid, k):
        M = tokens.shape[1]
        assert hidden.shape[1] == positions.shape[1] == M - 1 and torch.equal(tokens, greedy[:, :M])
        out = greedy[:, M:M + k].clone()
        calls[0] += 1
        a = k
        if wrong_every and calls[0] % wrong_every == 0 and k:
            j = calls[0] % k
            out[1, j] = (out[1, j] + 1) % cfg.vocab_size  # only row 1 is off: both rows keep j drafts
            a = j
        expected[0] += 2 * k
        expected[1] += 2 * a
        return out

    monkeypatch.setattr(decode, "mtp_propose", oracle)
    stats = {}
    assert torch.equal(glm5f.generate(params, cfg, prompt, n, draft="mtp", stats=stats), greedy)
    assert (stats["proposed"], stats["accepted"]) == tuple(expected)
    if not wrong_every:
        assert stats["acceptance_rate"] == 1.0 and calls[0] <= math.ceil(n / 4) + 1
    else:
        assert 0 < stats["acceptance_rate"] < 1


def test_speculative_decoding_with_padding_and_eos():
    cfg = CFG
    params = glm5f.init_params(cfg, seed=5)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :7] = 0
    free = glm5f.generate(params, cfg, batch, 10, attention_mask=mask)
    assert torch.equal(glm5f.generate(params, cfg, batch, 10, attention_mask=mask, draft="mtp"), free)
    eos = int(free[0, 14])
    assert torch.equal(glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=eos, draft="mtp"),
                       glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=eos))
    with pytest.raises(ValueError, match="needs MTP layers"):
        glm5f.generate(glm5f.init_params(glm5f.preset("glm5-tiny")), glm5f.preset("glm5-tiny"), batch, 3,
                       draft="mtp")
    with pytest.raises(ValueError, match="greedy"):
        glm5f.generate(params, cfg, batch, 3, draft="mtp", temperature=1.0)


def test_train_cli_writes_mtp_loss(tmp_path):
    assert main(["--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "3", "--eval.every", "0",
                 "--model.num_nextn_predict_layers", "1", "--checkpoint.dir", str(tmp_path / "a")]) == 0
    history = read_metrics(str(tmp_path / "a"))
    assert len(history) == 3 and all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in history)


def test_mtp_weight_scales_the_gradient_the_main_model_gets():
    """Weight 0: the main leaves' gradients are bit for bit those of the model without an MTP layer; weight w:
    they move by w times the MTP loss's gradient (checked against two weights)."""
    base = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(CFG, seed=1)
    main_params = glm5f.init_params(base, seed=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(24).expand(2, 24)}
    layout, run = Layout(torch.device("cpu")), Config()
    grads = {}
    for w in (0.0, 0.5, 1.0):
        run.train.mtp_loss_weight = w
        metrics, grads[w], _ = step_grads(params, batch, CFG, layout, Step.of(run.train, CFG))
    _, plain, _ = step_grads(main_params, batch, base, layout, Step.of(run.train, base))
    for k, g in plain.items():
        assert torch.equal(grads[0.0][k], g), k
    k = "model.layers.2.self_attn.o_proj.weight"
    mtp_part = grads[1.0][k] - grads[0.0][k]
    assert mtp_part.abs().max() > 0
    assert rel_err(grads[0.5][k] - grads[0.0][k], 0.5 * mtp_part) <= 1e-4


def test_context_and_expert_parallel_mtp_equals_one_process(tmp_path):
    """cp2 x ep2 on packed text: the MTP inputs and targets are shifted on whole sequences before the CP split,
    so the MTP loss, every gradient and the MTP layer's expert counts are the one-process ones."""
    import dist_checks
    from glm5f.distributed import spawn

    argv = ["--model.preset", "glm5-tiny", "--model.num_nextn_predict_layers", "1", "--data.type", "text",
            "--data.batch_size", "2", "--data.seq_len", "64", "--train.steps", "1"]
    ref = dist_checks.first_step_grads(argv, None)
    spawn(dist_checks.first_step_grads, 2, argv + ["--parallel.cp", "2", "--parallel.ep", "2"], str(tmp_path / "g.pt"))
    got = torch.load(tmp_path / "g.pt", weights_only=True)
    assert abs(got["metrics"]["mtp_loss"] - ref["metrics"]["mtp_loss"]) <= 1e-6
    assert abs(got["loss"] - ref["loss"]) <= 1e-6
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in ref["counts"]
    for k, c in ref["counts"].items():
        assert torch.equal(got["counts"][k], c), k
    for k, g in ref["grads"].items():
        assert rel_err(got["grads"][k], g) <= 1e-5, f"{k}: relative gradient error {rel_err(got['grads'][k], g):.2e}"
