"""glm5f.kernels.dsa' custom ops (opcheck; CPU: blocked against unblocked, the indexer against its formula), and the
Triton kernels of glm5f.kernels.triton_dsa (interpreted, or on a GPU) against an fp64 oracle in fp32 (the interpreter's bf16 is wrong)."""

import os
import sys
import warnings
from unittest import mock

# The Triton tests run interpreted on the CPU; GLM5F_KERNEL_DEVICE=cuda runs them compiled on a GPU instead.
DEVICE = os.environ.get("GLM5F_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, so before glm5f.kernels.triton_dsa is imported

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

import glm5f
from glm5f.kernels import dsa as kernels
from glm5f.kernels import sparse_union
from glm5f.model.env import Mask, make_mask
from glm5f.kernels.dsa import sparse_attention, sparse_attention_unblocked, topk_first

try:
    from glm5f.kernels import triton_dsa
except ImportError as e:
    triton_dsa, NO_TRITON = None, f"triton is not importable ({e}); it installs on Linux x86_64 with the test extra"

SCALE = 0.3
# how the CPU core's blocks attend: all through the union GEMM, all by the per-query gather, or by the union's width
PATHS = {"union": lambda K, H: 1 << 30, "gather": lambda K, H: 0, "width": lambda K, H: K + K // 2}


def selection_case(B=2, S=7, T=19, H=5, K=11, R=24, P=5, mask="causal", bias=False, seed=0, q_dtype=torch.float64,
                   latent_dtype=torch.float64):
    """(q, latent, idx, allowed, bias) of a DSA layer: idx are the top-k of random index scores under the mask (so
    queries seeing fewer than K keys get masked picks), allowed = the mask at idx. The S queries are the last S of
    the T keys. mask: "causal", "padding" (some keys invalid; query 0 sees none), "documents" (packed segments)."""
    g = torch.Generator().manual_seed(seed)
    q_index = torch.arange(T - S, T)
    key_valid = q_segment = k_segment = None
    if mask == "padding":
        key_valid = torch.rand(B, T, generator=g) > 0.3
        key_valid[:, : T - S + 1] = False
    elif mask == "documents":
        k_segment = (torch.rand(B, T, generator=g) < 0.25).cumsum(-1)
        q_segment = k_segment[:, T - S:]
    m = Mask(q_index, T, key_valid=key_valid, q_segment=q_segment, k_segment=k_segment)
    scores = torch.rand(B, S, T, generator=g).masked_fill_(~m.rows(0, S), float("-inf"))
    idx = kernels.topk_first(scores, K)
    q = torch.randn(B, S, H, R + P, generator=g, dtype=torch.float64).to(q_dtype)
    latent = torch.randn(B, T, R + P, generator=g, dtype=torch.float64).to(latent_dtype)
    b = torch.randn(B, S, K, generator=g) if bias else None
    return q, latent, idx, m.at(idx), b


# ---- the CPU ops ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_sparse_mla(bias):
    q, latent, idx, allowed, b = selection_case(mask="padding", bias=bias, q_dtype=torch.float32)
    torch.library.opcheck(kernels.sparse_mla, (q.requires_grad_(), latent.requires_grad_(), idx, allowed, b,
                                               SCALE, 24))


def test_opcheck_sparse_mla_backward():
    q, latent, idx, allowed, b = selection_case(mask="documents", bias=True)
    out, lse = kernels.sparse_mla(q, latent, idx, allowed, b, SCALE, 24)
    torch.library.opcheck(kernels.sparse_mla_backward, (torch.randn_like(out), q, latent, idx, allowed, b, out, lse,
                                                        SCALE, 24))


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_topk_attention(bias):
    """The dense top-k form's op and its backward against their fake kernels, with values a strided view of kv_b's
    output (as `attention.expand_latent` gives them: what torch.compile traces)."""
    B, S, T, H, D, V, K = 2, 6, 9, 3, 8, 4, 4
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(B, T, H, D + V, generator=g).transpose(1, 2)
    k, v = kv[..., :D].contiguous(), kv[..., D:]
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    allowed = torch.rand(B, S, K, generator=g) > 0.3
    b = torch.randn(B, S, K, generator=g) if bias else None
    q = torch.randn(B, S, H, D, generator=g)
    torch.library.opcheck(kernels.topk_attention, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), idx,
                                                   allowed, b, SCALE))
    q, k, v = q.detach(), k.detach(), v.detach()
    out = kernels.topk_attention(q, k, v, idx, allowed, b, SCALE)
    torch.library.opcheck(kernels.topk_attention_backward, (torch.randn_like(out), q, k, v, idx, allowed, b, out,
                                                            SCALE))


