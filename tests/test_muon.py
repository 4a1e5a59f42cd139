"""glm5f/train/optim.py's Muon and the optimizer interface: Muon against torch.optim.Muon (its Newton-Schulz run in
fp64), experts orthogonalised in one batch against one at a time, Muon Split against each block apart, and a toy
optimizer added through the one table."""

import json

import pytest
import torch
import torch.optim._muon as torch_muon

import dist_checks
import glm5f
from configs import OptimConfig
from conftest import cli
from glm5f.ckpt import checkpoint
from glm5f.run.metrics import read_metrics
from glm5f.train.optim import (OPTIMIZERS, Optimizer, adamw, leaf_rule, make_optimizer, muon, muon_blocks,
                               newton_schulz, orthogonalised, trained_paths, unused_flags)
from glm5f.core.params import flatten
from train import main, train

TINY = glm5f.preset("glm5-tiny")  # 4 heads; q_b_proj rows 4 x (16 + 8), kv_b_proj 4 x (16 + 16), kv_a 32 + 8
RUN = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
       "--optim.warmup_steps", "1", "--eval.every", "0"]


@pytest.fixture
def torch_ns_fp64(monkeypatch):
    """torch.optim.Muon's own Newton-Schulz (`_zeropower_via_newtonschulz`) in the input's dtype: its cast to
    bfloat16 is made a copy, the rest of its code runs as written. Returns that function."""
    real = torch_muon._zeropower_via_newtonschulz

    def in_fp64(grad, coefficients, steps, eps):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())
            return real(grad, coefficients, steps, eps)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", in_fp64)
    return lambda g: in_fp64(g, torch_muon.DEFAULT_A_B_C if hasattr(torch_muon, "DEFAULT_A_B_C") else
                             (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C),
                             torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS)


