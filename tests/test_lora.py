"""LoRA (glm5f/model/lora.py and where adapters are used): the adapted layers against naive fp64 products and the merged
weights, zero change at initialisation, adapter-only training with a bit-identical base, bitwise resume, the
parallel layouts against one process, checkpoints (base fingerprint) and the merged export."""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

import glm5f
from glm5f.run import finish
from glm5f.ckpt import checkpoint
from glm5f.model import lora
from glm5f.ckpt.checkpoint import fingerprint
from glm5f.train.loss import Step, step_grads
from glm5f.run.metrics import read_metrics
from glm5f.model.moe import expert_linear
from glm5f.core.ops import linear
from glm5f.parallel.layout import Layout, placements
from glm5f.core.params import leaf_kind
from train import main

# every kind of adapted weight: the attention projections, the dense MLP, the shared and the routed experts
ALL_TARGETS = r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$|mlp\."
RUN = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--optim.warmup_steps", "1",
       "--eval.every", "0", "--train.log_every", "1"]


def random_adapters(params: dict, spec: lora.LoraSpec, std: float = 0.05, dtype=torch.float32) -> dict:
    """Adapters with both factors random (a trained adapter's shape of things), so B @ A is not zero."""
    g = torch.Generator().manual_seed(7)
    return {p: (torch.randn(t.shape, generator=g, dtype=torch.float64) * std).to(dtype)
            for p, t in lora.init_adapters(params, spec).items()}


# ---- the adapted layers ------------------------------------------------------------------------------------------

def test_linear_adds_the_scaled_low_rank_product_with_dropout_on_its_input():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(6, 10), (3, 10), (6, 3)])
    x = torch.randn(4, 5, 10, generator=g, dtype=torch.float64)
    spec = lora.LoraSpec(3, alpha=6.0, dropout=0.25)
    torch.manual_seed(11)
    got = linear({"weight": w, "lora_A": a, "lora_B": b, "lora": spec}, x)
    torch.manual_seed(11)
    keep = F.dropout(torch.ones_like(x), 0.25)  # the same draw: the mask dropout applied, scaled by 1 / (1 - p)
    want = x @ w.T + 2.0 * ((x * keep) @ a.T) @ b.T
    assert (keep == 0).any() and torch.allclose(got, want, rtol=0, atol=1e-12)
    no_dropout = linear({"weight": w, "lora_A": a, "lora_B": b, "lora": dataclasses.replace(spec, dropout=0.0)}, x)
    assert torch.allclose(no_dropout, x @ (w + 2.0 * b @ a).T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype, rank", [(torch.float64, 3), (torch.float32, 4)])
def test_expert_adapters_go_through_the_grouped_gemm_per_expert(dtype, rank):
    """[E, r, in] / [E, out, r] factors: row block e gets x W_e^T + scale (x A_e^T) B_e^T (fp32 rank 4: torch's
    grouped GEMM, fp64: the batched fallback), against a loop over experts in fp64."""
    g = torch.Generator().manual_seed(1)
    E, I, O = 4, 16, 8
    w, a, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(E, O, I), (E, rank, I), (E, O, rank)])
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), I, generator=g, dtype=torch.float64)
    spec = lora.LoraSpec(rank, alpha=2.0 * rank)
    got = expert_linear({"weight": w.to(dtype), "lora_A": a.to(dtype), "lora_B": b.to(dtype), "lora": spec},
                        x.to(dtype), counts)
    rows = torch.repeat_interleave(torch.arange(E), counts)
    want = torch.stack([x[m] @ w[e].T + 2.0 * (x[m] @ a[e].T) @ b[e].T for m, e in enumerate(rows.tolist())])
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-4)


