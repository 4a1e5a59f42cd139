"""glm5f/parallel/distributed.py: parallel layouts (FSDP/DP, CP, EP and their mixes) against the single-process run, on local
gloo processes (DistLayout's collectives; the objectives' sums over ranks included)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import dist_checks
import glm5f
from conftest import rel_err
from glm5f.parallel.distributed import DistLayout
from glm5f.run.launch import spawn
from glm5f.run.metrics import read_metrics
from scripts.align import COMMON, LAYOUTS
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_ten_step_alignment_within_the_noise_floor(tmp_path):
    """The CI version of scripts/align.py's fp32 rule, GLM-5's objectives on (indexer sparse KL, MTP, balance
    loss): each layout within 2x the noise floor (`align.floor`): the furthest one process drifts from itself with
    its batch in 2 or 4 micro-batches or its queries in 2 or 4 parts held as CP ranks hold them
    (--train.query_parts). The floors drift past 1e-4 within 10 steps here, once a near-tied top-k choice flips;
    the fp64-sums test below holds every layout to the one-process numbers."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "10", "--objectives", "--layouts", "ep2", "cp2-ep2", "--out",
                  str(tmp_path)]) == 0
    results = json.loads((tmp_path / "align.json").read_text())
    floors = [results[f"1proc-{split}{n}"]["max"] for split in ("accum", "qparts") for n in (2, 4)]
    assert results["ep2"]["bound"] == results["cp2-ep2"]["bound"] == 2 * max(floors)


@pytest.mark.parametrize("steps,layouts", [("3", ["--layouts", "ep2", "cp2-ep2", "dp2-cp2"]),
                                           pytest.param("5", [], marks=pytest.mark.slow)], ids=["3", "5-all"])
def test_alignment_with_fp64_sums(tmp_path, steps, layouts):
    """fp32 with --train.reduce_dtype float64, GLM-5's objectives on (indexer sparse KL, one MTP layer, the
    sequence-wise balance loss): each layout computes the one-process loss and objectives at every step (bit for
    bit in practice; 1e-6 leaves room for a sum that lands on an fp32 rounding boundary on another machine). CI runs
    the layouts that hold DP, CP and EP in 3 steps; `-m slow` every layout in 5;
    `python scripts/align.py --steps 100 --extra --train.reduce_dtype float64` is the long version."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", steps, "--objectives", *layouts, "--out", str(tmp_path),
                  "--tolerance", "1e-6", "--extra", "--train.reduce_dtype", "float64"]) == 0


@pytest.mark.slow
def test_layouts_are_exact_in_float64(tmp_path):
    """In fp64 the layouts agree to rounding (1e-10 here) step after step: what separates them in fp32 over long
    runs is the order of floating-point sums, amplified by top-k choices, not a difference in the mathematics."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "6", "--layouts", "cp2-ep2", "dp2-cp2", "--out", str(tmp_path),
                  "--tolerance", "1e-10", "--extra", "--train.dtype", "float64"]) == 0


# The first-step checks: each run's one-process reference is computed once, and a layout's runs of every check
# below that uses it in one spawned group of ranks (TOGETHER), the group's stderr kept for the checks that read it.
TOGETHER = {"cp2": ["fp32", "seq_aux", "glm53"], "cp2-ep2": ["fp32", "fp64_sums", "mtp"],
            "dp2-cp2": ["fp32", "fp64_sums"]}


def first_step_runs(tmp) -> dict[str, list[str]]:
    """The runs of the first-step checks, by name (their flags but the layout's)."""
    return {
        "fp32": COMMON + ["--train.steps", "1"],
        "fp64_sums": COMMON + ["--train.steps", "1", "--train.reduce_dtype", "float64"],
        "seq_aux": ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2",
                    "--data.seq_len", "32", "--train.dtype", "float64", "--train.steps", "1",
                    "--train.seq_aux_loss_coeff", "0.3"],
        "mtp": ["--model.preset", "glm5-tiny", "--model.num_nextn_predict_layers", "1", "--data.type", "text",
                "--data.batch_size", "2", "--data.seq_len", "64", "--train.steps", "1"],
        "glm53": GLM53 + ["--data.type", "preset_pt", "--data.path", packed_batches(tmp / "batches.pt")],
    }