def tree_of(path: str, t: torch.Tensor) -> dict:
    """A params tree holding the one leaf at dotted `path`."""
    tree = out = {}
    *heads, last = path.split(".")
    for k in heads:
        tree[k] = {}
        tree = tree[k]
    tree[last] = t
    return out


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
def test_muon_equals_torch_optim_muon_over_ten_steps(shape, torch_ns_fp64):
    """One 2-D leaf (a dense MLP's down_proj), fp64, 10 steps of changing gradients and learning rates: the params
    equal torch.optim.Muon's (match_rms_adamw, Nesterov, decoupled weight decay) within 1e-10; the momentum we keep
    is the running sum, torch's the running average: (1 - momentum) times ours."""
    path = "model.layers.0.mlp.down_proj.weight"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * 0.02
    ref = w.clone().requires_grad_()
    opt = torch.optim.Muon([ref], lr=1.0, weight_decay=0.1, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    ours = muon(OptimConfig(name="muon", weight_decay=0.1), TINY)
    params = tree_of(path, w.clone())
    state = ours.init(params, [path])
    assert list(state["momentum"]) == [path] and not state["mu"]
    for step in range(10):
        lr = 0.02 * (1 - step / 20)
        grad = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (step % 3 - 1)
        ref.grad = grad.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        params, state = ours.update(params, {path: grad}, state, lr)
        got = flatten(params)[path]
        assert (got - ref.detach()).abs().max() <= 1e-10, f"step {step + 1}"
    buf = opt.state[ref]["momentum_buffer"]
    assert torch.allclose(buf, (1 - 0.95) * state["momentum"][path], rtol=1e-12, atol=0)
    assert (flatten(params)[path] - w).abs().max() > 1e-3  # it moved


def test_experts_are_orthogonalised_each_alone_in_one_batch(torch_ns_fp64):
    """Routed experts [E, out, in]: the batched update equals torch's Newton-Schulz on each expert alone, scaled by
    0.2 sqrt(max(out, in)); one iteration over all of them, not one over the stacked [E * out, in] matrix."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(8, 32, 64, generator=g, dtype=torch.float64)
    path = "model.layers.1.mlp.experts.gate_proj.weight"
    got = orthogonalised(u, path, TINY)
    for e in range(8):
        want = torch_ns_fp64(u[e]) * 0.2 * 64 ** 0.5
        assert torch.allclose(got[e], want, rtol=0, atol=1e-12), e
    whole = torch_ns_fp64(u.reshape(-1, 64)).reshape(8, 32, 64) * 0.2 * 256 ** 0.5
    assert (got - whole).abs().max() > 0.1


def split_reference(u: torch.Tensor, blocks: list[tuple[int, int]], ns) -> torch.Tensor:
    """Each row block [start, stop) of `u` orthogonalised alone by `ns`, scaled by 0.2 sqrt(max(its shape))."""
    out = torch.empty_like(u)
    for start, stop in blocks:
        out[start:stop] = ns(u[start:stop]) * 0.2 * max(stop - start, u.shape[1]) ** 0.5
    assert sum(stop - start for start, stop in blocks) == u.shape[0]
    return out


def per_head(heads: int, parts: list[int]) -> list[tuple[int, int]]:
    """The row blocks of `heads` heads of `parts` rows each, in order (written out, not from the leaf table)."""
    out, start = [], 0
    for _ in range(heads):
        for n in parts:
            out.append((start, start + n))
            start += n
    return out


SPLITS = {  # leaf -> granularity -> its row blocks, for glm5-tiny (H 4, nope 16, rope 8, v 16, kv_lora 32)
    "q_b_proj": {"per_part": per_head(4, [16, 8]), "per_head": per_head(4, [24]), "none": [(0, 96)]},
    "kv_b_proj": {"per_part": per_head(4, [16, 16]), "per_head": per_head(4, [32]), "none": [(0, 128)]},
    "kv_a_proj_with_mqa": {"per_part": [(0, 32), (32, 40)], "per_head": [(0, 40)], "none": [(0, 40)]},
    "q_a_proj": {"per_part": [(0, 32)], "per_head": [(0, 32)], "none": [(0, 32)]},
    "o_proj": {"per_part": [(0, 64)], "per_head": [(0, 64)], "none": [(0, 64)]},
}


@pytest.mark.parametrize("split", ["per_part", "per_head", "none"])
@pytest.mark.parametrize("leaf", list(SPLITS))
def test_muon_split_equals_each_block_alone(leaf, split, torch_ns_fp64):
    """Muon Split: each head's block (per_part: each head's no-RoPE and RoPE rows of q_b_proj, key and value rows
    of kv_b_proj; the latent and RoPE-key rows of kv_a_proj_with_mqa) orthogonalised alone by torch's
    Newton-Schulz and scaled by its own shape; q_a_proj and o_proj whole."""
    path = f"model.layers.0.self_attn.{leaf}.weight"
    shape = tuple(flatten(glm5f.abstract_params(TINY))[path].shape)
    u = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = split_reference(u, SPLITS[leaf][split], torch_ns_fp64)
    assert torch.allclose(orthogonalised(u, path, TINY, split), want, rtol=0, atol=1e-12)


def test_the_optimizer_splits_by_default_and_dropping_the_split_shows(torch_ns_fp64):
    """Through the optimizer (--optim defaults: per_part): one step on q_b_proj moves it by -lr x the per-part
    reference; the same step unsplit differs by far more than rounding, so a dropped split fails the check."""
    path = "model.layers.0.self_attn.q_b_proj.weight"
    g = torch.Generator().manual_seed(3)
    w, grad = (torch.randn(96, 32, generator=g, dtype=torch.float64) for _ in range(2))
    lr, m = 0.01, 0.95
    ours = make_optimizer(OptimConfig(name="muon", weight_decay=0.0), TINY)
    params = tree_of(path, w.clone())
    params, _ = ours.update(params, {path: grad}, ours.init(params, [path]), lr)
    nesterov = grad + m * grad  # the first step's look-ahead: momentum m * 0 + g, then g + m * that
    split = w - lr * split_reference(nesterov, SPLITS["q_b_proj"]["per_part"], torch_ns_fp64)
    whole = w - lr * split_reference(nesterov, SPLITS["q_b_proj"]["none"], torch_ns_fp64)
    got = flatten(params)[path]
    assert (got - split).abs().max() <= 1e-12
    assert (got - whole).abs().max() > 100 * 1e-12 and (split - whole).abs().max() > 1e-3


QUINTIC = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's and Moonlight's Newton-Schulz coefficients (a, b, c)


def quintic(s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The Newton-Schulz iteration on one singular value: s <- a s + b s^3 + c s^5, `steps` times."""
    a, b, c = QUINTIC
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


