"""glm5f/kernels/kda.py: the chunked delta rule against the naive recurrence in fp64 (forward and every gradient), packed
documents against each document alone, opcheck; glm5f/model/kda_layer.py: the KDA layer against Transformers' Glm5Next
layer."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f.kernels.kda
from glm5f.kernels.kda import kda, kda_op, kda_backward_op, kda_recurrent
from glm5f.model.kda_layer import KDAConfig, kda_attention, kda_attention_cp

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)
F64 = torch.float64


def delta_inputs(B, T, H, K, V, seed, dtype=F64, lower_bound=-5.0):
    """q, k (unit rows), v, g (log decay in (lower_bound, 0)), beta, initial state: all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    state = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


def outputs_and_grads(fn, inputs, seed):
    """(o, final state, gradients of a random projection of both w.r.t. every input)."""
    o, state = fn(inputs)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + \
           (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
    return o, state, torch.autograd.grad(loss, inputs)


def max_err(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_chunked_equals_recurrent(B, T, H, K, V, chunk, seed, segment=None, tol=1e-10):
    inputs = delta_inputs(B, T, H, K, V, seed)
    scale = K ** -0.5
    o, s, grads = outputs_and_grads(lambda x: kda(*x[:5], scale, x[5], segment, chunk), inputs, seed)
    o_ref, s_ref, grads_ref = outputs_and_grads(lambda x: kda_recurrent(*x[:5], scale, x[5], segment), inputs, seed)
    err = max_err([o, s, *grads], [o_ref, s_ref, *grads_ref])
    assert err < tol, f"chunked vs recurrent (T={T}, chunk={chunk}): max error {err:.3g}, expected < {tol}"
    return err


@pytest.mark.parametrize("T,chunk,per_block", [(1, 64, 0), (37, 8, 0), (64, 64, 0), (150, 64, 0), (150, 16, 0),
                                               (70, 16, 1), (70, 8, 3), (70, 8, -1), (150, 16, -1)])
def test_chunked_equals_recurrent_fp64(T, chunk, per_block, monkeypatch):
    """per_block: chunks per block of chunks (0: the default, one block here; -1: lane groups of one head of one
    row, blocks of d_k tokens)."""
    if per_block:
        monkeypatch.setattr(glm5f.kernels.kda, "BLOCK_ELEMS", chunk if per_block < 0 else 2 * 3 * chunk * per_block)
    assert_chunked_equals_recurrent(2, T, 3, 16, 8, chunk, seed=T + chunk)


def test_chunked_equals_recurrent_with_steep_decay():
    """Decays of up to exp(-100) per token (no lower bound: exp(-6400) across a chunk) overflow nowhere."""
    inputs = delta_inputs(1, 130, 2, 8, 4, seed=3, lower_bound=-100.0)
    o, s, grads = outputs_and_grads(lambda x: kda(*x[:5], 0.5, x[5], None, 64), inputs, 3)
    o_ref, s_ref, grads_ref = outputs_and_grads(lambda x: kda_recurrent(*x[:5], 0.5, x[5]), inputs, 3)
    assert max_err([o, s, *grads], [o_ref, s_ref, *grads_ref]) < 1e-10


@st.composite
def packed_case(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    chunk = draw(st.sampled_from([4, 8, 16]))
    T = draw(st.integers(1, 3 * chunk + 3))
    starts = draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=5)) if T > 1 else []
    return B, T, H, chunk, sorted(set(starts)), draw(st.integers(0, 2**31 - 1)), draw(st.booleans())


@SETTINGS
@given(packed_case())
def test_chunked_equals_recurrent_packed(case):
    """Any T (not a multiple of the chunk, 1-token documents) and document starts; the same starts in every row; in
    one lane group or in groups of two lanes (a head of two rows, or two heads)."""
    B, T, H, chunk, starts, seed, split = case
    blocks = chunk * 2 if split else B * H * chunk * 2  # blocks of two chunks, or two lanes of one chunk
    glm5f.kernels.kda.BLOCK_ELEMS, default = blocks, glm5f.kernels.kda.BLOCK_ELEMS
    segment = torch.zeros(B, T, dtype=torch.long)
    for s in starts:
        segment[:, s:] += 1
    try:
        assert_chunked_equals_recurrent(B, T, H, 4, 3, chunk, seed, segment)
    finally:
        glm5f.kernels.kda.BLOCK_ELEMS = default


def test_packed_documents_equal_each_document_alone():
    """Packed rows restart the state at each document (the first one starts from the initial state)."""
    T, chunk = 70, 16
    bounds = [0, 1, 2, 19, 33, 34, 70]  # 1-token documents, one crossing chunk boundaries
    q, k, v, g, beta, state = delta_inputs(1, T, 2, 8, 4, seed=5)
    segment = torch.zeros(1, T, dtype=torch.long)
    for s in bounds[1:-1]:
        segment[:, s:] += 1
    o, final = kda(q, k, v, g, beta, 0.4, state, segment, chunk)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        init = state if i == 0 else None
        o_doc, final_doc = kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], 0.4, init, None, chunk)
        assert (o[:, a:b] - o_doc).abs().max() < 1e-12, f"document {a}:{b}"
    assert (final - final_doc).abs().max() < 1e-12


