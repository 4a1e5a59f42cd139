"""The memory plan (glm5f/run/plan.py) against what is true: the parameter count, DTensor's chunking, the tensors
autograd really saves, and the peak resident memory of real runs in every parallel layout."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate

import glm5f
from configs import Config
from conftest import env_of, run_script
from glm5f.parallel.layout import mesh_shapes, placements
from glm5f.model.head import head_loss_sum, shift_labels
from glm5f.model.decoder import hidden_states, main_head
from glm5f.core.params import flatten
from glm5f.core.layers import layer_spec
from glm5f.train.optim import make_optimizer
from glm5f.run.plan import (GB, RunShape, activation_bytes, kept_activation_bytes, leaf_groups, least_total, local_shape,
                            mesh_coords, plan, search, state_bytes, trace, traced_activations)
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_glm5_shards_over_all_ranks_sum_to_the_parameter_count():
    """dp_shard 256 x ep 64: each leaf's bytes counted once, as the sum over all 256 ranks of each rank's shard
    divided by how many ranks hold a copy of it (the mesh dims it is Replicate() over as stored: none in today's
    rules, where dense leaves shard over all ranks and experts over edp x ep, so it is the plain sum of shards);
    that equals fp32 bytes x every parameter, the router's bias buffers included."""
    cfg = glm5f.preset("glm5")
    run = RunShape(dp_shard=256, ep=64, seq_len=4096)
    groups = leaf_groups(cfg)
    shapes = mesh_shapes(run.dp_shard, run.cp, run.ep)
    replicas = {axes: math.prod(k for pl, k in zip(stored, shapes[mesh]) if isinstance(pl, Replicate))
                for axes, (mesh, stored, _, _) in ((key[1], placements(key[1])) for key in groups)}
    assert set(replicas.values()) == {1}  # nothing stored replicated: the plain sum of shards counts each leaf once
    total = sum(state_bytes(cfg, run, rank, groups)["params"] for rank in range(run.world))
    expected = glm5f.param_count(cfg, include_buffers=True) * 4
    assert abs(total - expected) <= 0.01 * expected
    assert total == expected  # exact, in fact: the shards tile every leaf


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 50), chunks=st.integers(1, 9), second=st.integers(1, 30))
def test_local_shapes_tile_the_tensor_as_torch_chunk_does(size, chunks, second):
    """Each coordinate's shard is torch.chunk's piece (empty past the last piece) for a 2-D mesh sharding dims 1
    and 0, the rule of the routed experts."""
    from torch.distributed.tensor import Shard
    pieces0 = [c.shape[0] for c in torch.empty(size).chunk(chunks)] if size else []
    pieces1 = [c.shape[0] for c in torch.empty(second).chunk(2)]
    for r in range(2 * chunks):
        coords = mesh_coords(r, (2, chunks))
        got = local_shape((size, second), [Shard(1), Shard(0)], (2, chunks), coords)
        want0 = pieces0[coords[1]] if coords[1] < len(pieces0) else 0
        assert got == (want0, pieces1[coords[0]] if coords[0] < len(pieces1) else 0)


@pytest.mark.parametrize("B,S,layers,pattern,dtype,reduce", [
    (2, 128, 2, "FS", "float32", None), (2, 48, 2, "FS", "float32", None), (1, 128, 4, "FFSF", "float32", None),
    (2, 128, 2, "FS", "bfloat16", None), (2, 128, 2, "FS", "float32", "float64")])
