"""glm5f/model/head.py: the next-token and MTP targets (against a Python loop over their rule) and the chunked head
(`head_loss_sum`: its loss and gradients against autograd through the whole logits, in fp64 and in narrower dtypes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from conftest import rel_err
from glm5f.model.decoder import head_logits
from glm5f.model.head import cross_entropy_sum, head_loss_sum, mtp_targets


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


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.integers(0, 2**16), st.integers(1, 3), st.integers(2, 14), st.booleans())
def test_mtp_targets_stay_within_documents_and_skip_padding(seed, depth, S, padded):
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



# ---- the LM head and its cross-entropy in chunks (loss.head_loss_sum) ---------------------------------------------

def whole_logits_loss_sum(head, x_BxSxD, targets_BxS, eps, chunk_elems=None):
    """`head_loss_sum` as it was before chunks: autograd through the whole [tokens, vocab] logits."""
    return cross_entropy_sum(head_logits(head, x_BxSxD, eps), targets_BxS)[0]


def head_inputs(dtype, weight_dtype=None, V=96, D=24, B=2, S=23, seed=0):
    """(head, hidden states [B, S, D], targets with some IGNORE_INDEX) drawn in fp64 and cast, leaves requiring
    grad; the norm's scale perturbed around 1."""
    g = torch.Generator().manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    head = {"norm": (1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(weight_dtype).requires_grad_(),
            "weight": (0.3 * torch.randn(V, D, generator=g, dtype=torch.float64)).to(weight_dtype).requires_grad_()}
    x = torch.randn(B, S, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[torch.rand(B, S, generator=g) < 0.2] = glm5f.IGNORE_INDEX
    return head, x, targets


def head_grads(fn, head, x, targets, **kw):
    value = fn(head, x, targets, 1e-5, **kw)
    return value.detach(), torch.autograd.grad(value, [x, head["norm"], head["weight"]])


@pytest.mark.parametrize("rows", [1, 5, 46, 1000])
def test_head_loss_in_chunks_equals_the_whole_logits_in_fp64(rows):
    """fp64: the loss and the gradients of the hidden states, the norm and the head of chunks of 1, 5 (the last
    one short), 46 (all tokens) and more rows equal autograd through the whole logits within 1e-12."""
    head, x, targets = head_inputs(torch.float64)
    want, want_g = head_grads(whole_logits_loss_sum, head, x, targets)
    got, got_g = head_grads(head_loss_sum, head, x, targets, chunk_elems=rows * 96)
    assert abs(float(got - want)) <= 1e-12 * abs(float(want))
    for name, g, w in zip(("x", "norm", "head"), got_g, want_g):
        assert rel_err(g, w) <= 1e-12, f"{name}: {rel_err(g, w):.2e}"


@pytest.mark.parametrize("dtypes", [(torch.float32, None), (torch.float32, torch.float64),
                                    (torch.bfloat16, torch.float32)])
def test_head_loss_in_chunks_is_as_close_to_fp64_as_the_whole_logits(dtypes):
    """fp32 and bf16 activations (with fp64 / fp32 weights as --train.reduce_dtype makes them): chunks of 5 rows
    are within twice the whole-logits path's own error of the fp64 values (loss and every gradient), and one
    chunk holding every token gives the whole-logits values bit for bit."""
    dtype, weight_dtype = dtypes
    ref_head, ref_x, targets = head_inputs(torch.float64)
    ref, ref_g = head_grads(whole_logits_loss_sum, ref_head, ref_x, targets)
    head, x, _ = head_inputs(dtype, weight_dtype)
    whole, whole_g = head_grads(whole_logits_loss_sum, head, x, targets)
    got, got_g = head_grads(head_loss_sum, head, x, targets, chunk_elems=5 * 96)
    floor = abs(float(whole - ref)) / abs(float(ref))
    assert abs(float(got - ref)) / abs(float(ref)) <= 2 * floor + 2 * torch.finfo(dtype).eps
    for name, g, w, r in zip(("x", "norm", "head"), got_g, whole_g, ref_g):
        floor = rel_err(w.double(), r)
        assert 0 < floor < 0.05
        assert rel_err(g.double(), r) <= 2 * floor, f"{name}: {rel_err(g.double(), r):.2e} vs floor {floor:.2e}"
    one, one_g = head_grads(head_loss_sum, head, x, targets, chunk_elems=1000 * 96)
    assert torch.equal(one, whole) and all(torch.equal(a, b) for a, b in zip(one_g, whole_g))


def test_head_loss_in_chunks_gives_only_the_gradients_asked_for():
    """A frozen head (LoRA runs) and frozen hidden states: the gradients of what requires grad are the
    whole-logits ones, and nothing is made for the rest (the head's [V, D] gradient not at all)."""
    head, x, targets = head_inputs(torch.float64)
    head["weight"].requires_grad_(False)
    want = torch.autograd.grad(whole_logits_loss_sum(head, x, targets, 1e-5), [x, head["norm"]])
    got = torch.autograd.grad(head_loss_sum(head, x, targets, 1e-5, chunk_elems=5 * 96), [x, head["norm"]])
    assert all(rel_err(g, w) <= 1e-12 for g, w in zip(got, want))
    x.requires_grad_(False)
    (g_norm,) = torch.autograd.grad(head_loss_sum(head, x, targets, 1e-5, chunk_elems=5 * 96), [head["norm"]])
    (w_norm,) = torch.autograd.grad(whole_logits_loss_sum(head, x, targets, 1e-5), [head["norm"]])
    assert rel_err(g_norm, w_norm) <= 1e-12