def test_fp32_inputs_compute_in_fp32_and_match_fp64():
    """GLM-5.3's lower bound in fp32: a chunk decays by up to exp(-320), no factor of the chunked form overflows."""
    q, k, v, g, beta, state = (x.detach().float() for x in delta_inputs(1, 200, 2, 16, 8, seed=7))
    g = g.detach() * 0 - 5 * torch.rand(g.shape, generator=torch.Generator().manual_seed(0)) ** 0.5
    o, s = kda(q, k, v, g, beta, 0.25, state)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    o64, s64 = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), 0.25, state.double())
    assert (o - o64).abs().max() < 1e-5 and (s - s64).abs().max() < 1e-5


@pytest.mark.parametrize("B,T,H,d,block_elems", [(1, 1024, 4, 128, 1024), (1, 1000, 4, 128, 1024),
                                                   (2, 512, 2, 64, 1024), (1, 512, 4, 256, 512),
                                                   (2, 512, 4, 32, 4096)])
def test_workspace_bytes_bound_what_the_allocator_holds(B, T, H, d, block_elems, monkeypatch):
    """The memory plan's row for the op (`kda.workspace_bytes`) against torch's allocator, as the profiler records
    its allocations and frees: the most held at once beyond the inputs and outputs, forward and backward, is at most
    the row and at least half of it (one block over the whole sequence needs fewer copies)."""
    from bench.common import allocated_peak_gb
    monkeypatch.setattr(glm5f.kernels.kda, "BLOCK_ELEMS", block_elems)
    q, k, v, g, beta, _ = delta_inputs(B, T, H, d, d, 0, dtype=torch.float32)

    def held(fn):
        """(the most the allocator held while fn ran beyond fn's outputs, the outputs)."""
        out = []
        peak = allocated_peak_gb(lambda: out.extend(fn()), "cpu") * 2**30
        return peak - sum(x.nbytes for x in out), out

    with torch.no_grad():
        fwd, (o, state, states) = held(lambda: kda_op(q, k, v, g, beta, None, None, d ** -0.5, glm5f.kernels.kda.CHUNK))
        do, dstate = torch.randn_like(o), torch.zeros_like(state)
        bwd, _ = held(lambda: kda_backward_op(do, dstate, q, k, v, g, beta, None, None, states, d ** -0.5,
                                              glm5f.kernels.kda.CHUNK))
    plan_fwd, plan_bwd = glm5f.kernels.kda.workspace_bytes(B, T, H, d, d, torch.float32)
    for what, got, row in (("forward", fwd, plan_fwd), ("backward", bwd, plan_bwd)):
        assert 0.5 * row <= got <= row, f"{what}: the allocator held {got / 2**20:.2f} MiB beyond the inputs " \
                                         f"and outputs, the plan's row says {row / 2**20:.2f} MiB"


def test_opcheck_kda():
    q, k, v, g, beta, state = delta_inputs(2, 21, 2, 8, 4, seed=11)
    segment = torch.tensor([[0] * 5 + [1] * 16, [0] * 21])
    torch.library.opcheck(kda_op, (q, k, v, g, beta, state, segment, 0.3, 8))
    torch.library.opcheck(kda_op, (q, k, v, g, beta, None, None, 0.3, 8))
    q, k, v, g, beta, state = (x.detach() for x in (q, k, v, g, beta, state))
    o, final, states = kda_op(q, k, v, g, beta, state, segment, 0.3, 8)
    torch.library.opcheck(kda_backward_op, (torch.randn_like(o), torch.randn_like(final), q, k, v, g, beta, state,
                                            segment, states, 0.3, 8))


# ---- the KDA block against Transformers -------------------------------------------------------------------------