@pytest.fixture(scope="module")
def first_step(tmp_path_factory):
    """first_step(run, layout=None, capfd=None) -> `dist_checks.first_step_grads` of the run named (one process
    when layout is None, kept for the module; a layout's result is handed out once), the layout's stderr under
    "stderr" (read through capfd by whichever check spawned its group)."""
    tmp = tmp_path_factory.mktemp("first_step")
    runs, done = first_step_runs(tmp), {}

    def get(run: str, layout: str | None = None, capfd=None) -> dict:
        if layout is None:
            if run not in done:
                done[run] = dist_checks.first_step_grads(runs[run], None)
            return done[run]
        if (run, layout) not in done:
            names = [run] + [r for r in TOGETHER.get(layout, []) if r != run and (r, layout) not in done]
            path = tmp / f"{layout}.pt"
            if capfd is not None:
                capfd.readouterr()
            spawn(dist_checks.first_step_grads_of, 4 if layout == "dp2-cp2" else 2,
                  [runs[r] + LAYOUTS[layout] for r in names], str(path))
            err = capfd.readouterr().err if capfd is not None else ""
            for r, result in zip(names, torch.load(path, weights_only=True)):
                done[(r, layout)] = {**result, "stderr": err}
        return done.pop((run, layout))
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_step_gradients_equal_single_process(layout, first_step, capfd):
    ref, got = first_step("fp32"), first_step("fp32", layout, capfd)
    assert abs(got["loss"] - ref["loss"]) <= 1e-6
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-6 * ref["grad_norm"]
    assert "suboptimal" not in got["stderr"]  # DTensor's warning about two all_reduces in a row
    assert got["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        err = float((got["grads"][k] - g).norm() / g.norm().clamp(min=1e-30))
        assert err <= 1e-5, f"{layout} {k}: relative gradient error {err:.2e}"
    for k, c in ref["counts"].items():
        assert torch.equal(got["counts"][k], c), k


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of b."""
    spacing = torch.nextafter(b.abs(), torch.full_like(b, float("inf"))) - b.abs()
    return (a - b).abs() / spacing


@pytest.mark.parametrize("layout", ["accum2", "cp2-ep2", "dp2-cp2"])
def test_reduce_float64_gradients_equal_single_process_to_the_last_bit(layout, first_step, capfd):
    """With --train.reduce_dtype float64 every sum that makes a gradient (over tokens, queries, micro-batches and
    ranks) is taken in fp64 and rounded to fp32 once, so each layout's fp32 gradients are the one-process ones
    bit for bit, but for a sum that falls within fp64 rounding of an fp32 rounding boundary (allowed here: one
    element in 1e6, one ulp). Plain fp32 sums in another order and differs in most elements (70% here)."""
    ref = first_step("fp64_sums")
    if layout == "accum2":
        got = dist_checks.first_step_grads(COMMON + ["--train.steps", "1", "--train.reduce_dtype", "float64",
                                                     "--train.grad_accum", "2"], None)
    else:
        got = first_step("fp64_sums", layout, capfd)
    assert got["loss"] == ref["loss"]
    differing = total = 0
    for k, g in ref["grads"].items():
        assert got["grads"][k].dtype == g.dtype == torch.float32
        ulps = ulps_apart(got["grads"][k], g)
        assert float(ulps.max()) <= 1, f"{layout} {k}: {float(ulps.max())} ulps apart"
        differing, total = differing + int((ulps > 0).sum()), total + g.numel()
    assert differing <= total * 1e-6, f"{layout}: {differing} of {total} gradient entries differ"


@pytest.mark.parametrize("ep", [1, 2])
def test_rank_local_init_and_load_are_the_shards_of_the_one_process_ones(ep, tmp_path):
    spawn(dist_checks.rank_local_init_check, 2, 2, ep, str(tmp_path))


def test_each_finished_step_reaches_the_on_step_hook():
    """DistLayout passes the train loop's finished steps to its hook (train.py's: the StallWatch's), in order; with
    no hook, step_done does nothing. One rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        steps = []
        layout = DistLayout(1, 1, 1, torch.device("cpu"), on_step=steps.append)
        for step in (1, 2, 5):
            layout.step_done(step)
        assert steps == [1, 2, 5]
        DistLayout(1, 1, 1, torch.device("cpu")).step_done(1)
    finally:
        dist.destroy_process_group()


def test_cp_attention_equals_unsharded():
    spawn(dist_checks.cp_attention_property, 2)


def test_ep_dispatch_equals_local_experts():
    spawn(dist_checks.ep_dispatch_property, 2)


def _train(*args):
    rc = main(RESUME_RUN + ["--checkpoint.every", "3", "--train.steps", "6", *args])
    assert rc == 0


# the resume checks' run: the smallest MoE + MLA + DSA preset (every kind of leaf sharded, experts over EP), fp32
RESUME_RUN = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "4", "--data.seq_len",
              "64", "--train.dtype", "float32"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The directory of the 6-step one-process run the resume checks compare with (run once for the module)."""
    path = tmp_path_factory.mktemp("straight")
    _train("--checkpoint.dir", str(path))
    return path


@pytest.mark.parametrize("first,then", [  # CI: the experts' shards regathered; the others with -m slow
    pytest.param(LAYOUTS["dp2"], [], marks=pytest.mark.slow),      # DP2 -> 1 process
    (LAYOUTS["ep2"], ["--parallel.dp_shard", "2"]),               # EP2 -> EP1
    pytest.param(LAYOUTS["cp2"], LAYOUTS["dp2"], marks=pytest.mark.slow),  # CP2 -> DP2
], ids=["dp2-to-1", "ep2-to-ep1", "cp2-to-dp2"])
def test_resume_across_layouts(first, then, tmp_path, straight_run):
    straight = [r["loss"] for r in read_metrics(straight_run)]
    run = str(tmp_path / "switched")
    _train("--checkpoint.dir", run, "--train.steps", "3", *first)
    _train("--checkpoint.dir", run, "--checkpoint.resume", "latest", *then)
    switched = [r["loss"] for r in read_metrics(run)]
    assert len(switched) == 6
    # fp32: a layout drifts from one process by its sums' order (CP's most: each latent row's gradient is summed
    # over other blocks of queries); switching must add no more than that layout's own 6-step drift, twice
    _train("--checkpoint.dir", str(tmp_path / "first"), *first)
    first_run = read_metrics(tmp_path / "first")
    drift = max(abs(r["loss"] - b) for r, b in zip((r for r in first_run if "loss" in r), straight))
    evals = [{r["step"]: r["eval_loss"] for r in metrics if "eval_loss" in r}
             for metrics in (read_metrics(straight_run), read_metrics(run), first_run)]
    drift = max(drift, abs(evals[2][6] - evals[0][6]))
    assert max(abs(a - b) for a, b in zip(switched, straight)) <= max(1e-4, 2 * drift)
    assert evals[0].keys() == {6} and evals[1].keys() == {3, 6}  # held-out loss at each run's end, in its layout
    assert abs(evals[0][6] - evals[1][6]) <= max(1e-4, 2 * drift)


@pytest.mark.parametrize("args,message", [
    (["--parallel.dp_shard", "3", "--parallel.ep", "3"], "must divide n_routed_experts"),
    (["--parallel.dp_shard", "2", "--parallel.ep", "4"], "must divide the ranks"),
    (["--parallel.cp", "2", "--data.seq_len", "90"], "must divide by 4"),
    (["--parallel.dp_shard", "2", "--model.preset", "glm5-scaled-dense", "--parallel.ep", "2"], "needs MoE layers"),
    (["--parallel.dp_shard", "2", "--parallel.tp", "2"], "tensor parallelism"),
])
def test_invalid_layouts_fail_before_spawning(args, message, tmp_path, capsys, monkeypatch):
    def no_spawn(*a):
        raise AssertionError("no process should have been started")

    monkeypatch.setattr("train.spawn", no_spawn)
    assert main(COMMON + ["--checkpoint.dir", str(tmp_path / "x"), *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_world_mismatch_under_torchrun(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(COMMON + ["--parallel.dp_shard", "2", "--checkpoint.dir", str(tmp_path)]) == 1
    assert "must equal the number of processes (4)" in capsys.readouterr().err


def test_warnings_come_from_rank_zero_only(tmp_path, capfd):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "response": ""}\n{"text": "some text"}\n')
    assert main(["--model.preset", "glm5-tiny", "--data.type", "json_file", "--data.path", str(data),
                 "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "1", "--parallel.dp_shard", "2",
                 "--checkpoint.dir", str(tmp_path / "run")]) == 0
    err = capfd.readouterr().err
    assert err.count("warning: --train.steps 1 ends inside the 20-step warm-up") == 1, err
    assert err.count("warning: 1 of 2 records have an empty response") == 1, err


def test_loading_and_export_hold_only_a_ranks_share(tmp_path):
    """A 320 MB Transformers checkpoint (the 160M setting in bf16): loading it under --parallel.dp_shard 2 grows
    each rank's peak RSS by less than 0.65 x its size (each rank reads only its slices, with plain reads, no
    memory map), one process by at most 1.1 x; exporting from the DP2 shards (one leaf gathered at a time, the
    file written tensor by tensor) the same; and the export equals the checkpoint."""
    import json

    cfg = glm5f.preset("glm5-scaled-moe", hidden_size=512, moe_intermediate_size=512, n_routed_experts=64)
    glm5f.save_hf(tmp_path / "ckpt", cfg, glm5f.init_params(cfg, seed=1, dtype=torch.bfloat16))
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert size > 300e6
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]; import dist_checks; "
            f"dist_checks.load_export_growth({str(tmp_path / 'ckpt')!r}, {str(tmp_path / 'one')!r}, "
            f"{str(tmp_path / 'g1')!r}, 1)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    spawn(dist_checks.load_export_growth, 2, str(tmp_path / "ckpt"), str(tmp_path / "two"), str(tmp_path / "g2"), 2)
    one = json.loads((tmp_path / "g1.0").read_text())
    ranks = [json.loads((tmp_path / f"g2.{r}").read_text()) for r in range(2)]
    print(f"checkpoint {size / 1e6:.0f} MB; peak RSS growth, one process: load {one['load'] / size:.2f}x, export "
          f"{one['export'] / size:.2f}x; dp_shard 2: " + ", ".join(
              f"rank {r} load {g['load'] / size:.2f}x export {g['export'] / size:.2f}x" for r, g in enumerate(ranks)))
    assert one["load"] <= 1.1 * size and one["export"] <= 1.1 * size
    for g in ranks:
        assert g["load"] < 0.65 * size and g["export"] < 0.65 * size, g
    original = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    for name in ("one", "two"):
        assert (tmp_path / name / "model.safetensors").read_bytes() == original, name


def test_seq_aux_loss_under_context_parallel_equals_one_process(first_step, capfd):
    """--parallel.cp 2: each sequence's tokens are split over two ranks, whose expert loads and token counts are
    summed before f is formed; the metric and every gradient equal the one-process run's (rel 1e-6)."""
    ref, got = first_step("seq_aux"), first_step("seq_aux", "cp2", capfd)
    assert abs(got["metrics"]["seq_aux_loss"] - ref["metrics"]["seq_aux_loss"]) <= 1e-6 * ref["metrics"][
        "seq_aux_loss"]
    assert got["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        assert rel_err(got["grads"][k], g) <= 1e-6, f"{k}: relative gradient error {rel_err(got['grads'][k], g):.2e}"


def test_context_and_expert_parallel_mtp_equals_one_process(first_step, capfd):
    """cp2 x ep2 on packed text: the MTP inputs and targets are shifted on whole sequences before the CP split,
    so the MTP loss, every gradient and the MTP layer's expert counts are the one-process ones."""
    ref, got = first_step("mtp"), first_step("mtp", "cp2-ep2", capfd)
    assert abs(got["metrics"]["mtp_loss"] - ref["metrics"]["mtp_loss"]) <= 1e-6
    assert abs(got["loss"] - ref["loss"]) <= 1e-6
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in ref["counts"]
    for k, c in ref["counts"].items():
        assert torch.equal(got["counts"][k], c), k
    for k, g in ref["grads"].items():
        assert rel_err(got["grads"][k], g) <= 1e-5, f"{k}: relative gradient error {rel_err(got['grads'][k], g):.2e}"


# ---- GLM-5.3 ------------------------------------------------------------------------------------------------------

GLM53 = ["--model.preset", "glm53-tiny", "--data.batch_size", "2", "--data.seq_len", "64", "--train.dtype", "float64",
         "--checkpoint.every", "0", "--train.steps", "1"]


def packed_batches(path):
    """One batch of 2 x 64 tokens whose documents start at a CP2 chunk's first token (16), inside chunks (33, 37),
    as a 1-token document (37), at a chunk's last token, running on into the next rank's chunk (47), and at 62."""
    starts = [[0, 16, 37, 38, 47, 62], [0, 33]]
    position_ids = torch.zeros(2, 64, dtype=torch.long)
    for row, bounds in enumerate(starts):
        for a, b in zip(bounds, bounds[1:] + [64]):
            position_ids[row, a:b] = torch.arange(b - a)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    torch.save([{"input_ids": ids, "labels": ids.clone(), "position_ids": position_ids}], path)
    return str(path)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[] if name == "cp2" else [pytest.mark.slow])
                                    for name in ("cp2", "cp2-ep2", "dp2", "ep2")])
