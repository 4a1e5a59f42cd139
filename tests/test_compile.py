"""--train.compile: each decoder layer is one torch.compile graph (no graph breaks; the glm5f custom ops stay
opaque inside it), and a compiled step computes what the eager step does, to fp32 summation-order noise."""

import math

import pytest
import torch
import tyro

import glm5f
from configs import Config
from conftest import ROOT, RUN_64, SCRIPT_ENV
from glm5f.model.env import make_env
from glm5f.train.loss import Step, step_grads
from glm5f.model.decoder import decoder_layer
from glm5f.parallel.layout import Layout
from train import main

# every layer kind: dense + full indexer, MoE + full indexer, MoE + shared indexer, an MTP layer; sparse below 8 keys
CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1, index_topk=8)
B, S = 2, 24


def step_of(*args: str) -> Step:
    run = tyro.cli(Config, use_underscores=True, args=[
        "--model.preset", "glm5-tiny", "--train.indexer_loss", "sparse", "--train.seq_aux_loss_coeff", "0.001",
        *args])
    return Step.of(run.train, CFG)


def packed_batch() -> dict:
    """Two rows: documents of 10 and 14 tokens, and one of 24."""
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(S)])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def test_every_decoder_layer_is_one_graph_without_breaks():
    params, step = glm5f.init_params(CFG), step_of()
    _, env = make_env(CFG, packed_batch(), torch.float32, objectives=step.objectives)
    x_BxSxD = torch.randn(B, S, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    carry, kinds = None, set()
    for layer, p in enumerate(params["model"]["layers"]):
        carry = None if layer >= CFG.num_hidden_layers or CFG.indexer_types[layer] == "full" else carry
        explained = torch._dynamo.explain(decoder_layer)(p, x_BxSxD, CFG, layer, env, carry)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (layer, explained.break_reasons)
        _, carry, aux = decoder_layer(p, x_BxSxD, CFG, layer, env, carry)
        kinds.add(("expert_idx" in aux, "indexer_loss" in aux, "seq_aux_loss" in aux))
    assert kinds == {(False, True, False), (True, True, True), (True, False, True)}, kinds


def relative_errors(got: dict, truth: dict) -> dict:
    """Per gradient: ||got - truth|| / ||truth||, in fp64."""
    return {k: float((got[k].double() - truth[k]).norm() / truth[k].norm().clamp(min=1e-300)) for k in truth}


def test_compiled_step_is_as_accurate_as_eager():
    """The bound: compilation fuses and reorders fp32 arithmetic, so the compiled step is held to the eager step's
    own accuracy: against the same step in fp64, each gradient's relative error at most twice the eager one's
    (measured: at most 1.4x; the indexer's gradients, a KL near zero, are 1e-5 off in both), and each metric's
    error at most twice the eager one's plus 4 fp32 epsilons of its scale: its value, but for the indexer loss,
    a KL near zero (1.2e-4 here) made of cross-entropies near ln(index_topk), whose rounding it inherits (eager
    and compiled are 1.0e-8 and 2.4e-8 from fp64 here, 2e-4 of the KL)."""
    params, batch = glm5f.init_params(CFG), packed_batch()
    eager = step_grads(params, batch, CFG, Layout(), step_of())
    compiled = step_grads(params, batch, CFG, Layout(), step_of("--train.compile"))
    wide = glm5f.core.params.map_with_path(lambda p, t: t.double() if t.is_floating_point() else t, params)
    truth = step_grads(wide, batch, CFG, Layout(), step_of("--train.dtype", "float64"))
    eager_err, compiled_err = relative_errors(eager[1], truth[1]), relative_errors(compiled[1], truth[1])
    worse = {k: (compiled_err[k], eager_err[k]) for k in truth[1] if compiled_err[k] > 2 * eager_err[k]}
    assert not worse, worse
    eps = torch.finfo(torch.float32).eps
    for k, v in truth[0].items():
        scale = math.log(CFG.index_topk) if k == "indexer_loss" else abs(v)
        assert abs(compiled[0][k] - v) <= 2 * abs(eager[0][k] - v) + 4 * eps * scale, (k, compiled[0][k], v)
    for k in eager[2]:
        assert torch.equal(compiled[2][k], eager[2][k]), k  # the same routing


def test_grouped_mm_op_passes_opcheck_and_has_torchs_gradients():
    """glm5f::grouped_mm (what lets fp32 MoE layers trace) computes torch's grouped GEMM and, bit for bit, the
    gradients autograd takes through it; empty experts included."""
    from glm5f.model.moe import grouped_mm
    g = torch.Generator().manual_seed(0)
    x_MxIn = torch.randn(37, 16, generator=g, requires_grad=True)
    w_ExOutxIn = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    offs_E = torch.tensor([10, 10, 30, 37], dtype=torch.int32)
    torch.library.opcheck(grouped_mm, (x_MxIn, w_ExOutxIn, offs_E))
    y_MxOut = grouped_mm(x_MxIn, w_ExOutxIn, offs_E)
    ref = torch.nn.functional.grouped_mm(x_MxIn, w_ExOutxIn.transpose(-1, -2), offs=offs_E)
    assert torch.equal(y_MxOut, ref)
    dy = torch.randn(ref.shape, generator=g)
    for got, want in zip(torch.autograd.grad(y_MxOut, [x_MxIn, w_ExOutxIn], dy),
                         torch.autograd.grad(ref, [x_MxIn, w_ExOutxIn], dy)):
        assert torch.equal(got, want)


# ---- GLM-5.3: KDA (its custom op and autograd Functions), DSA with the pooled indexer, mHC streams -------------

GLM53 = glm5f.preset("glm53-tiny")


def test_glm53_every_decoder_layer_is_one_graph_without_breaks():
    """glm53-tiny's layers (KDA + dense, DSA with the pooled indexer and its loss + MoE, KDA + MoE) on packed rows
    of mHC streams: each one graph, no break."""
    run = tyro.cli(Config, use_underscores=True, args=[
        "--model.preset", "glm53-tiny", "--train.indexer_loss", "sparse", "--train.seq_aux_loss_coeff", "0.001"])
    params, step = glm5f.init_params(GLM53), Step.of(run.train, GLM53)
    _, env = make_env(GLM53, packed_batch(), torch.float32, objectives=step.objectives)
    x_BxSxNxD = torch.randn(B, S, GLM53.hc_mult, GLM53.hidden_size, generator=torch.Generator().manual_seed(1))
    carry, kinds = None, set()
    for layer, p in enumerate(params["model"]["layers"]):
        explained = torch._dynamo.explain(decoder_layer)(p, x_BxSxNxD, GLM53, layer, env, carry)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (layer, explained.break_reasons)
        _, carry, aux = decoder_layer(p, x_BxSxNxD, GLM53, layer, env, carry)
        kinds.add((glm5f.core.layers.layer_spec(GLM53, layer).attention, "indexer_loss" in aux, "expert_idx" in aux))
    assert kinds == {("kda", False, False), ("mla_dsa", True, True), ("kda", False, True)}, kinds


@pytest.mark.slow
def test_glm53_compiled_bf16_training_learns(tmp_path):
    """glm53-tiny trained under --train.compile in bfloat16 (with the pooled indexer's loss): every loss finite,
    the last steps' below the first, and each step's loss within bf16 noise of the eager bf16 run's."""
    from conftest import cli
    from train import train

    args = ["--model.preset", "glm53-tiny", "--data.batch_size", "2", "--data.seq_len", "64", "--train.steps", "12",
            "--train.dtype", "bfloat16", "--train.indexer_loss", "sparse",
            "--checkpoint.every", "0", "--eval.every", "0"]
    eager = train(cli(*args, "--checkpoint.dir", str(tmp_path / "eager")))
    compiled = train(cli(*args, "--train.compile", "--checkpoint.dir", str(tmp_path / "compiled")))
    losses = [r["loss"] for r in compiled]
    assert all(math.isfinite(v) for v in losses) and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert all(math.isfinite(r["indexer_loss"]) for r in compiled)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(eager, compiled)) < 0.05