@pytest.mark.parametrize("shape", [(3, 16, 48), (2, 40, 12)])
def test_newton_schulz_is_the_quintic_on_each_singular_value(shape):
    """X = U S V^T, well conditioned (singular values in [1, 3]): newton_schulz(X) is U q(S / |X|_F) V^T in fp64,
    q the scalar quintic iterated 5 times, wide and tall, each matrix of the batch apart. So its distance to the
    orthogonal factor U V^T is the band q leaves: computed here by iterating q over every value S / |X|_F can take
    for these X (the quintic does not converge to 1; it oscillates inside that band)."""
    assert tuple(glm5f.train.optim.NS_COEFFICIENTS) == QUINTIC and glm5f.train.optim.NS_STEPS == 5
    n, rows, cols = shape
    g = torch.Generator().manual_seed(4)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(n, rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, cols, k, generator=g, dtype=torch.float64))
    s = 1 + 2 * torch.rand(n, k, generator=g, dtype=torch.float64)
    x = u @ torch.diag_embed(s) @ v.mT
    got = newton_schulz(x)
    s_unit = s / s.norm(dim=-1, keepdim=True)  # |X|_F is the norm of the singular values
    assert (got - u @ torch.diag_embed(quintic(s_unit)) @ v.mT).abs().max() <= 1e-12
    # the band: s / |X|_F for singular values in [1, 3] lies in [1 / (3 sqrt(k)), 3 / sqrt(k)]
    grid = torch.linspace(1 / (3 * k ** 0.5), 3 / k ** 0.5, 100_001, dtype=torch.float64)
    lo, hi = quintic(grid).min().item(), quintic(grid).max().item()
    assert 0.6 < lo < 0.75 and 1.05 < hi < 1.2  # the published quintic's known band, roughly 0.68-1.13
    out = torch.linalg.svdvals(got)
    assert out.min() >= lo - 1e-12 and out.max() <= hi + 1e-12
    error = torch.linalg.matrix_norm(got - u @ v.mT, ord=2)  # spectral distance to the orthogonal factor
    assert error.max() <= max(1 - lo, hi - 1) + 1e-12


def test_which_leaves_muon_takes():
    """Muon takes the hidden matrices: attention's projections, the dense and shared MLPs, the routed experts, the
    MTP layer's eh_proj; AdamW the embedding, head, norms, biases, router and (when trained) the indexer; checked
    against the list written out here."""
    cfg = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)
    opt = make_optimizer(OptimConfig(name="muon"), cfg)
    muon_names = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                  "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "eh_proj.weight")
    seen = set()
    for path, t in flatten(glm5f.abstract_params(cfg)).items():
        rule = opt.rule(path, t.ndim, indexer=True)
        if path.endswith("e_score_correction_bias"):
            want = "balance"
        elif ".indexer." not in path and path.endswith(muon_names):
            want = "muon"
        else:
            want = "decay" if t.ndim >= 2 else "no_decay"
        assert rule == want, path
        seen.add(rule)
        assert leaf_rule(path, t.ndim, indexer=True) == ("decay" if want == "muon" else want)  # AdamW's rules
    assert seen == {"muon", "decay", "no_decay", "balance"}


def sign_descent(o, model_cfg) -> Optimizer:
    """A toy optimizer: p <- p - lr * sign(g) on every trained leaf, a step count its only state."""
    def update(params, grads, state, lr):
        flat = flatten(params)
        for path, g in grads.items():
            flat[path].sub_(lr * torch.sign(g))
        return params, {"count": state["count"] + 1}

    return Optimizer("sign", init=lambda params, paths: {"count": torch.zeros((), dtype=torch.int64)},
                     update=update, state_bytes=lambda rule, n, itemsize: 0, update_bytes=lambda leaves, i: 0,
                     meta={"name": "sign"})