def test_glm53_first_step_gradients_equal_single_process_fp64(layout, first_step, capfd):
    """GLM-5.3 (KDA layers whose state crosses CP ranks as affine maps, their short convolutions' halo, the pooled
    indexer over the gathered keys, mHC streams, MoE) on packed documents: the one-process loss and every gradient,
    to fp64 rounding."""
    ref, got = first_step("glm53"), first_step("glm53", layout, capfd)
    assert abs(got["loss"] - ref["loss"]) <= 1e-12
    assert got["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        err = float((got["grads"][k] - g).norm() / g.norm().clamp(min=1e-30))
        assert err <= 1e-10, f"{layout} {k}: relative gradient error {err:.2e}"


@pytest.mark.slow
def test_glm53_layouts_are_exact_in_float64(tmp_path):
    """scripts/align.py on glm53-tiny (the embedded text): every layout's losses are one process's within 1e-9."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "10", "--layouts", "dp2", "ep2", "cp2", "cp2-ep2", "--out",
                  str(tmp_path), "--tolerance", "1e-9", "--extra", "--model.preset", "glm53-tiny", "--train.dtype",
                  "float64", "--data.type", "text"]) == 0


@pytest.mark.slow
def test_glm53_layouts_within_the_noise_floor(tmp_path):
    """scripts/align.py's fp32 rule on glm53-tiny (the embedded text): each layout within 2x its noise floor."""
    from scripts.align import main as align

    assert align(["--in-process", "--steps", "10", "--layouts", "dp2", "ep2", "cp2", "cp2-ep2", "--out", str(tmp_path),
                  "--extra", "--model.preset", "glm53-tiny", "--data.type", "text"]) == 0


# ---- DPO ----------------------------------------------------------------------------------------------------------

DPO_METRICS = ("loss", "margin", "accuracy", "chosen", "rejected", "logps_chosen", "logps_rejected", "sft_loss")


def _dpo_run(run_dir, preset: str, data: str, *args) -> tuple[list[dict], dict]:
    """A 3-step fp64 DPO run: (its step records, its final trained weights gathered into this process)."""
    from glm5f.ckpt.checkpoint import latest, load_params

    assert main(["--model.preset", preset, "--train.objective", "dpo", "--data.type", "preference", "--data.path",
                 data, "--data.batch_size", "4", "--data.seq_len", "32", "--train.steps", "3", "--train.dtype",
                 "float64", "--optim.warmup_steps", "0", "--optim.lr", "1e-2", "--eval.every", "0",
                 "--checkpoint.every", "3", "--checkpoint.dir", str(run_dir), *args]) == 0
    records = [r for r in read_metrics(run_dir) if "margin" in r]
    return records, load_params(latest(str(run_dir)))[1]


def layout_cases() -> list:
    """(preset, layouts, lora) of the post-training layout tests: two in CI (GLM-5 full over dp and ep, GLM-5.3
    LoRA over cp and cp x ep), the other six behind the slow marker."""
    cases = []
    for preset in ("glm5-tiny", "glm53-tiny"):
        for layouts, name in ((("dp2", "ep2"), "dp-ep"), (("cp2", "cp2-ep2"), "cp")):
            for lora in (False, True):
                ci = (preset, name, lora) in (("glm5-tiny", "dp-ep", False), ("glm53-tiny", "cp", True))
                cases.append(pytest.param(preset, layouts, lora, id=f"{preset}-{name}-{'lora' if lora else 'full'}",
                                          marks=[] if ci else [pytest.mark.slow]))
    return cases


@pytest.mark.parametrize("preset,layouts,lora", layout_cases())
def test_dpo_layouts_equal_one_process_fp64(preset, lora, layouts, tmp_path):
    """DPO (the reference forward beside the policy's, each pair's answer sums, the per-pair sigmoid) under
    dp_shard 2, ep 2, cp 2 (each answer's sums over the CP group, with gradients, before the sigmoid) and cp 2 x
    ep 2, full training (the reference a sharded copy of the start) and LoRA (the reference the base): 3 steps'
    loss, margin, accuracy, rewards, log-probabilities (and the full runs' --dpo.sft_weight term) and the final weights
    equal one process's within 1e-9."""
    from glm5f.core.params import flatten
    from test_dpo import pair_records, write

    cfg = glm5f.preset(preset)
    data = write(tmp_path / "pairs.jsonl", pair_records(cfg.vocab_size, n=4, seed=7))
    extra = ["--lora.rank", "4"] if lora else ["--dpo.sft_weight", "0.5"]
    ref_records, ref_params = _dpo_run(tmp_path / "one", preset, data, *extra)
    assert len(ref_records) == 3 and ref_records[-1]["loss"] < ref_records[0]["loss"]  # it learns: steps differ
    assert ("sft_loss" in ref_records[0]) == (not lora)
    ref_flat = flatten(ref_params)
    for layout in layouts:
        records, params = _dpo_run(tmp_path / layout, preset, data, *extra, *LAYOUTS[layout])
        assert len(records) == len(ref_records)
        for got, want in zip(records, ref_records):
            assert {k for k in DPO_METRICS if k in got} == {k for k in DPO_METRICS if k in want}
            for k in (k for k in DPO_METRICS if k in want):
                assert abs(got[k] - want[k]) <= 1e-9, f"{layout} step {want['step']} {k}: {got[k]} vs {want[k]}"
        flat = flatten(params)
        assert flat.keys() == ref_flat.keys()
        worst = max(float((flat[k] - w).abs().max()) for k, w in ref_flat.items())
        metric = max(abs(g[k] - w[k]) for g, w in zip(records, ref_records) for k in DPO_METRICS if k in w)
        print(f"{preset} {'lora' if lora else 'full'} {layout}: max |weight difference| {worst:.1e}, max |metric "
              f"difference| {metric:.1e}")
        assert worst <= 1e-9, f"{layout}: final weights differ from one process's by {worst:.2e}"


# ---- GRPO ---------------------------------------------------------------------------------------------------------

GRPO_METRICS = ("loss", "reward", "reward_std", "advantage_abs", "completion_length", "clip_fraction",
                "tis_capped_fraction", "rollout_logprob_gap", "rollout_logprob_gap_max", "kl")


def with_engine_records(recs: list[dict], cfg) -> None:
    """Each completion of the rollout records `recs` given the engine's log-probabilities, and half the groups (the
    odd ones) their experts: `_grpo_run` replays routing, and the other groups route themselves."""
    from glm5f.core.replay import replay_shapes

    g = torch.Generator().manual_seed(4)
    M, K = replay_shapes(cfg)["routing"]
    for i, rec in enumerate(recs):
        for c in rec["completions"]:
            c["logprobs"] = (-torch.rand(len(c["ids"]), generator=g, dtype=torch.float64) * 8).tolist()
            if i % 2:
                n = len(rec["prompt_ids"]) + len(c["ids"])
                c["routing"] = [[torch.randperm(cfg.n_routed_experts, generator=g)[:K].tolist() for _ in range(M)]
                                for _ in range(n - 1)]


def _grpo_run(run_dir, preset: str, data: str, *args) -> tuple[list[dict], dict]:
    """A 4-step fp64 GRPO run over a rollouts file, two updates per batch, with a KL to the start and the recorded
    experts replayed: (its step records, its final trained weights gathered into this process)."""
    from glm5f.ckpt.checkpoint import latest, load_params

    assert main(["--model.preset", preset, "--train.objective", "grpo", "--data.type", "rollouts", "--data.path",
                 data, "--data.batch_size", "2", "--data.seq_len", "16", "--train.steps", "4", "--train.dtype",
                 "float64", "--optim.warmup_steps", "0", "--optim.lr", "3e-2", "--eval.every", "0",
                 "--rl.updates_per_batch", "2", "--rl.kl_beta", "0.1", "--rl.replay", "routing",
                 "--checkpoint.every", "4",
                 "--checkpoint.dir", str(run_dir), *args]) == 0
    records = [r for r in read_metrics(run_dir) if "reward" in r]
    return records, load_params(latest(str(run_dir)))[1]


@pytest.mark.parametrize("preset,layouts,lora", layout_cases())
def test_grpo_layouts_equal_one_process_fp64(preset, layouts, lora, tmp_path):
    """GRPO over rollouts (group advantages on the global batch, the old policy's log-probabilities gathered from
    every rank's share, the engine's importance weights, the KL to the reference, per-completion token means
    under CP, the recorded experts of half the groups) under dp_shard 2, ep 2, cp 2 and cp 2 x ep 2, full
    training and LoRA: 4 steps' metrics and the final weights equal one process's within 1e-9."""
    from glm5f.core.params import flatten
    from test_grpo import rollout_records

    cfg = glm5f.preset(preset)
    recs = rollout_records(cfg.vocab_size, groups=4, size=2, seed=3)
    with_engine_records(recs, cfg)
    data = tmp_path / "rollouts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    extra = ["--lora.rank", "4", "--rl.loss", "grpo"] if lora else []  # both losses in the CI cases
    ref_records, ref_params = _grpo_run(tmp_path / "one", preset, str(data), *extra)
    assert len(ref_records) == 4 and ref_records[-1]["kl"] > 0 and ref_records[1]["clip_fraction"] > 0
    ref_flat = flatten(ref_params)
    for layout in layouts:
        records, params = _grpo_run(tmp_path / layout, preset, str(data), *extra, *LAYOUTS[layout])
        assert len(records) == len(ref_records)
        for got, want in zip(records, ref_records):
            for k in GRPO_METRICS:
                assert abs(got[k] - want[k]) <= 1e-9, f"{layout} step {want['step']} {k}: {got[k]} vs {want[k]}"
        flat = flatten(params)
        worst = max(float((flat[k] - w).abs().max()) for k, w in ref_flat.items())
        print(f"{preset} {'lora' if lora else 'full'} {layout}: max |weight difference| {worst:.1e}")
        assert worst <= 1e-9, f"{layout}: final weights differ from one process's by {worst:.2e}"


@pytest.mark.parametrize("layout", ["dp2", pytest.param("cp2", marks=pytest.mark.slow)])
def test_grpo_loss_rows_under_layouts_equal_one_process_fp64(layout, tmp_path):
    """--rl.advantage rloo, --rl.policy_loss gspo (each completion's sequence ratio; under CP summed over the ranks
    holding its parts), --rl.aggregation token_sum_norm, two updates per batch so the sequence ratios clip: 4 steps'
    metrics and the final weights equal one process's within 1e-9."""
    from glm5f.core.params import flatten
    from test_grpo import rollout_records

    cfg = glm5f.preset("glm5-tiny")
    recs = rollout_records(cfg.vocab_size, groups=4, size=3, seed=3)
    with_engine_records(recs, cfg)
    data = tmp_path / "rollouts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = ["--rl.advantage", "rloo", "--rl.policy_loss", "gspo", "--rl.aggregation", "token_sum_norm",
            "--rl.max_new_tokens", "6"]
    ref_records, ref_params = _grpo_run(tmp_path / "one", "glm5-tiny", str(data), *rows)
    assert len(ref_records) == 4 and max(r["seq_clip_fraction"] for r in ref_records) > 0
    records, params = _grpo_run(tmp_path / layout, "glm5-tiny", str(data), *rows, *LAYOUTS[layout])
    keys = ("loss", "reward", "advantage_abs", "completion_length", "seq_clip_fraction", "rollout_logprob_gap",
            "rollout_logprob_masked_fraction", "kl")
    for got, want in zip(records, ref_records, strict=True):
        for k in keys:
            assert abs(got[k] - want[k]) <= 1e-9, f"{layout} step {want['step']} {k}: {got[k]} vs {want[k]}"
    worst = max(float((flatten(params)[k] - w).abs().max()) for k, w in flatten(ref_params).items())
    assert worst <= 1e-9, f"{layout}: final weights differ from one process's by {worst:.2e}"