def test_saved_activations_match_what_autograd_saves(B, S, layers, pattern, dtype, reduce):
    """The plan's kept activations (decoder layers + the head, no transients) against the unique storages autograd
    saves in a real forward and head loss (parameters excluded): sparse layers (S > index_topk), the dense path
    (S = 48), and bf16 activations (fp32 norms and router, as micro_loss casts the weights), fp64 weights of
    --train.reduce_dtype."""
    cfg = glm5f.preset("glm5-scaled-moe", num_hidden_layers=layers, index_topk_pattern=pattern)
    params = glm5f.init_params(cfg, dtype=getattr(torch, reduce or dtype))
    leaves = list(flatten(params).values())
    for t in leaves:
        t.requires_grad_()
    weights = {t.untyped_storage().data_ptr() for t in leaves}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        env = dataclasses.replace(env_of(cfg, ids.shape, dtype=getattr(torch, dtype)), topk_dense=False)
        hidden, _ = hidden_states(params, cfg, ids, env)  # the path the plan sizes: the accelerators' sparse core
        head_loss_sum(main_head(params, cfg), hidden, shift_labels(ids), cfg.rms_norm_eps)
    plan_acts = activation_bytes(cfg, RunShape(batch_size=B, seq_len=S, dtype=dtype, reduce_dtype=reduce), remat=False)
    measured = sum(saved.values())
    # fp64 experts take the fallback, whose width depends on the routing: within 15% (the layers' own error, which
    # the whole logits diluted to within 10% before the head kept only its hidden states)
    assert abs(plan_acts["layers"] + plan_acts["logits"] - measured) <= 0.15 * measured
    if reduce is None:  # traced: within 2%
        assert abs(plan_acts["layers"] + plan_acts["logits"] - measured) <= 0.02 * measured
    remat = activation_bytes(cfg, RunShape(batch_size=B, seq_len=S, dtype=dtype, reduce_dtype=reduce), remat=True)
    assert remat["layers"] < plan_acts["layers"] / 5


@pytest.mark.parametrize("preset,seq_len,dtype,reduce", [("glm5-tiny", 64, "float32", None),
                                                        ("glm5-tiny", 64, "bfloat16", None),
                                                        ("glm5-scaled-moe", 256, "float32", "float64"),
                                                        ("glm5-scaled-moe", 48, "float32", None)])
def test_activations_of_any_batch_and_cp_split_are_those_traced_at_that_size(preset, seq_len, dtype, reduce):
    """The plan traces at B = 2, 3 rows (or 1) and S = T / 2, T / 4 queries and extends each saved storage
    bilinearly: the bytes of every storage at B = 1 and 5, cp 4 and 8 (S = T / 8) equal a trace at that size
    (sparse layers, index_topk < T, whose keys outgrow their queries at cp 4; and the dense path at T = 48)."""
    cfg = glm5f.preset(preset, **({} if preset == "glm5-tiny" else {"num_hidden_layers": 2}))
    for B in (1, 5):
        for cp in (4, 8):
            run = RunShape(dp_shard=1, cp=cp, batch_size=B, seq_len=seq_len, dtype=dtype, reduce_dtype=reduce)
            assert traced_activations(cfg, run) == trace(cfg, run, B), (B, cp)


def test_glm53_plans_its_kda_layers_under_cp():
    """GLM-5.3's KDA layers run under CP on their own path (`kda.kda_attention_cp`: halo, chunk maps, their
    composition): the plan traces it, its storages at B = 5, cp 4 are a trace at that size, and the search tries
    cp > 1."""
    cfg = glm5f.preset("glm53-tiny")
    run = RunShape(dp_shard=1, cp=4, batch_size=5, seq_len=64)
    assert traced_activations(cfg, run) == trace(cfg, run, 5)
    found = search(cfg, RunShape(batch_size=4, seq_len=64), 10 * GB, max_world=4)
    assert {p["cp"] for p in found} == {1, 2, 4}


def test_plan_json_prints_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    t = time.perf_counter()
    assert main(["--plan", "json", "--model.preset", "glm5", "--parallel.dp_shard", "256", "--parallel.ep", "64",
                 "--data.seq_len", "4096", "--data.batch_size", "256", "--checkpoint.dir", str(run_dir)]) == 0
    assert time.perf_counter() - t < 30
    p = json.loads(capsys.readouterr().out)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes", "world"):
        assert key in p
    assert p["world"] == 256 and p["device_bytes"] is None
    assert p["params_bytes"] == state_bytes(glm5f.preset("glm5"), RunShape(dp_shard=256, ep=64))["params"]
    assert p["optimizer_bytes"] == 2 * p["grads_bytes"]
    assert not run_dir.exists()


