"""No host synchronisation in a training step: the step's forward and backward (`loss.device_step`, what
`step_grads` runs before its one read of the metrics) traced on FakeTensors, which have no values to read.

Under FakeTensorMode every read of a tensor's value (`.item()`, `int(t)`, `.tolist()`) and every op whose output
shape depends on values (bincount without a fixed size, boolean indexing, nonzero) raises, so a step that traces
through is one a device runs without waiting for it. The custom ops run their fake (shape-only) implementations.
"""

import pytest
import torch
import tyro
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils import _pytree as pytree

import glm5f
from configs import Config
from glm5f.model import moe
from glm5f.train.loss import TERMS, Step, device_step
from glm5f.parallel.layout import Layout

CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1, index_topk=8)  # sparse below 8 keys, MoE, MTP
B, S = 2, 24
HOST_READS = (DataDependentOutputException, DynamicOutputShapeException)


def step_of(*args: str) -> Step:
    """The Step a train run with every objective on (and `args`) takes, as train.py makes it."""
    run = tyro.cli(Config, use_underscores=True, args=[
        "--model.preset", "glm5-tiny", "--train.seq_aux_loss_coeff", "0.001", "--train.mtp_loss_weight", "0.3",
        *args])
    return Step.of(run.train, CFG)


def batch_of(kind: str) -> dict:
    """A batch of B rows of S tokens: "packed" (documents of 10 and 14, 5, 11 and 8 tokens) or "padding" (the
    second row's last 7 tokens)."""
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    if kind == "packed":
        pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                           torch.cat([torch.arange(5), torch.arange(11), torch.arange(8)])])
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    am = torch.ones(B, S, dtype=torch.long)
    am[1, 17:] = 0
    return {"input_ids": ids, "labels": ids.masked_fill(am == 0, glm5f.IGNORE_INDEX), "attention_mask": am,
            "position_ids": torch.arange(S).expand(B, S)}


def fake_step(params: dict, batch: dict, step: Step):
    """`device_step` of one process on FakeTensor copies of params and batch (raises on any host read)."""
    mode = FakeTensorMode()
    fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    params, batch = pytree.tree_map(fake, params), pytree.tree_map(fake, batch)
    with mode:
        return device_step(params, batch, CFG, Layout(torch.device("cpu")), step)


@pytest.mark.parametrize("kind,args", [
    ("packed", ["--train.indexer_loss", "sparse"]),
    ("padding", ["--train.indexer_loss", "dense", "--train.indexer_target", "mean"]),
    ("packed", ["--train.indexer_loss", "dense", "--train.grad_accum", "2", "--train.activation_checkpointing"]),
    ("padding", ["--train.indexer_loss", "sparse", "--train.dtype", "bfloat16"]),
])
def test_a_training_step_reads_nothing_from_the_device(kind, args):
    step = step_of(*args)
    assert set(step.coeffs) == {"mtp_loss", "indexer_loss", "seq_aux_loss"}, step.coeffs  # every term on
    params = glm5f.init_params(CFG)
    metrics, grads, counts = fake_step(params, batch_of(kind), step)
    assert set(metrics) == {*step.objective.metrics, *(k for k, t in TERMS.items() if t.on(step.objectives))}
    assert set(grads) == set(step.trained(params)) and any(".indexer." in p for p in grads)
    assert len(counts) == sum(CFG.is_moe(i) for i in range(CFG.num_hidden_layers + 1))
    assert all(g.shape == params_g.shape for g, params_g in zip(grads.values(), map(glm5f.flatten(params).get,
                                                                                       grads)))


READS = {  # a host read of each kind, put into the MoE router's scores
    "item": lambda s: s * s.sum().item(),
    "int": lambda s: s[:, :int(s.argmax(-1).max()) + 1].sum(-1, keepdim=True) + s,
    "tolist": lambda s: s + len(s.argmax(-1).tolist()),
    "bincount": lambda s: s + torch.bincount(s.argmax(-1)).sum(),
    "boolean index": lambda s: s + s[s > 0.5].sum(),
    "nonzero": lambda s: s + s.nonzero().shape[0],
}


@pytest.mark.parametrize("read", READS)
def test_the_detector_fails_on_each_kind_of_host_read(read, monkeypatch):
    """The same step with one host read added in the MoE router raises, and the step without it (the eager
    run) computes: what the test above passes is not a step the detector cannot see into."""
    router = moe.router_scores
    monkeypatch.setattr(moe, "router_scores", lambda p, x: READS[read](router(p, x)))
    params, batch, step = glm5f.init_params(CFG), batch_of("packed"), step_of("--train.indexer_loss", "sparse")
    assert torch.isfinite(device_step(params, batch, CFG, Layout(torch.device("cpu")), step)[0]["loss"])
    with pytest.raises(HOST_READS):
        fake_step(params, batch, step)