TRAJECTORY_ROWS = {"A": ["--rl.advantage", "dr_grpo", "--rl.policy_loss", "cispo", "--rl.aggregation", "sequence_mean"],
                   "B": ["--rl.advantage", "grpo", "--rl.policy_loss", "rollout_is", "--rl.aggregation", "token_mean"]}


@pytest.mark.parametrize("rows,layouts", [("A", ("dp2", "cp2-ep2")),
                                          pytest.param("B", ("ep2", "cp2"), marks=pytest.mark.slow)])
def test_trajectory_rows_under_layouts_equal_one_process_fp64(rows, layouts, tmp_path):
    """Multi-span trajectories (trained spans between untrained tool output, tests/test_trajectories.py) under the
    rows the plain-completion layout tests do not take (dr_grpo, cispo, sequence_mean; rollout_is), the engine's
    log-probabilities on every completion token and the experts of half the groups replayed: 4 steps' metrics and
    the final weights equal one process's within 1e-9."""
    from glm5f.core.params import flatten
    from test_trajectories import trajectories

    cfg = glm5f.preset("glm5-tiny")
    recs = [{"prompt_ids": samples[0]["prompt"], "completions": [
        {"ids": s["ids"], "loss_mask": s["mask"], "reward": s["reward"]} for s in samples]}
        for samples in trajectories(cfg.vocab_size, groups=4, size=3, seed=5)]
    with_engine_records(recs, cfg)
    data = tmp_path / "trajectories.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows_flags = [*TRAJECTORY_ROWS[rows], "--data.seq_len", "24"]  # the longest: a prompt of 6 and 11 tokens
    ref_records, ref_params = _grpo_run(tmp_path / "one", "glm5-tiny", str(data), *rows_flags)
    assert len(ref_records) == 4 and ref_records[-1]["kl"] > 0
    keys = [k for k in GRPO_METRICS if k in ref_records[0]]
    for layout in layouts:
        records, params = _grpo_run(tmp_path / layout, "glm5-tiny", str(data), *rows_flags,
                                    *LAYOUTS[layout])
        for got, want in zip(records, ref_records, strict=True):
            for k in keys:
                assert abs(got[k] - want[k]) <= 1e-9, f"{layout} step {want['step']} {k}: {got[k]} vs {want[k]}"
        worst = max(float((flatten(params)[k] - w).abs().max()) for k, w in flatten(ref_params).items())
        assert worst <= 1e-9, f"{layout}: final weights differ from one process's by {worst:.2e}"