def test_opcheck_indexer_topk():
    B, S, T, I, J = 2, 6, 9, 3, 8
    q_index = torch.arange(T - S, T)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0] * 9])
    args = (torch.randn(B, S, I, J), torch.randn(B, S, I), torch.randn(B, T, J), q_index,
            torch.rand(1, T) > 0.2, seg[:, T - S:], seg, None, None, 4)
    torch.library.opcheck(kernels.indexer_topk, args)
    dense = torch.rand(B, S, T) > 0.5
    torch.library.opcheck(kernels.indexer_topk, args[:7] + (dense, torch.randn(1, S, T), 4))


def test_lse_is_the_softmax_normaliser():
    q, latent, idx, allowed, b = selection_case(mask="documents", bias=True)
    out, lse = kernels.sparse_mla(q, latent, idx, allowed, b, SCALE, 24)
    sel = kernels.gather_rows(latent, idx, q.dtype)
    scores = torch.einsum("bshc,bskc->bshk", q, sel) * SCALE + b[:, :, None]
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())
    assert lse.dtype == torch.float32 and not lse.requires_grad


def test_compiles_without_graph_breaks():
    """The ops are opaque to torch.compile: one graph, forward and backward as in eager."""
    q, latent, idx, allowed, b = selection_case(mask="documents", bias=True, q_dtype=torch.float32,
                                                latent_dtype=torch.float32)

    def loss(qq, ll):
        picks = kernels.indexer_topk(qq[..., :8], qq[..., 0], ll[..., :8], torch.arange(12, 19), None, None, None,
                                     None, None, 4)
        return kernels.sparse_attention(qq, ll, idx, allowed, SCALE, 24, b).square().sum() + picks.sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        qq, ll = q.clone().requires_grad_(), latent.clone().requires_grad_()
        fn(qq, ll).backward()
        grads.append((qq.grad, ll.grad))
    for a, t in zip(*grads):
        assert torch.equal(a, t)


def test_functorch_runs_the_oracle():
    q, latent, idx, allowed, b = selection_case(mask="padding", bias=True)

    def loss(qq, ll):
        return kernels.sparse_attention(qq, ll, idx, allowed, SCALE, 24, b).square().sum()

    dq, dlatent = torch.func.grad(loss, argnums=(0, 1))(q, latent)
    qq, ll = q.clone().requires_grad_(), latent.clone().requires_grad_()
    loss(qq, ll).backward()
    torch.testing.assert_close(dq, qq.grad)
    torch.testing.assert_close(dlatent, ll.grad)


def test_errors_say_what_to_fix():
    q, latent, idx, allowed, b = selection_case()
    with pytest.raises(ValueError, match="int64 idx"):
        kernels.sparse_mla(q, latent, idx.int(), allowed, b, SCALE, 24)
    with pytest.raises(ValueError, match="as wide"):
        kernels.sparse_mla(q, latent.float(), idx, allowed, b, SCALE, 24)
    with pytest.raises(ValueError, match=r"latent must be \[2, T, 29\]"):
        kernels.sparse_mla(q, latent[..., :-1], idx, allowed, b, SCALE, 24)
    with pytest.raises(ValueError, match="pass min"):
        kernels.indexer_topk(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3), torch.randn(1, 5, 4), torch.arange(2),
                             None, None, None, None, None, 6)