def test_unmerged_forward_equals_the_merged_weights():
    """Adapters on every kind of weight (kv_b_proj merged where MLA reads it, the others unmerged): the logits of
    the base with its weights W + scale * B @ A, in fp64."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    spec = lora.LoraSpec(4, alpha=8.0, targets=ALL_TARGETS)
    adapters = random_adapters(params, spec, dtype=torch.float64)
    assert any(".experts." in p for p in adapters) and any("shared_experts" in p for p in adapters)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    got = glm5f.forward(lora.attach(params, adapters), cfg, ids, lora=spec)
    want = glm5f.forward(lora.merge(params, adapters, spec), cfg, ids)
    assert (got - glm5f.forward(params, cfg, ids)).abs().max() > 0.1  # the adapters do change the logits
    assert torch.allclose(got, want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="no LoraSpec"):
        glm5f.forward(lora.attach(params, adapters), cfg, ids)


def test_a_fresh_adapter_changes_nothing():
    """B = 0: the step's loss and the logits are the base model's, bit for bit (all adapter kinds on)."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0)
    spec = lora.LoraSpec(8, targets=ALL_TARGETS)
    adapters = lora.init_adapters(params, spec, seed=0)
    assert all(t.abs().sum() > 0 for p, t in adapters.items() if p.endswith("lora_A"))
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(glm5f.forward(lora.attach(params, adapters), cfg, ids, lora=spec),
                       glm5f.forward(params, cfg, ids))
    batch = {"input_ids": ids, "labels": ids}
    base, _, _ = step_grads(params, batch, cfg, Layout(), Step())
    adapted, grads, _ = step_grads(lora.attach(params, adapters), batch, cfg, Layout(), Step(lora=spec))
    assert adapted["loss"] == base["loss"]
    assert sorted(grads) == sorted(adapters)  # only the adapters get gradients
    assert all(grads[p].abs().sum() > 0 for p in adapters if p.endswith("lora_B"))  # and B's are not zero


def test_adapter_leaves_shard_as_their_weights():
    assert leaf_kind("model.layers.0.self_attn.q_b_proj.lora_A").axes == ("lora_rank", "q_lora")
    assert leaf_kind("model.layers.0.self_attn.q_b_proj.lora_B").axes == ("heads", "lora_rank")
    assert leaf_kind("model.layers.1.mlp.experts.down_proj.lora_A").axes == ("experts", "lora_rank", "mlp")
    mesh, stored, _, _ = placements(leaf_kind("model.layers.1.mlp.experts.gate_proj.lora_B").axes)
    assert mesh == "experts" and [str(p) for p in stored] == ["S(1)", "S(0)"]  # fsdp over out, ep over experts


# ---- training ----------------------------------------------------------------------------------------------------

def _final_state(monkeypatch, argv):
    """(metrics records, final params, final adapters) of a run, as run.finish.export receives them."""
    seen = {}
    real = finish.export

    def spy(run, state):  # a LoRA run's state: the adapters trained beside the frozen base
        seen.update(params=state.frozen, adapters=state.trained)
        return real(run, state)
    monkeypatch.setattr(finish, "export", spy)
    assert main(argv) == 0
    return seen["params"], seen["adapters"]


@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_training_changes_the_adapters_only(tmp_path, monkeypatch, base_dtype):
    """After 3 steps every base leaf (router biases included) is bit-identical to the init, stored in
    --lora.base_dtype, and every adapter factor has moved."""
    argv = RUN + ["--train.steps", "3", "--lora.rank", "4", "--lora.targets", ALL_TARGETS,
                  "--checkpoint.dir", str(tmp_path / "run")]
    params, adapters = _final_state(monkeypatch, argv + (["--lora.base_dtype", base_dtype] if base_dtype else []))
    cfg = glm5f.preset("glm5-tiny")
    dtype = torch.bfloat16 if base_dtype else torch.float32
    init = glm5f.flatten(glm5f.init_params(cfg, 0, dtype))
    got = glm5f.flatten(params)
    assert got.keys() == init.keys() and all(torch.equal(got[p], init[p]) and got[p].dtype == init[p].dtype
                                             for p in init)
    fresh = lora.init_adapters(glm5f.init_params(cfg, 0), lora.LoraSpec(4, targets=ALL_TARGETS), 0)
    assert all(adapters[p].dtype == torch.float32 and not torch.equal(adapters[p], fresh[p]) for p in fresh)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0]