def test_dpo_precomputed_reference_under_layouts_fp64(tmp_path):
    """--dpo.precompute_reference under dp_shard 2 (each rank its rows of the pass) and cp 2 x ep 2 (each answer's
    sums over the CP group, counted once; the table summed over ranks): 3 steps' metrics equal one process's with
    the reference in memory within 1e-9."""
    from test_dpo import pair_records, write

    data = write(tmp_path / "pairs.jsonl", pair_records(glm5f.preset("glm5-tiny").vocab_size, n=6, seed=7))
    ref_records, _ = _dpo_run(tmp_path / "one", "glm5-tiny", data)
    for layout in ("dp2", "cp2-ep2"):
        records, _ = _dpo_run(tmp_path / layout, "glm5-tiny", data, "--dpo.precompute_reference", *LAYOUTS[layout])
        assert os.path.isfile(tmp_path / layout / "dpo_reference.safetensors")
        for got, want in zip(records, ref_records, strict=True):
            for k in (k for k in DPO_METRICS if k in want):
                assert abs(got[k] - want[k]) <= 1e-9, f"{layout} step {want['step']} {k}: {got[k]} vs {want[k]}"


def test_on_policy_grpo_layouts_equal_one_process_fp64(tmp_path):
    """--data.type prompts under dp_shard 2 and ep 2: each rank samples its prompts with the whole weights (each
    prompt's group from its own generator), the ranks exchange the groups; 3 steps' rewards, losses and final weights
    equal one process's in fp64."""
    from glm5f.ckpt.checkpoint import latest, load_params
    from glm5f.core.params import flatten

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"word {i}:"}) + "\n" for i in range(6)))

    def run(name, *args):
        assert main(["--model.preset", "glm5-tiny", "--train.objective", "grpo", "--data.type", "prompts",
                     "--data.path", str(path), "--rl.reward", "glm5f.posttrain.rewards:lowercase_share", "--data.batch_size",
                     "2", "--rl.group_size", "3", "--rl.max_new_tokens", "5", "--data.seq_len", "24",
                     "--train.steps", "3", "--train.dtype", "float64", "--optim.lr", "1e-2",
                     "--optim.warmup_steps", "0", "--eval.every", "0", "--checkpoint.every", "3",
                     "--checkpoint.dir", str(tmp_path / name), *args]) == 0
        return read_metrics(tmp_path / name), flatten(load_params(latest(str(tmp_path / name)))[1])

    ref_records, ref = run("one")
    assert any(not r.get("skipped") for r in ref_records)
    for layout in ("dp2", "ep2"):
        records, got = run(layout, *LAYOUTS[layout])
        for a, b in zip(records, ref_records):
            for k in ("reward", "reward_std", "loss", "completion_length"):
                assert abs(a[k] - b[k]) <= 1e-9, f"{layout} step {b['step']} {k}: {a[k]} vs {b[k]}"
        assert max(float((got[k] - w).abs().max()) for k, w in ref.items()) <= 1e-9