def test_missing_triton_warns_once_and_cuda_runs_the_torch_code(monkeypatch):
    monkeypatch.delattr(sys.modules["glm5f.kernels"], "triton_dsa", raising=False)
    monkeypatch.setitem(sys.modules, "glm5f.kernels.triton_dsa", None)  # importing it raises ImportError
    kernels.triton_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="triton is not importable.*blocked torch code"):
            assert kernels.triton_kernels() is None
        q, latent, idx, allowed, b = selection_case(mask="padding", bias=True, q_dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            ours = kernels.sparse_mla_cuda(q, latent, idx, allowed, b, SCALE, 24)
        theirs = kernels.sparse_mla(q, latent, idx, allowed, b, SCALE, 24)
        assert all(torch.equal(a, t) for a, t in zip(ours, theirs))
    finally:
        kernels.triton_kernels.cache_clear()


INDEXER_MASKS = ["documents", "padding", "float4d"]


@pytest.mark.parametrize("mask_kind", INDEXER_MASKS)
@pytest.mark.parametrize("chunk_elems", [None, 1 << 8])
def test_indexer_op_is_the_formula(mask_kind, chunk_elems):
    """The op's picks are the top-k of sum_i w_i relu(q_i . k / sqrt(J)) (+ bias) over the allowed keys, computed
    here in fp64 from the formula (random inputs: no ties but among masked keys, which go to the lower index), in
    one chunk or in chunks of 2 queries; without the ReLU, the head weights or the scale the picks differ."""
    B, S, I, J, K = 2, 12, 4, 16, 6
    g = torch.Generator().manual_seed(2)
    q, w = torch.randn(B, S, I, J, generator=g), torch.randn(B, S, I, generator=g)
    keys = torch.randn(B, S, J, generator=g)
    positions = torch.arange(S).expand(B, S)
    if mask_kind == "documents":
        mask = make_mask(None, torch.tensor([list(range(5)) + list(range(7)), list(range(12))]))
    elif mask_kind == "padding":
        mask = make_mask(torch.tensor([[0] * 3 + [1] * 9, [1] * 12]), positions)
    else:
        additive = torch.randn(1, 1, S, S, generator=g).masked_fill(torch.rand(1, 1, S, S, generator=g) < 0.4,
                                                                     torch.finfo(torch.float32).min)
        mask = make_mask(additive, positions[:1])
        assert mask.bias is not None
    args = (q, w, keys, mask.q_index, mask.key_valid, mask.q_segment, mask.k_segment, mask.dense, mask.bias, K)
    if chunk_elems is None:
        ours = kernels.indexer_topk(*args)
    else:  # the op's CPU code in chunks of 2 queries
        ours = kernels._indexer_topk_torch(*args, chunk_elems=chunk_elems)

    def formula(relu=True, heads=True, scale=J ** -0.5):
        z = torch.einsum("bsij,btj->bsit", q.double(), keys.double()) * scale
        z = z.relu() if relu else z
        scores = torch.einsum("bsi,bsit->bst", w.double() if heads else torch.ones_like(w.double()), z)
        if mask.bias is not None:
            scores = scores + mask.bias
        scores = scores.masked_fill(~mask.rows(0, S), float("-inf"))
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]

    assert ours.dtype == torch.int64 and torch.equal(ours.sort(-1).values, formula().sort(-1).values)
    for wrong in (formula(relu=False), formula(heads=False), formula(scale=-1.0)):
        assert not torch.equal(ours.sort(-1).values, wrong.sort(-1).values)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 2), st.integers(1, 40), st.integers(1, 12), st.integers(1, 3), st.integers(1, 50),
       st.sampled_from(["causal", "padded", "packed", "bias"]), st.booleans(), st.sampled_from(list(PATHS)),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_blocked_sparse_core_equals_unblocked_oracle(B, T, K, H, block, kind, cp_shard, path, repeat, seed):
    """The blocked core (query blocks, gathers recomputed in the backward) against the all-at-once oracle, fp64:
    values and both gradients, ragged last blocks, padding, packed documents, an additive bias, a CP-like shard
    of the queries (global keys, local queries); each block through the union GEMM or the per-query gather (or
    either, by the union's width), and with a row selected twice by a query (counted twice, by the gather)."""
    g = torch.Generator().manual_seed(seed)
    K, R, P = min(K, T), 6, 2
    q_index = torch.arange(T)
    if cp_shard and T > 1:  # this rank's queries: a contiguous share of the sequence, as a CP chunk
        a = int(torch.randint(0, T - 1, (1,), generator=g))
        q_index = q_index[a:int(torch.randint(a + 1, T + 1, (1,), generator=g))]
    S = q_index.numel()
    key_valid = torch.rand(B, T, generator=g) > 0.3 if kind == "padded" else None
    seg = torch.randint(0, 3, (B, T), generator=g).sort(-1).values if kind == "packed" else None
    mask = Mask(q_index, T, key_valid=key_valid, q_segment=None if seg is None else seg[:, q_index], k_segment=seg)
    scores = torch.randn(B, S, T, generator=g).masked_fill(~mask.rows(0, S), float("-inf"))
    idx = topk_first(scores, K)
    if repeat and K > 1:
        idx[:, ::2, -1] = idx[:, ::2, 0]
    allowed = mask.at(idx)
    bias = torch.randn(B, S, K, generator=g, dtype=torch.float64) if kind == "bias" else None
    q = torch.randn(B, S, H, R + P, generator=g, dtype=torch.float64).requires_grad_()
    latent = torch.randn(B, T, R + P, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(B, S, H, R, generator=g, dtype=torch.float64)
    with mock.patch.object(sparse_union, "union_width", PATHS[path]):
        blocked = sparse_attention(q, latent, idx, allowed, 0.7, R, bias, block=block)
        grads = torch.autograd.grad((blocked * w).sum(), (q, latent))
    oracle = sparse_attention_unblocked(q, latent, idx, allowed, 0.7, R, bias)
    assert torch.allclose(blocked, oracle, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads, torch.autograd.grad((oracle * w).sum(), (q, latent))):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


def test_blocked_sparse_core_under_torch_func_matches_autograd():
    """torch.func.grad and vmap route through the unblocked oracle; they agree with eager autograd through the
    blocked core."""
    g = torch.Generator().manual_seed(0)
    B, S, T, H, R, P, K = 2, 9, 11, 3, 6, 2, 4
    q = torch.randn(B, S, H, R + P, generator=g, dtype=torch.float64)
    latent = torch.randn(B, T, R + P, generator=g, dtype=torch.float64)
    idx = topk_first(torch.randn(B, S, T, generator=g), K)
    allowed = idx <= torch.arange(S)[None, :, None]
    f = lambda q_, lat_: sparse_attention(q_, lat_, idx, allowed, 0.5, R, block=2).square().sum()  # noqa: E731
    eager = torch.autograd.grad(f(q.requires_grad_(), latent.requires_grad_()), (q, latent))
    func = grad(f, argnums=(0, 1))(q.detach(), latent.detach())
    for a, b in zip(eager, func):
        assert torch.allclose(a, b, atol=1e-12)
    per_example = vmap(lambda q1, l1, i1, a1: sparse_attention(q1[None], l1[None], i1[None], a1[None], 0.5, R)[0])(
        q.detach(), latent.detach(), idx, allowed)
    assert torch.allclose(per_example, sparse_attention(q.detach(), latent.detach(), idx, allowed, 0.5, R, block=3))


def test_topk_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, -0.0, 0.0, float("-inf"), 2.0]])
    assert topk_first(scores, 4).sort().values.tolist() == [[0, 1, 2, 6]]
    assert topk_first(torch.tensor([[-1.5, -0.5, -2.0, -0.5]]), 2).sort().values.tolist() == [[1, 3]]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.float64]))