def test_a_new_optimizer_is_one_entry_in_the_table(tmp_path, monkeypatch, capsys):
    """A toy optimizer registered in optim.OPTIMIZERS (nothing else changed) trains through train.py, checkpoints
    its state, resumes it, and the memory plan counts its (empty) state."""
    monkeypatch.setitem(OPTIMIZERS, "sign", sign_descent)
    run = RUN + ["--optim.name", "sign", "--optim.clip_norm", "0", "--checkpoint.dir", str(tmp_path)]
    assert main(run + ["--train.steps", "2"]) == 0
    meta = json.loads(next((tmp_path / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["optimizer"] == {"name": "sign"}
    assert main(run + ["--train.steps", "3", "--checkpoint.resume", "latest"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert main(RUN + ["--optim.name", "sign", "--plan", "json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["optimizer_bytes"] == 0
    assert main(RUN + ["--optim.name", "adamw", "--plan", "json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["optimizer_bytes"] == 2 * plan["grads_bytes"]


def test_adamw_through_the_interface_is_torch_adamw():
    """--optim.name adamw through the interface (init, then update) with --optim's b1, b2, eps and weight decay: the
    params and both moments after 3 steps equal torch.optim.AdamW's on the same leaves and gradients in fp64, a
    matrix with decay and a norm weight without; and Muon Split's blocks of q_b_proj are per head, no-RoPE and RoPE."""
    o = OptimConfig(b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.2)
    params = torch.utils._pytree.tree_map(lambda t: t.double(), glm5f.init_params(TINY))
    decayed, plain = "model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.input_layernorm.weight"
    opt = adamw(o, TINY)
    assert opt.rule(decayed, 2) == "decay" and opt.rule(plain, 1) == "no_decay"
    state = opt.init(params, [decayed, plain])
    assert set(state["mu"]) == set(state["nu"]) == {decayed, plain}
    flat = flatten(params)
    ref = {p: flat[p].detach().clone().requires_grad_() for p in (decayed, plain)}
    torch_opt = torch.optim.AdamW([{"params": [ref[decayed]], "weight_decay": o.weight_decay},
                                   {"params": [ref[plain]], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(o.b1, o.b2), eps=o.eps)
    g = torch.Generator().manual_seed(0)
    for lr in (1e-2, 5e-3, 2e-3):
        grads = {p: torch.randn(flat[p].shape, generator=g, dtype=torch.float64) for p in (decayed, plain)}
        params, state = opt.update(params, grads, state, lr)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for p in ref:
            ref[p].grad = grads[p]
        torch_opt.step()
    flat = flatten(params)
    for p in (decayed, plain):
        assert (flat[p] - ref[p].detach()).abs().max() <= 1e-14
        assert (state["mu"][p] - torch_opt.state[ref[p]]["exp_avg"]).abs().max() <= 1e-15
        assert (state["nu"][p] - torch_opt.state[ref[p]]["exp_avg_sq"]).abs().max() <= 1e-15
    assert int(state["count"]) == 3
    assert muon_blocks(decayed, (96, 32), TINY, "per_part") == (4, [16, 8])


def test_bitwise_resume_with_muon(tmp_path, capsys):
    """A Muon run resumed from its step-3 checkpoint continues bit for bit as the run that never stopped (losses,
    gradient norms, the final params and momentum), the MoE preset with its routed experts; the checkpoint says
    its momentum is a running sum, and AdamW refuses to continue from it."""
    args = ["--model.preset", "glm5-scaled-moe", "--model.num_hidden_layers", "2", "--data.type", "synthetic",
            "--data.batch_size", "2", "--data.seq_len", "32", "--optim.name", "muon", "--optim.warmup_steps", "1",
            "--optim.schedule_steps", "6", "--eval.every", "0", "--checkpoint.every", "3"]
    straight = train(cli(*args, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "straight")))
    train(cli(*args, "--train.steps", "3", "--checkpoint.dir", str(tmp_path / "resumed")))
    train(cli(*args, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "resumed"), "--checkpoint.resume",
              "latest"))
    resumed = read_metrics(tmp_path / "resumed")
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in straight]
    cfg = cli(*args).model.build()
    opt = make_optimizer(OptimConfig(name="muon"), cfg)
    states = []
    for run in ("straight", "resumed"):
        params = glm5f.init_params(cfg)
        state = {"params": params, "optim": opt.init(params, list(trained_paths(params)))}
        checkpoint.load(checkpoint.latest(str(tmp_path / run)), state)
        states.append(flatten(state))
    assert states[0].keys() == states[1].keys()
    assert any(".experts." in k for k in states[0] if k.startswith("optim.momentum"))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    meta = checkpoint.read_meta(checkpoint.latest(str(tmp_path / "resumed")))
    assert meta["optimizer"]["momentum"] == "sum"
    assert main([*args, "--train.steps", "8", "--optim.name", "adamw", "--checkpoint.dir", str(tmp_path / "resumed"),
                 "--checkpoint.resume", "latest"]) == 1
    assert "holds the state of --optim.name muon" in capsys.readouterr().err


def test_layouts_with_muon_equal_one_process_in_float64(tmp_path):
    """Under FSDP each Muon leaf is orthogonalised whole (its shards gathered; routed experts over the EP group's
    other ranks only, each EP rank keeping its experts): in fp64, dp2, ep2, cp2 and cp2 x ep2 give the one-process
    losses within 1e-9 step after step."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "4", "--layouts", "dp2", "ep2", "cp2", "cp2-ep2", "--out", str(tmp_path),
                  "--tolerance", "1e-9", "--extra", "--model.preset", "glm5-tiny", "--data.seq_len", "64",
                  "--train.dtype", "float64", "--optim.name", "muon", "--optim.warmup_steps", "1"]) == 0


MUON_TINY = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj", "shared_experts.gate_proj",
             "shared_experts.up_proj", "shared_experts.down_proj"}  # glm5-tiny's Muon leaves (3 layers, 8 experts)
HEADS_WHOLE = {"q_b_proj", "kv_b_proj"}  # Muon Split per head: whole heads on a rank when 4 heads split evenly
EXPERTS = {"experts.gate_proj", "experts.up_proj", "experts.down_proj"}


@pytest.mark.parametrize("world, ep, split, exchanged", [
    (2, 1, "per_part", MUON_TINY - HEADS_WHOLE),  # 2 heads a rank; experts' rows split over the 2 (edp 2)
    (2, 1, "none", MUON_TINY),  # q_b_proj / kv_b_proj whole matrices: 2 heads a rank are half of one
    (2, 2, "per_part", MUON_TINY - HEADS_WHOLE - EXPERTS),  # each EP rank holds its 4 experts whole (edp 1)
    (3, 1, "per_part", MUON_TINY),  # 96 and 128 rows over 3 ranks: no rank holds whole heads
    (4, 2, "per_part", MUON_TINY - HEADS_WHOLE),  # a head a rank; experts over the 2 ranks of each edp group
], ids=["dp2", "dp2-unsplit", "ep2", "dp3", "dp4-ep2"])
def test_each_block_is_orthogonalised_on_one_rank(world, ep, split, exchanged, tmp_path):
    """Under FSDP / EP each Muon matrix (Muon Split block) is orthogonalised on exactly one rank: over all ranks
    Newton-Schulz takes as many blocks as in one process, and the params and momentum equal one process's in fp64
    (two steps). Whole heads and EP experts are orthogonalised where they lie, with no communication: all-to-all
    moves exactly the leaves written out here, each element once to its owner and once back. And matrices cut
    unevenly, some ranks' pieces empty (2 rows over 3 or 4 ranks), come back as one process computes them."""
    from glm5f.run.launch import spawn

    spawn(dist_checks.muon_once_check, world, world, ep, split, str(tmp_path / "out.json"))
    ranks = json.loads((tmp_path / "out.json").read_text())
    shapes = flatten(glm5f.abstract_params(TINY))
    moved = sum(t.numel() for p, t in shapes.items() if p.endswith(".weight") and
                any(p.endswith(f".{name}.weight") for name in exchanged))
    assert all(r["diff"] <= 1e-12 and r["moved"] > 1e-4 and r["uneven"] <= 1e-12 for r in ranks), ranks
    assert sum(r["blocks"] for r in ranks) == ranks[0]["one_process_blocks"], ranks
    assert all(0 < r["blocks"] < ranks[0]["one_process_blocks"] for r in ranks), ranks
    assert sum(r["sent"] for r in ranks) == 2 * 2 * moved, (ranks, moved)  # two steps, there and back


@pytest.mark.parametrize("world, heads, rows, block, dim, cut", [
    (2, 4, 96, 24, 0, None),  # two whole heads a rank
    (3, 4, 96, 24, 0, (-2, (32, 32, 32))),  # 32 rows a rank: a head and a third
    (4, 4, 128, 32, 1, (-1, (8, 8, 8, 8))),  # columns split: no matrix whole
    (2, 1, 40, 40, 0, (-2, (20, 20))),  # one block (kv_a_proj_with_mqa, q_a_proj, ...) cut in two
    (5, 4, 96, 24, 0, (-2, (20, 20, 20, 20, 16))),  # uneven: the last piece short
    (1, 4, 96, 24, 0, None),  # one rank
])
def test_muon_cut(world, heads, rows, block, dim, cut):
    """Which Muon leaves each rank orthogonalises itself (None) and how the others are cut, DTensor's pieces."""
    from glm5f.train.optim import Cut, muon_cut
    assert muon_cut((rows, 32), block, dim, world) == (None if cut is None else Cut(*cut))
    assert muon_cut((8, rows, 32), block, 0, world) is None  # routed experts split along the expert dim (EP)


def test_muon_in_a_lora_run_says_the_factors_train_with_adamw_and_records_it(tmp_path, capsys):
    run = RUN + ["--lora.rank", "4", "--checkpoint.dir", str(tmp_path)]
    assert main(run + ["--optim.name", "muon", "--train.steps", "2"]) == 0
    assert ("warning: --optim.name muon does not apply to a LoRA run: Muon takes the hidden matrices, which LoRA "
            "freezes, so the adapter factors train with AdamW (its checkpoints record adamw); drop --optim.name "
            "muon") in capsys.readouterr().err
    meta = json.loads((tmp_path / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["optimizer"] == {"name": "adamw"} and meta["run"]["optim"]["name"] == "muon"
    assert main(run + ["--train.steps", "3", "--checkpoint.resume", "latest"]) == 0  # as AdamW, which it was
    out, err = capsys.readouterr()
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert "warning: --optim" not in err
    assert make_optimizer(OptimConfig(name="muon"), TINY, lora=True).meta == {"name": "adamw"}


def test_muon_flags_given_under_adamw_warn():
    given = OptimConfig(ns_steps=3, ns_coefficients=(1.0, -1.0, 0.5), muon_split="none", muon_momentum=0.95)
    assert unused_flags(given) == [
        "--optim.ns_steps 3 is not used: it is Muon's, and --optim.name adamw does not use it; drop it or pass "
        "--optim.name muon",
        "--optim.ns_coefficients (1.0, -1.0, 0.5) is not used: it is Muon's, and --optim.name adamw does not use it; "
        "drop it or pass --optim.name muon",
        "--optim.muon_split none is not used: it is Muon's, and --optim.name adamw does not use it; drop it or pass "
        "--optim.name muon"]
    assert unused_flags(OptimConfig(ns_coefficients=[3.4445, -4.7750, 2.0315])) == []  # a recipe's list, default
    assert unused_flags(OptimConfig(name="muon", ns_steps=3)) == []
    assert unused_flags(OptimConfig(muon_nesterov=False), lora=True) == [
        "--optim.muon_nesterov False is not used: it is Muon's, and a LoRA run trains with AdamW; drop it"]