def test_plan_table_of_glm5_on_256_ranks(capsys):
    """The issue's command: a table in seconds; the default batch (16) cannot feed 256 ranks, which is noted."""
    t = time.perf_counter()
    assert main(["--plan", "table", "--model.preset", "glm5", "--parallel.dp_shard", "256", "--parallel.ep", "64",
                 "--data.seq_len", "4096"]) == 0
    assert time.perf_counter() - t < 30
    out, err = capsys.readouterr()
    assert "256 ranks, ep 64" in out and "total (peak:" in out and "no device limit" in out
    assert "would stop" in err and "--data.batch_size (16)" in err


def test_plan_table_against_a_device_limit(capsys):
    assert main(["--plan", "table", "--model.preset", "glm5-tiny", "--parallel.device_memory_gb", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "gathered parameters" in out
    assert main(["--plan", "table", "--model.preset", "glm5-tiny", "--parallel.device_memory_gb", "100"]) == 0
    assert "-> fits" in capsys.readouterr().out


def test_search_lists_the_smallest_fitting_meshes():
    cfg = glm5f.preset("glm5")
    run = RunShape(batch_size=512, seq_len=4096, dtype="bfloat16", remat=True)
    groups = leaf_groups(cfg)
    found = search(cfg, run, 141 * GB)
    assert found and all(p["total_bytes"] <= 141 * GB for p in found)
    smallest = found[0]["world"]
    half = [RunShape(dp, smallest // 2 // dp, ep, 512, 4096, 1, "bfloat16", None, True)
            for dp in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if dp <= smallest // 2
            for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256) if ep <= smallest // 2]
    assert not any(plan(cfg, r, groups=groups)["total_bytes"] <= 141 * GB for r in half)


# ---- predicted against measured peak memory (resident set size on the CPU) ----------------------------------------

MEASURE = ["--model.preset", "glm5-scaled-moe", "--model.num_hidden_layers", "2", "--model.index_topk_pattern", "FS",
           "--data.type", "synthetic", "--data.batch_size", "4", "--data.seq_len", "256", "--train.steps", "2",
           "--eval.every", "0", "--optim.warmup_steps", "0", "--train.log_every", "1"]
LAYOUTS = {"1": [], "dp2": ["--parallel.dp_shard", "2"], "cp2": ["--parallel.cp", "2"],
           "ep2": ["--parallel.dp_shard", "2", "--parallel.ep", "2"], "1-muon": ["--optim.name", "muon"],
           "dp2-muon": ["--parallel.dp_shard", "2", "--optim.name", "muon"]}


# GLM-5.3's KDA and pooled DSA layers with mHC streams, its KDA op's blocks included (`kda.workspace_bytes`)
MEASURE_GLM53 = ["--model.preset", "glm53-scaled", "--data.type", "synthetic", "--data.batch_size", "4",
                 "--data.seq_len", "512", "--train.steps", "2", "--eval.every", "0", "--optim.warmup_steps", "0",
                 "--train.log_every", "1"]


def measure_against_plan(layout: str, tmp_path, base: list[str] = MEASURE) -> list[tuple[float, float]]:
    """(predicted, measured) peak bytes of each rank of a 2-step run of `base` in `layout`; the plan's runtime line
    is the rank's resident size measured before training."""
    import tyro
    from configs import Config
    from glm5f.train.optim import make_optimizer
    from glm5f.run.plan import run_shape

    argv = base + LAYOUTS[layout] + ["--checkpoint.dir", str(tmp_path / "run")]
    out = tmp_path / "probe.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "memory_probe.py"), str(out), "--", *argv],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = tyro.cli(Config, args=argv, use_underscores=True)
    pairs = []
    for rec in json.loads(out.read_text()):
        p = plan(cfg.model.build(), run_shape(cfg), rec["runtime_bytes"],
                 optimizer=make_optimizer(cfg.optim, cfg.model.build()))
        assert rec["param_bytes"] == state_bytes(cfg.model.build(), run_shape(cfg), rec["rank"])["params"]
        pairs.append((p["total_bytes"], rec["peak_bytes"]))
        print(f"{layout} rank {rec['rank']}: runtime {rec['runtime_bytes'] / 1e6:.0f} MB, predicted "
              f"{p['total_bytes'] / 1e6:.0f} MB ({p['peak_phase']}), measured {rec['peak_bytes'] / 1e6:.0f} MB, "
              f"error {(p['total_bytes'] - rec['peak_bytes']) / rec['peak_bytes']:+.1%}")
    return pairs


@pytest.mark.parametrize("layout", ["1", "1-muon"])
def test_predicted_peak_memory_of_one_process(layout, tmp_path):
    for pred, meas in measure_against_plan(layout, tmp_path):
        assert abs(pred - meas) / meas <= 0.2, f"predicted {pred / 1e6:.0f} MB, measured {meas / 1e6:.0f} MB"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "cp2", "ep2", "dp2-muon"])
def test_predicted_peak_memory_of_each_layout(layout, tmp_path):
    for pred, meas in measure_against_plan(layout, tmp_path):
        assert abs(pred - meas) / meas <= 0.2, f"{layout}: predicted {pred / 1e6:.0f} MB, measured {meas / 1e6:.0f} MB"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1", "cp2"])
def test_predicted_peak_memory_of_glm53(layout, tmp_path):
    for pred, meas in measure_against_plan(layout, tmp_path, MEASURE_GLM53):
        assert abs(pred - meas) / meas <= 0.2, f"{layout}: predicted {pred / 1e6:.0f} MB, measured {meas / 1e6:.0f} MB"


class CountingLayout(glm5f.parallel.layout.Layout):
    """One process whose gather makes copies, as FSDP's does, and counts the bytes of copies alive at each gather."""

    def __init__(self, layers: int):
        super().__init__(torch.device("cpu"))
        self.live, self.peak = 0, 0
        self.layers = {f"model.layers.{i}": 0 for i in range(layers)}  # live copies per decoder layer
        self.most_layers = 0  # the most decoder layers with live copies at once

    def gather(self, params, prefix=""):
        out = glm5f.core.params.map_with_path(lambda p, t: t.clone(), params)
        for t in flatten(out).values():
            self.live += t.numel() * t.element_size()
            if prefix in self.layers:
                self.layers[prefix] += 1
            weakref.finalize(t, self._freed, t.numel() * t.element_size(), prefix)
        self.peak = max(self.peak, self.live)
        self.most_layers = max(self.most_layers, sum(n > 0 for n in self.layers.values()))
        return out

    def _freed(self, n, prefix):
        self.live -= n
        if prefix in self.layers:
            self.layers[prefix] -= 1


@pytest.mark.parametrize("remat", [True, False])
def test_gathered_weights_alive_at_once_are_what_the_plan_counts(remat):
    """micro_loss gathers the embedding, norm and head once and each decoder layer as it runs: with activation
    checkpointing one layer's copy is alive at a time (freed after its forward, gathered again for its backward),
    without it autograd keeps them all. The largest number of gathered bytes alive at once, over forward and
    backward, is at most the plan's gathered line of a 2-rank FSDP run (whose ranks gather whole leaves too), and
    without checkpointing close to it."""
    from glm5f.train.loss import Step, micro_loss, step_denoms, with_targets

    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=4, index_topk_pattern="FSFS", num_nextn_predict_layers=1)
    params = glm5f.init_params(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    full = with_targets({"input_ids": ids, "labels": ids, "position_ids": torch.arange(16).expand(2, 16)}, 1)
    layout = CountingLayout(cfg.num_hidden_layers)
    p = glm5f.core.params.map_with_path(lambda path, t: t.detach().requires_grad_(), params)
    step = Step.of(dataclasses.replace(Config().train, activation_checkpointing=remat), cfg)
    objective, _ = micro_loss(p, full, step_denoms(full, cfg, step.objectives), cfg, layout, step)
    objective.backward()
    s = state_bytes(cfg, RunShape(dp_shard=2, remat=remat))
    assert s["largest_layer_gathered"] < s["gathered"] / 4
    gathered = plan(cfg, RunShape(dp_shard=2, remat=remat))["gathered_bytes"]
    assert gathered == (s["gathered_once"] + s["largest_layer_gathered"] if remat else s["gathered"])
    # dp_shard 2 gathers full leaves as this layout does. The plan is an upper bound: it also counts leaves a layer
    # gathers but drops at once (a shared-top-k layer's indexer) and, with checkpointing, keeps the head and the MTP
    # layer through the whole backward (autograd frees them before the decoder layers' backward)
    assert layout.peak <= gathered, (layout.peak, gathered)
    assert layout.most_layers == (1 if remat else cfg.num_hidden_layers)  # at most two (the bound)
    if not remat:
        assert layout.peak >= 0.95 * gathered, (layout.peak, gathered)


def test_lora_plan_counts_the_adapters_and_a_frozen_base():
    """A LoRA run (rank 8 on attention, dense, shared and routed experts; the base in bf16): over all ranks of
    dp_shard 2 x ep 2 the params are the bytes of the real base tree (bf16, its fp32 leaves fp32) and the real
    adapters (fp32), and gradients and AdamW count the adapters only."""
    from glm5f.model import lora

    cfg = glm5f.preset("glm5-tiny")
    run = RunShape(dp_shard=2, ep=2, seq_len=64, batch_size=2, lora_rank=8, lora_targets=r"self_attn|mlp\.",
                   base_dtype="bfloat16")
    base = glm5f.init_params(cfg, 0, torch.bfloat16)
    adapters = lora.init_adapters(base, run.lora, 0)
    nbytes = lambda tree: sum(t.numel() * t.element_size() for t in flatten(tree).values())  # noqa: E731
    per_rank = [state_bytes(cfg, run, rank) for rank in range(run.world)]
    assert sum(s["params"] for s in per_rank) == nbytes(base) + nbytes(adapters)
    assert sum(s["trained"] for s in per_rank) == nbytes(adapters)
    p, full = plan(cfg, run), plan(cfg, dataclasses.replace(run, lora_rank=0, base_dtype=None))
    assert p["grads_bytes"] == per_rank[0]["trained"] and p["optimizer_bytes"] == 2 * per_rank[0]["trained"]
    assert full["grads_bytes"] > 3 * p["grads_bytes"] and full["params_bytes"] > p["params_bytes"]


def test_glm5_heads_keep_their_hidden_states_and_one_chunk_of_logits():
    """The issue's GLM-5 plan (256 ranks, ep 64, bf16, checkpointing, 4096 tokens a rank, one MTP layer): each of
    the two heads keeps its bf16 hidden states and int64 targets, no logits, and the heads' transient is one
    chunk of logits, so logits and their transient take under 1 GB a rank (9.1 GB with whole logits)."""
    cfg = glm5f.preset("glm5")
    run = RunShape(dp_shard=256, ep=64, batch_size=256, seq_len=4096, dtype="bfloat16", remat=True)
    p = plan(cfg, run)
    tokens = run.micro_batch * run.seq_len
    assert p["activation_logits_bytes"] == 2 * tokens * (cfg.hidden_size * 2 + 8)
    whole = tokens * cfg.vocab_size * 2  # the bf16 logits alone, before their fp32 copy and gradient
    assert p["activation_logits_transient_bytes"] < whole / 2
    assert p["activation_logits_bytes"] + p["activation_logits_transient_bytes"] < 1 * GB


@pytest.mark.parametrize("preset,cp,dtype", [("glm5-tiny", 1, "float32"), ("glm5-tiny", 2, "bfloat16"),
                                             ("glm53-tiny", 1, "float32"), ("glm53-tiny", 2, "float32")])
def test_kept_activations_are_the_layer_inputs_and_rope_tables_a_trace_saves(preset, cp, dtype):
    """`kept_activation_bytes` (a formula) is what the traced layers keep whether recomputed or not: each decoder
    layer's and MTP depth's input (GLM-5.3's hyper-connection streams) and the rope tables (none in GLM-5.3), at
    B = 3 rows on CP rank 0."""
    cfg = glm5f.preset(preset, **({"num_nextn_predict_layers": 1} if preset == "glm5-tiny" else {}))
    run = RunShape(cp=cp, batch_size=3, seq_len=64, dtype=dtype)
    traced = trace(cfg, run, 3)
    layers = list(range(cfg.num_hidden_layers)) + [cfg.mtp_layer(d) for d in range(1, cfg.mtp_depths + 1)]
    inputs = sum(traced[layer_spec(cfg, i)][-2] for i in layers)  # [..., input, top-k passed on]
    assert kept_activation_bytes(cfg, run) == inputs + sum(traced["rope"]) > 0


@pytest.mark.parametrize("preset,run,optim", [
    ("glm5-tiny", RunShape(), "adamw"),
    ("glm5-tiny", RunShape(remat=True, grad_accum=2, batch_size=4, seq_len=64), "muon"),
    ("glm5-scaled-moe", RunShape(dp_shard=2, ep=2, batch_size=4, seq_len=64, dtype="bfloat16", remat=True), "adamw"),
    ("glm5-scaled-moe", RunShape(dp_shard=2, cp=2, batch_size=2, seq_len=64, reduce_dtype="float64"), "adamw"),
    ("glm53-tiny", RunShape(cp=2, batch_size=2, seq_len=64), "muon"),
    ("glm5-tiny", RunShape(dp_shard=2, batch_size=4, seq_len=64, lora_rank=8, base_dtype="bfloat16"), "adamw")])
def test_least_total_is_the_plans_update_and_below_its_total(preset, run, optim):
    """What the memory check compares (`least_total`, nothing traced) is the plan's update phase exactly and at
    most its forward/backward and total, so a run the plan says fits a memory size is never refused by it."""
    cfg = glm5f.preset(preset, **({"num_hidden_layers": 2} if preset == "glm5-scaled-moe" else {}))
    optimizer = make_optimizer(dataclasses.replace(Config().optim, name=optim), cfg)
    p, least = plan(cfg, run, optimizer=optimizer), least_total(cfg, run, optimizer)
    assert least["update"] == p["update_bytes"]
    assert least["activations"] <= min(p["activations_remat_bytes"], p["activations_no_remat_bytes"])
    assert least["forward_backward"] <= p["forward_backward_bytes"]
    assert least["total"] <= p["total_bytes"]
    assert least["forward_backward"] > least["activations"] > 0


@pytest.mark.parametrize("flags, line", [
    (["--parallel.dp_shard", "3", "--parallel.ep", "64"], "error: --plan needs a mesh: --parallel.ep 64 must divide "
                                                          "the ranks dp_shard x cp = 3"),
    (["--parallel.dp_shard", "16", "--parallel.ep", "16"], "error: --plan needs a mesh: --parallel.ep 16 must divide "
                                                          "n_routed_experts (8)"),
    (["--parallel.dp_shard", "0"], "error: --plan needs a mesh: --parallel.dp_shard must be >= 1, got 0")])
def test_plan_of_flags_that_leave_no_mesh_is_an_error_line(flags, line):
    out = run_script("train.py", "--plan", "table", *flags)
    assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1] == line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_plan_for_a_gpu_runs_on_a_machine_without_one(capsys):
    """The README's `--plan search ... --train.device cuda`: the plan allocates nothing, so it needs no GPU here;
    planned for cuda, the table has no measured CPU runtime row."""
    flags = ["--model.preset", "glm5-tiny", "--train.device", "cuda", "--parallel.device_memory_gb", "1",
             "--data.batch_size", "2", "--data.seq_len", "64"]
    assert main(["--plan", "search", *flags]) == 0
    out, err = capsys.readouterr()
    assert "smallest meshes for glm5-tiny" in out and "within 1 GB per rank" in out and "error" not in err, err
    assert main(["--plan", "table", *flags]) == 0
    out, err = capsys.readouterr()
    assert "device memory (--parallel.device_memory_gb)" in out and "runtime" not in out, out