def test_topk_first_is_a_stable_descending_sort(T, seed, dtype):
    """topk_first picks what a stable sort by descending fp32 score picks: ties (ReLU zeros, -0.0 and +0.0, -inf,
    repeated negatives) go to the lower index."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0.0, -0.0, 1.5, -1.5, 2.0**-140, -3.0, float("-inf"), float("inf")], dtype=dtype)
    scores = torch.where(torch.rand(3, T, generator=g) < 0.5, pool[torch.randint(0, len(pool), (3, T), generator=g)],
                         torch.randn(3, T, generator=g, dtype=dtype))
    k = int(torch.randint(1, T + 1, (), generator=g))
    want = torch.sort(scores.float() + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(topk_first(scores, k).sort().values, want.sort().values)


# ---- the Triton kernels (interpreted on the CPU, or on DEVICE) ---------------------------------------------------

def on_device(*tensors):
    """The tensors on DEVICE (None stays None)."""
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def assert_close_rel(actual, expected, rel=1e-5):
    """Within rel of the expected values' scale (elementwise relative error is meaningless near zero)."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale, f"max |error| {err:.3g} > {rel} x max |expected| {scale:.3g}"


@pytest.fixture
def tk():
    """glm5f.kernels.triton_dsa, its kernels interpreted on the CPU or compiled for DEVICE "cuda"."""
    if triton_dsa is None:
        pytest.skip(NO_TRITON)
    if DEVICE != "cpu" and not torch.cuda.is_available():
        pytest.skip(f"GLM5F_KERNEL_DEVICE={DEVICE} but torch sees no GPU")
    interpreted = type(triton_dsa._sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"
    if interpreted != (DEVICE == "cpu"):
        pytest.fail(f"glm5f.kernels.triton_dsa's kernels are {'' if interpreted else 'not '}interpreted on {DEVICE}: it was "
                    "imported before this module set TRITON_INTERPRET (run this file on its own, with "
                    "TRITON_INTERPRET unset)")
    return triton_dsa


TRITON_CASES = {  # name: selection_case arguments and kernel blocks; every case has ragged S and K, ragged H and C
    # but the last, and K over BLOCK_K (several tiles of the online softmax)
    "causal": (dict(T=27, K=21, mask="causal"), dict(block_k=16)),
    "padding-bias": (dict(T=27, K=21, mask="padding", bias=True), dict(block_k=16)),  # query 0: no allowed key
    "documents": (dict(T=27, K=21, mask="documents"), dict(block_k=16)),
    "k-beyond-visible": (dict(T=40, S=5, K=37, mask="causal"), dict(block_k=16)),  # fully masked tiles
    "many-heads": (dict(H=20, R=40, P=9, K=19, mask="documents", bias=True), dict(block_h=16, block_k=16)),
    "wide-latent": (dict(T=45, K=40, mask="padding", latent_dtype=torch.float64), dict(block_k=32)),
    # heads, value and rope channels that fill their blocks: the kernels drop those masks (all true)
    "even-blocks": (dict(T=27, K=21, H=16, R=32, P=16, mask="documents", bias=True), dict(block_h=16, block_k=16)),
    "no-rope": (dict(T=27, K=21, P=0, mask="causal"), dict(block_k=16)),  # GLM-5.3's latent: values only
}


def triton_case(name):
    case, blocks = TRITON_CASES[name]
    q, latent, idx, allowed, b = selection_case(**{"latent_dtype": torch.float32, **case}, q_dtype=torch.float32)
    return q, latent, idx, allowed, b, blocks


def oracle(q, latent, idx, allowed, b, dout):
    """fp64 (out, dq, dlatent) of the unblocked torch math."""
    q64, l64 = q.double().requires_grad_(), latent.double().requires_grad_()
    out = kernels.sparse_attention_unblocked(q64, l64, idx, allowed, SCALE, dout.shape[-1], b)
    out.backward(dout.double())
    return out.detach(), q64.grad, l64.grad


@pytest.mark.parametrize("block_c", [0, 16])
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_sparse_mla_matches_fp64_oracle(tk, name, block_c):
    """block_c 0: the backward's products over whole rows (the half-precision path, here in fp32); 16: over chunks
    of 16 channels (the fp32 path), one of them holding value and rope channels where R is not a multiple of 16."""
    q, latent, idx, allowed, b, blocks = triton_case(name)
    R = latent.shape[-1] - TRITON_CASES[name][0].get("P", 5)
    dout = torch.randn(*q.shape[:3], R, dtype=q.dtype)
    args = on_device(q, latent, idx, allowed, b)
    out, lse = tk.sparse_mla_forward(*args, SCALE, R, **blocks)
    dq, dlatent = tk.sparse_mla_backward(dout.to(DEVICE), *args, out, lse, SCALE, **blocks, block_c=block_c)
    lse = lse.cpu()
    out64, dq64, dlatent64 = oracle(q, latent, idx, allowed, b, dout)
    assert_close_rel(out, out64.to(q.dtype))
    assert_close_rel(dq, dq64.to(q.dtype))
    assert_close_rel(dlatent, dlatent64.to(latent.dtype))
    _, ref_lse = kernels.sparse_mla(q, latent, idx, allowed, b, SCALE, R)  # the CPU op in fp32
    has_key = allowed.any(-1)
    assert_close_rel(lse[has_key], ref_lse[has_key])
    assert torch.equal(lse[~has_key], ref_lse[~has_key])  # finfo.min: no allowed key


def test_triton_backward_is_deterministic(tk):
    q, latent, idx, allowed, b, blocks = triton_case("documents")
    dout, *args = on_device(torch.randn(*q.shape[:3], 24), q, latent, idx, allowed, b)
    out, lse = tk.sparse_mla_forward(*args, SCALE, 24, **blocks)
    first = tk.sparse_mla_backward(dout, *args, out, lse, SCALE, **blocks)
    second = tk.sparse_mla_backward(dout, *args, out, lse, SCALE, **blocks)
    assert all(torch.equal(a, c) for a, c in zip(first, second))


def test_triton_backward_chunks_sum_like_one_pass(tk, monkeypatch):
    """The per-chunk segmented sums add up to the one-pass sum (up to fp32 rounding of the order)."""
    q, latent, idx, allowed, b, blocks = triton_case("causal")
    dout, *args = on_device(torch.randn(*q.shape[:3], 24), q, latent, idx, allowed, b)
    out, lse = tk.sparse_mla_forward(*args, SCALE, 24, **blocks)
    _, whole = tk.sparse_mla_backward(dout, *args, out, lse, SCALE, **blocks)
    monkeypatch.setattr(tk, "DSEL_CHUNK_ELEMS", 3 * idx.shape[-1] * q.shape[-1])  # 3 queries a chunk
    _, chunked = tk.sparse_mla_backward(dout, *args, out, lse, SCALE, **blocks)
    assert_close_rel(chunked, whole.cpu())


@pytest.mark.parametrize("mask_kind", ["causal", "padding", "documents", "dense-bias"])
def test_triton_indexer_scores_match_fp64(tk, mask_kind):
    B, S, T, I, J = 2, 13, 37, 3, 20  # ragged against blocks of 16 queries and 16 keys
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(B, S, I, J, generator=g), torch.randn(B, S, I, generator=g)
    keys = torch.randn(B, T, J, generator=g)
    q_index = torch.arange(T - S, T)
    parts = dict(key_valid_BxT=None, q_segment_BxS=None, k_segment_BxT=None, dense_BxSxT=None, bias_BxSxT=None)
    if mask_kind == "padding":
        parts["key_valid_BxT"] = torch.rand(1, T, generator=g) > 0.3  # shared by the batch
    elif mask_kind == "documents":
        seg = (torch.rand(B, T, generator=g) < 0.2).cumsum(-1)
        parts.update(q_segment_BxS=seg[:, T - S:], k_segment_BxT=seg)
    elif mask_kind == "dense-bias":
        parts.update(dense_BxSxT=torch.rand(B, S, T, generator=g) > 0.5, bias_BxSxT=torch.randn(1, S, T, generator=g))
    first, stop = 2, S  # a chunk that starts past query 0
    scores = tk.indexer_scores(*on_device(q, w, keys, q_index, *parts.values()), first, stop, block_s=16,
                               block_t=16).cpu()
    expected = kernels._indexer_scores_torch(q.double(), w.double(), keys.double(), first, stop, T)
    if parts["bias_BxSxT"] is not None:
        expected = expected + parts["bias_BxSxT"][:, first:stop]
    allowed = kernels.allowed_rows(q_index, parts["key_valid_BxT"], parts["q_segment_BxS"], parts["k_segment_BxT"],
                                   parts["dense_BxSxT"], first, stop, T).expand(B, -1, -1)
    assert torch.equal(torch.isfinite(scores), allowed)
    assert_close_rel(scores[allowed], expected[allowed].float())


def test_cuda_entry_points_run_the_kernels(tk):
    """The ops' CUDA implementations (on CPU tensors with the kernels interpreted, or on the GPU): sparse MLA and
    its backward agree with the CPU op, the indexer picks what the CPU op picks (over several query chunks)."""
    q, latent, idx, allowed, b, _ = triton_case("padding-bias")
    dout = torch.randn(*q.shape[:3], 24)
    ref_out, ref_lse = kernels.sparse_mla(q, latent, idx, allowed, b, SCALE, 24)
    ref_grads = kernels.sparse_mla_backward(dout, q, latent, idx, allowed, b, ref_out, ref_lse, SCALE, 24)
    args = on_device(q, latent, idx, allowed, b)
    out, lse = kernels.sparse_mla_cuda(*args, SCALE, 24)
    assert_close_rel(out, ref_out)
    grads = kernels.sparse_mla_backward_cuda(dout.to(DEVICE), *args, out, lse, SCALE, 24)
    for a, t in zip(grads, ref_grads):
        assert_close_rel(a, t)

    B, S, T, I, J = 2, 11, 30, 3, 16
    g = torch.Generator().manual_seed(4)
    seg = (torch.rand(B, T, generator=g) < 0.1).cumsum(-1)
    args = (torch.randn(B, S, I, J, generator=g), torch.randn(B, S, I, generator=g), torch.randn(B, T, J, generator=g),
            torch.arange(T - S, T), torch.rand(B, T, generator=g) > 0.2, seg[:, T - S:], seg, None, None, 8)
    ours = kernels.indexer_topk_cuda(*on_device(*args[:-1]), args[-1], chunk_elems=4 * B * T)  # chunks of 4 queries
    assert torch.equal(ours.cpu(), kernels.indexer_topk(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_picks_bf16_values_with_the_tie_rule(tk, dtype):
    """A bf16 run's index queries and keys (`attention.index_queries_narrow`): the CUDA entry point picks what the
    CPU op picks from them, equal scores (ReLU zeros with one indexer head, duplicated keys) to the lower index.
    Interpreted, the kernel takes fp32 tensors holding the bf16 values (the interpreter's bf16 dots are wrong; the
    products are exact in fp32 either way, only the order of the fp32 sums differs); on a device, bf16 (tensor
    cores)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's bf16 dots are wrong: the bf16 kernel runs on a device only")
    B, S, T, I, J, k = 2, 11, 40, 1, 32, 16
    g = torch.Generator().manual_seed(5)
    q, keys = torch.randn(B, S, I, J, generator=g).bfloat16(), torch.randn(B, T, J, generator=g).bfloat16()
    keys[:, 7] = keys[:, 25]  # equal scores for every query that sees both
    keys[:, 30] = keys[:, 12]
    w = torch.rand(B, S, I, generator=g) + 0.5
    q_index, key_valid = torch.arange(T - S, T), torch.rand(B, T, generator=g) > 0.1
    args = (q_index, key_valid, None, None, None, None)
    expected = kernels.indexer_topk(q, w, keys, *args, k)
    scores = kernels._indexer_scores_torch(q, w, keys, 0, S, T).masked_fill(
        ~kernels.allowed_rows(q_index, key_valid, None, None, None, 0, S, T), float("-inf"))
    top = scores.sort(-1, descending=True).values
    assert ((top[..., k - 1] == top[..., k]) & (top[..., k] == 0)).sum() >= 4  # ties at the boundary decide picks
    ours = kernels.indexer_topk_cuda(*on_device(q.to(dtype), w, keys.to(dtype), *args), k, chunk_elems=4 * B * T)
    assert torch.equal(ours.cpu(), expected)