def test_resume_is_bitwise_and_refuses_a_changed_base(tmp_path, capsys):
    """2 + 2 steps == 4 steps (losses and adapters), with adapter dropout drawing from the restored RNG; the
    checkpoint holds the adapters and their optimizer state, not the base; a resume on another base stops."""
    argv = RUN + ["--lora.rank", "4", "--lora.dropout", "0.1", "--lora.targets", ALL_TARGETS]
    assert main(argv + ["--train.steps", "4", "--checkpoint.dir", str(tmp_path / "once")]) == 0
    assert main(argv + ["--train.steps", "2", "--checkpoint.dir", str(tmp_path / "split")]) == 0
    assert main(argv + ["--train.steps", "4", "--checkpoint.dir", str(tmp_path / "split"),
                        "--checkpoint.resume", "latest"]) == 0
    once, split = read_metrics(tmp_path / "once"), read_metrics(tmp_path / "split")
    assert [r["loss"] for r in once] == [r["loss"] for r in split]
    spec, a_once = checkpoint.load_adapters(str(tmp_path / "once"))
    _, a_split = checkpoint.load_adapters(str(tmp_path / "split"))
    assert spec == lora.LoraSpec(4, 16.0, 0.1, ALL_TARGETS)
    assert a_once.keys() == a_split.keys() and all(torch.equal(a_once[p], a_split[p]) for p in a_once)
    meta = checkpoint.read_meta(checkpoint.resolve(str(tmp_path / "once")))
    assert meta["lora_base"]["fingerprint"] == fingerprint(glm5f.init_params(glm5f.preset("glm5-tiny"), 0))
    capsys.readouterr()
    assert main(argv + ["--train.steps", "5", "--checkpoint.dir", str(tmp_path / "once"), "--checkpoint.resume",
                        "latest", "--lora.base_dtype", "bfloat16"]) == 1
    assert "fingerprint" in capsys.readouterr().err


def test_fingerprint_does_not_depend_on_the_layout_but_on_every_value(tmp_path):
    """FSDP x EP shards (lora_rank replicated dims included) hash to the one-process tree's fingerprint; two
    swapped values change it."""
    import dist_checks
    from glm5f.run.launch import spawn

    params = glm5f.init_params(glm5f.preset("glm5-tiny"), 0)
    attached = lora.attach(params, lora.init_adapters(params, lora.LoraSpec(4, targets=r"self_attn|mlp\."), 0))
    spawn(dist_checks.lora_fingerprint_check, 2, 2, 2, str(tmp_path / "fp"))
    assert (tmp_path / "fp").read_text() == fingerprint(attached)
    before = fingerprint(params)
    flat = glm5f.flatten(params)
    w = flat["model.layers.1.mlp.experts.up_proj.weight"]
    w.view(-1)[[5, 6]] = w.view(-1)[[6, 5]].clone()  # two values swapped: the same sum, other places
    assert fingerprint(params) != before


# ---- parallel layouts --------------------------------------------------------------------------------------------

LORA_LAYOUT_RUN = ["--lora.rank", "8", "--lora.targets", r"self_attn|mlp\."]


def test_layouts_equal_one_process_with_fp64_sums(tmp_path):
    """DP2 (FSDP-sharded adapters), EP2 (expert adapters over ep), CP2: the one-process losses bit for bit with
    --train.reduce_dtype float64, on glm5-scaled-moe with attention, shared and routed-expert adapters."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "3", "--layouts", "dp2", "ep2", "cp2", "--out", str(tmp_path),
                  "--tolerance", "0", "--extra", *LORA_LAYOUT_RUN, "--data.seq_len", "128", "--train.reduce_dtype",
                  "float64"]) == 0


@pytest.mark.slow  # exactness under layouts is test_layouts_equal_one_process_with_fp64_sums
def test_layouts_meet_the_fp32_noise_floor(tmp_path):
    """In plain fp32: within twice one process's own difference with its sums split (the layout rule), at the
    suite's 256 tokens (DSA sparse on every CP rank)."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "3", "--layouts", "dp2", "ep2", "cp2", "--out", str(tmp_path),
                  "--tolerance", "2x", "--extra", *LORA_LAYOUT_RUN]) == 0


# ---- export ------------------------------------------------------------------------------------------------------