def test_the_first_compiled_step_and_evaluation_are_announced_before_they_compile(monkeypatch, tmp_path, capsys):
    """--train.compile: a line says the step is compiling before the first step runs (in a resumed run too: a new
    process compiles again) and another before the first evaluation (no gradients: other graphs), each once;
    without --train.compile neither. What was printed is read when the step and the evaluation are called."""
    from glm5f.run import loop

    calls = []

    def spy(name, real):
        def call(*args, **kwargs):
            step = args[4]  # step_grads and eval_loss: (params, batch(es), cfg, layout, step, ...)
            calls.append((name, step.compile, capsys.readouterr().out))
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(glm5f.train.step, "step_grads", spy("step", glm5f.train.step.step_grads))
    monkeypatch.setattr(loop, "eval_loss", spy("eval", loop.eval_loss))
    monkeypatch.setattr(glm5f.model.decoder, "compiled_decoder_layer", lambda: glm5f.model.decoder.decoder_layer)  # eager: fast
    flags = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64[:4], "--train.log_every", "1",
             "--eval.every", "1", "--eval.batches", "1", "--checkpoint.dir", str(tmp_path / "run")]
    step_line = "compiling the step (the first step takes a while; the next ones reuse it)...\n"
    eval_line = "compiling the evaluation (the first one takes a while; the next ones reuse it)...\n"
    assert main(flags + ["--train.steps", "2", "--train.compile"]) == 0
    assert [(name, compiled) for name, compiled, _ in calls] == [("step", True), ("eval", True)] * 2
    (_, _, before_step), (_, _, before_eval), (_, _, later_step), (_, _, later_eval) = calls
    assert before_step.endswith(step_line) and before_eval == eval_line, (before_step, before_eval)
    assert "compiling" not in later_step + later_eval + capsys.readouterr().out
    calls.clear()
    assert main(flags + ["--train.steps", "3", "--train.compile", "--checkpoint.resume", "latest"]) == 0
    assert calls[0][2].endswith(step_line) and calls[1][2] == eval_line
    calls.clear()
    assert main(flags + ["--train.steps", "4", "--checkpoint.resume", "latest"]) == 0
    assert [compiled for _, compiled, _ in calls] == [False, False]
    assert "compiling" not in "".join(out for _, _, out in calls) + capsys.readouterr().out


@pytest.mark.slow
def test_the_compiling_line_reaches_a_pipe_before_the_first_step_ends(tmp_path):
    """A real `train.py --train.compile` (one layer; minutes on a loaded CPU) writing to a pipe, as under a job
    scheduler or `| tee`: the compiling line arrives while the first step still compiles (no metrics yet)."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--model.preset", "glm5-tiny", "--model.num_hidden_layers",
                             "1", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "16",
                             "--train.steps", "1", "--eval.every", "0", "--train.compile", "--checkpoint.dir",
                             str(run_dir)], cwd=ROOT, env={k: v for k, v in SCRIPT_ENV.items() if k != "PYTHONUNBUFFERED"},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # buffered, as a user's
    try:
        for line in proc.stdout:
            if line.startswith("compiling the step"):
                assert not (run_dir / "metrics.jsonl").exists(), "the line came after the first step"
                break
        else:
            raise AssertionError("no compiling line")
        proc.stdout.read()
        assert proc.wait(timeout=900) == 0 and (run_dir / "metrics.jsonl").exists()
    finally:
        proc.kill()
