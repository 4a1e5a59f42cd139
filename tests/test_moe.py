"""The sequence-wise auxiliary balance loss of the MoE layers against a naive fp64 reading of its formula, in one
layer, in the train step (with padding and micro-batches) and under context parallelism."""

import dataclasses

import torch
import tyro
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checks
import glm5f
import glm5f.model as model_mod
from configs import Config, validate
from glm5f.distributed import spawn
from conftest import env_of
from glm5f.env import Objectives
from glm5f.loss import Step, cross_entropy_sum, step_grads, with_targets
from glm5f.model import apply
from glm5f.moe import moe
from glm5f.optim import value_and_grad
from glm5f.parallel import Layout

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


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
            assert rel(a, b) <= 1e-6, f"{name}: relative gradient error {rel(a, b):.2e}"


def padded_batch(cfg: glm5f.GLM5Config, B: int = 4, S: int = 16, seed: int = 0) -> dict:
    """Random tokens, rows right-padded to different lengths (attention_mask 0, labels -100), the last wholly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor([S, S - 5, 3, 0])[:B, None]).long()
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, glm5f.IGNORE_INDEX),
            "position_ids": torch.arange(S).expand(B, S), "attention_mask": mask}


def cli(*args: str) -> Config:
    return tyro.cli(Config, args=["--model.preset", "glm5-tiny", *args], use_underscores=True)


def run_step(params: dict, batch: dict, run: Config, model_cfg: glm5f.GLM5Config):
    """`step_grads` of one process for the run `run` describes."""
    return step_grads(params, batch, model_cfg, Layout(torch.device("cpu")), Step.of(run.train, model_cfg))


def test_train_step_objective_matches_the_formula(monkeypatch):
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

    def spy(p, x, *args, **kwargs):
        seen.append((p["gate"], x))
        return real(p, x, *args, **kwargs)

    real = model_mod.moe
    monkeypatch.setattr(model_mod, "moe", spy)
    full = with_targets(batch)
    n_seq = int((full["valid"].sum(1) > 0).sum())

    def objective(params):
        seen.clear()
        ctx = env_of(model_cfg, full["input_ids"].shape, full["attention_mask"], full["position_ids"], torch.float64)
        logits, _ = apply(params, model_cfg, full["input_ids"], ctx)
        ce, n = cross_entropy_sum(logits, full["targets"])
        aux = sum(naive_seq_aux(gate, x, full["valid"], model_cfg) for gate, x in seen) / n_seq
        return ce / n + coeff * aux, aux

    (_, aux), want = value_and_grad(objective, has_aux=True)(params)
    assert len(seen) == sum(model_cfg.is_moe(i) for i in range(model_cfg.num_hidden_layers)) >= 2
    assert abs(metrics["seq_aux_loss"] - float(aux)) <= 1e-6 * float(aux)
    assert grads.keys() == want.keys()
    for k, g in want.items():
        assert rel(grads[k], g) <= 1e-6, f"{k}: relative gradient error {rel(grads[k], g):.2e}"
    gate = "model.layers.1.mlp.gate.weight"
    _, no_aux, _ = run_step(params, batch, cli("--train.dtype", "float64", "--train.grad_accum", "2"), model_cfg)
    assert rel(grads[gate], no_aux[gate]) > 1e-3  # the loss does move the router


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


def test_context_parallel_equals_one_process(tmp_path):
    """--parallel.cp 2: each sequence's tokens are split over two ranks, whose expert loads and token counts are
    summed before f is formed; the metric and every gradient equal the one-process run's (rel 1e-6)."""
    argv = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len",
            "32", "--train.dtype", "float64", "--train.steps", "1", "--train.seq_aux_loss_coeff", "0.3"]
    ref = dist_checks.first_step_grads(argv, None)
    spawn(dist_checks.first_step_grads, 2, argv + ["--parallel.cp", "2"], str(tmp_path / "g.pt"))
    got = torch.load(tmp_path / "g.pt", weights_only=True)
    assert abs(got["metrics"]["seq_aux_loss"] - ref["metrics"]["seq_aux_loss"]) <= 1e-6 * ref["metrics"][
        "seq_aux_loss"]
    assert got["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        assert rel(got["grads"][k], g) <= 1e-6, f"{k}: relative gradient error {rel(got['grads'][k], g):.2e}"