def test_merge_lora_export_gives_the_unmerged_logits(tmp_path):
    """scripts/convert.py --merge-lora: the base rebuilt from the run's preset and seed (fingerprint checked),
    adapters merged in fp32: the Transformers checkpoint's logits are our unmerged forward's (fp32, 1e-5); the
    run's --checkpoint.export_hf and checkpoint.load_params give the same merged weights."""
    from scripts.convert import main as convert

    run = tmp_path / "run"
    assert main(RUN + ["--train.steps", "3", "--optim.lr", "3e-2", "--lora.rank", "4", "--lora.targets",
                       ALL_TARGETS, "--checkpoint.dir", str(run), "--checkpoint.export_hf", str(tmp_path / "hf")]) == 0
    assert convert([str(run), str(tmp_path / "merged"), "--merge-lora"]) == 0
    _, exported = glm5f.load_hf(tmp_path / "hf")  # --checkpoint.export_hf of a LoRA run: the same merged weights
    _, from_run = checkpoint.load_params(checkpoint.resolve(str(run)))  # what generate.py reads of a LoRA run
    for other in (exported, from_run):
        assert all(torch.equal(a, b) for a, b in zip(glm5f.flatten(other).values(),
                                                     glm5f.flatten(glm5f.load_hf(tmp_path / "merged")[1]).values()))
    cfg, merged = glm5f.load_hf(tmp_path / "merged")
    spec, adapters = checkpoint.load_adapters(str(run))
    base = glm5f.init_params(glm5f.preset("glm5-tiny"), 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = glm5f.forward(lora.attach(base, adapters), cfg, ids, lora=spec)
    assert (ours - glm5f.forward(base, cfg, ids)).abs().max() > 1e-3  # the trained adapters matter
    assert torch.allclose(glm5f.forward(merged, cfg, ids), ours, rtol=0, atol=1e-5)
    assert convert([str(run), str(tmp_path / "x")]) == 1  # a LoRA checkpoint needs --peft or --merge-lora


def test_export_peft_is_checked_before_training_and_written_at_the_end(tmp_path, capsys):
    """--checkpoint.export_peft: a path that cannot be written stops the run before step 1; the adapter directory
    written at the end is what `convert.py --peft` writes from the run's checkpoint (hf.save_peft of its adapters)."""
    from scripts.convert import main as convert

    in_the_way = tmp_path / "file"
    in_the_way.write_text("x")
    argv = RUN + ["--train.steps", "2", "--lora.rank", "4", "--lora.targets", ALL_TARGETS,
                  "--checkpoint.dir", str(tmp_path / "run")]
    assert main(argv + ["--checkpoint.export_peft", str(in_the_way / "adapter")]) == 1
    assert "export_peft" in capsys.readouterr().err and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert main(argv + ["--checkpoint.export_peft", str(tmp_path / "adapter")]) == 0
    assert convert([str(tmp_path / "run"), str(tmp_path / "converted"), "--peft"]) == 0
    names = sorted(os.listdir(tmp_path / "adapter"))
    assert "adapter_model.safetensors" in names and names == sorted(os.listdir(tmp_path / "converted"))
    for name in names:
        assert (tmp_path / "adapter" / name).read_bytes() == (tmp_path / "converted" / name).read_bytes(), name


@pytest.mark.parametrize("flags, message", [
    (["--lora.rank", "4", "--train.trainable", "q_a"], "--train.trainable 'q_a' with --lora.rank 4"),
    (["--lora.rank", "4", "--train.indexer_loss", "dense"], "the indexer loss trains the base's indexer"),
    (["--lora.rank", "4", "--lora.targets", "nothing_here"], "matches no adaptable weight"),
    (["--lora.rank", "4", "--lora.dropout", "1.0"], "--lora.dropout must lie in [0, 1)"),
    (["--lora.base_dtype", "bfloat16"], "needs --lora.rank >= 1"),
    (["--checkpoint.export_peft", "out"], "--checkpoint.export_peft writes LoRA adapters"),
])
def test_invalid_lora_flags_are_error_lines(flags, message, tmp_path, capsys):
    assert main(RUN + flags + ["--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err