def transformers_layer(lower_bound, seed, hidden=32, heads=2, head_dim=16, kernel=4):
    """Transformers' Glm5Next KDA layer with random weights, its config and the same weights as glm5f params."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
    hcfg = Glm5NextTextConfig(hidden_size=hidden, linear_num_heads=heads, linear_head_dim=head_dim,
                              num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"],
                              linear_lower_bound=lower_bound, linear_conv_kernel_dim=kernel, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    layer = Glm5NextTextLinearAttention(hcfg, 0)
    with torch.no_grad():
        for name, w in layer.named_parameters():
            w.copy_(torch.randn_like(w) * (0.3 if w.ndim > 1 else 0.5) + (name == "o_norm.weight"))
    cfg = KDAConfig(hidden, heads, head_dim, kernel, lower_bound, 1e-5)
    return layer, cfg


def params_of(layer):
    """The layer's weights under the checkpoint's names (before Transformers' renames: forget_gate.* one level up,
    conv1d split into q/k/v_conv1d)."""
    return params_of_dict(dict(layer.named_parameters()))


def params_of_dict(w):
    p = {n: {"weight": w[f"{n}.weight"]} for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj",
                                                    "o_norm", "o_proj")}
    p |= {n: {"weight": w[f"forget_gate.{n}.weight"]} for n in ("f_a_proj", "f_b_proj")}
    p |= {n: w[f"forget_gate.{n}"] for n in ("dt_bias", "A_log")}
    for n, conv in zip("qkv", w["conv1d.weight"].chunk(3)):
        p[f"{n}_conv1d"] = {"weight": conv}
    return p


def block_grads(y, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.autograd.grad((y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum(), inputs)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_attention_matches_transformers(lower_bound):
    """fp32 against fp32 (Transformers' torch fallback), with the fp64 run as the noise floor: glm5f in fp32 is as
    close to Transformers as Transformers is to glm5f in fp64."""
    layer, cfg = transformers_layer(lower_bound, seed=0)
    x = torch.randn(2, 100, cfg.hidden_size, requires_grad=True)
    inputs = [x, *layer.parameters()]
    y_ref = layer(x)
    y = kda_attention(params_of(layer), x, cfg)
    g_ref, g = block_grads(y_ref, inputs, 1), block_grads(y, inputs, 1)
    y64 = kda_attention(params_of(layer.double()), x.detach().double(), cfg)
    assert (y - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    assert (y - y_ref).abs().max() <= 4 * (y64 - y_ref).abs().max() + 1e-7
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, g, g_ref):
        assert (a - b).abs().max() < 1e-4 * b.abs().max(), f"gradient of {name}: {(a - b).abs().max():.3g}"


def test_kda_attention_packed_equals_each_document_in_transformers():
    """Packed documents restart the short convolution and the state: each equals Transformers on it alone."""
    layer, cfg = transformers_layer(-5.0, seed=2)
    bounds = [0, 1, 3, 40, 41, 90]
    x = torch.randn(1, bounds[-1], cfg.hidden_size)
    segment = torch.zeros(1, bounds[-1], dtype=torch.long)
    for s in bounds[1:-1]:
        segment[:, s:] += 1
    y = kda_attention(params_of(layer), x, cfg, segment)
    for a, b in zip(bounds, bounds[1:]):
        y_doc = layer(x[:, a:b])
        assert (y[:, a:b] - y_doc).abs().max() < 1e-5 * y_doc.abs().max(), f"document {a}:{b}"


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_attention_gradcheck_fp64(lower_bound):
    """The block's hand-written backwards (short convolution with the L2 norm, forget gate, gated norm) against
    finite differences, over packed documents."""
    layer, cfg = transformers_layer(lower_bound, seed=4, hidden=8, heads=2, head_dim=4, kernel=3)
    leaves = [w.detach().double().requires_grad_() for w in layer.parameters()]
    names = [n for n, _ in layer.named_parameters()]
    segment = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2]])
    x = torch.randn(1, 11, 8, dtype=F64, requires_grad=True)

    def block(x, *ws):
        q = dict(zip(names, ws))
        p = params_of_dict(q)
        return kda_attention(p, x, cfg, segment, chunk=4)

    assert torch.autograd.gradcheck(block, (x, *leaves), fast_mode=True)


# ---- context parallelism ----------------------------------------------------------------------------------------

def held_in_order(order):
    """The `chunks` verb of one process holding every chunk in `order`: its values put back in sequence order."""
    inverse = torch.argsort(torch.tensor(order))
    return lambda local: local[:, inverse]


@pytest.mark.parametrize("T,N,starts,seed", [
    (48, 8, [6, 13, 30], 0),   # documents starting at a chunk's first token and inside chunks
    (16, 8, [4, 5], 1),        # chunks of 2 tokens, shorter than the convolution's 3-row halo; a 1-token document
    (40, 4, [], 2),            # one document per row
    (24, 2, [1, 12, 23], 3),   # cp 1's two halves
])
def test_kda_attention_cp_equals_the_whole_sequence_fp64(T, N, starts, seed):
    """`kda_attention_cp` over the N chunks of a sequence held in a shuffled order (the exchange a reordering, as
    CP ranks' all-gather makes it): outputs and every gradient (x and each weight) those of `kda_attention` over
    the whole packed sequence, to fp64 rounding."""
    layer, cfg = transformers_layer(-5.0, seed=seed)
    layer.double()
    names = [n for n, _ in layer.named_parameters()]
    B, L = 2, T // N
    x = torch.randn(B, T, cfg.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(seed),
                    requires_grad=True)
    segment = torch.zeros(B, T, dtype=torch.long)
    for s in starts:
        segment[:, s:] += 1
    segment[1] = 0  # the second row is one document
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()
    held = lambda y: torch.cat([y[:, c * L:(c + 1) * L] for c in order], 1)  # noqa: E731
    p = params_of(layer)
    y = kda_attention_cp(p, held(x), cfg, tuple(c * L for c in order), segment, held_in_order(order), chunk=4)
    y_ref = held(kda_attention(p, x, cfg, segment, chunk=4))
    assert (y - y_ref).abs().max() <= 1e-12 * y_ref.abs().max()
    inputs = [x, *layer.parameters()]
    for name, a, b in zip(["x", *names], block_grads(y, inputs, seed), block_grads(y_ref, inputs, seed)):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), f"gradient of {name}: {(a - b).abs().max():.3g}"
