"""--train.compile: each decoder layer is one torch.compile graph (no graph breaks; the glm5f custom ops stay
opaque inside it), and a compiled step computes what the eager step does, to fp32 summation-order noise."""

import dataclasses

import pytest
import torch
import tyro

import glm5f
from configs import Config
from glm5f.env import make_env
from glm5f.loss import Step, step_grads
from glm5f.model import decoder_layer
from glm5f.parallel import Layout

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
    carry = None
    for layer, p in enumerate(params["model"]["layers"]):
        carry = None if CFG.indexer_types[layer] == "full" or layer >= CFG.num_hidden_layers else carry
        explained = torch._dynamo.explain(decoder_layer)(p, x_BxSxD, CFG, layer, env, carry)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (layer, explained.break_reasons)
        _, carry, aux = decoder_layer(p, x_BxSxD, CFG, layer, env, carry)
        assert layer == 1 or CFG.is_moe(layer) == ("expert_idx" in aux)


def relative_differences(a: dict, b: dict) -> dict:
    """Per gradient: ||a - b|| / ||b||."""
    return {k: float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in b}


@pytest.mark.parametrize("remat", [False, True])
def test_compiled_step_equals_eager_within_the_summation_order_noise(remat):
    """The bound: compilation fuses and reorders fp32 arithmetic, so it is held to what another summation order
    does to the eager step, the same step with its batch in two micro-batches (each gradient's sum over tokens in
    two parts): twice that, per gradient, plus an ulp-scale floor for leaves whose two orders agree exactly."""
    params, batch = glm5f.init_params(CFG), packed_batch()
    args = ["--train.activation_checkpointing"] if remat else []
    eager = step_grads(params, batch, CFG, Layout(), step_of(*args))
    split = step_grads(params, batch, CFG, Layout(), step_of(*args, "--train.grad_accum", "2"))
    compiled = step_grads(params, batch, CFG, Layout(), dataclasses.replace(step_of(*args), compile=True))
    noise = relative_differences(split[1], eager[1])
    got = relative_differences(compiled[1], eager[1])
    eps = torch.finfo(torch.float32).eps
    worse = {k: (got[k], noise[k]) for k in got if got[k] > 2 * noise[k] + 16 * eps}
    assert not worse, worse
    for k, v in eager[0].items():
        assert abs(compiled[0][k] - v) <= 2 * abs(split[0][k] - v) + 16 * eps * abs(v), (k, compiled[0][k], v)
    assert set(compiled[2]) == set(eager[2])
    for k in eager[2]:
        assert torch.equal(compiled[2][k], eager[2][k]), k  # the routing is the same
