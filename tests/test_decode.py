"""glm5f/model/decode.py: decoding on the cache equals re-running the full forward (its tokens and its logits at every
step), left padding, eos, sampling's top-p, and self-speculative decoding with the MTP layers."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from glm5f.model import decode
from glm5f.model.decode import extend, generate, init_cache, sample
from glm5f.model.head import mtp_inputs
from glm5f.model.decoder import head_logits

MTP_CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer


def naive_greedy(params, cfg, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, glm5f.forward(params, cfg, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_generate_matches_full_forward_loop():
    cfg = glm5f.preset("glm5-tiny")  # prompt + new tokens cross index_topk: decoding turns sparse midway
    params = glm5f.init_params(cfg, seed=4)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(params, cfg, prompt, 20, eos_token_id=None), naive_greedy(params, cfg, prompt, 20))


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_cached_decode_logits_are_the_full_forwards_at_every_step(padded):
    """The logits each decoding step picks from (the prefill, then one token at a time on the cache, sparse once
    past index_topk keys) are the full forward's over the prompt and the tokens so far, at every position, not
    only in their argmax: within 4x the fp32 full forward's own distance from an fp64 forward of the same tokens."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=4)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask, n, kw = None, 20, {}
    if padded:  # row 1's prompt holds 5 tokens after 4 of padding: its positions count real tokens only
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, :4] = 0
        full_mask = torch.cat([mask, torch.ones(2, n, dtype=torch.long)], 1)
        kw = dict(attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    steps = list(decode.stream(params, cfg, prompt, n, attention_mask=mask, eos_token_id=None, with_logits=True))
    tokens = torch.stack([t for t, _ in steps], 1)
    logits = torch.stack([step_logits for _, step_logits in steps], 1)  # [B, n, V]: step i's, predicting token i
    assert tokens.shape == (2, n) and torch.equal(tokens, logits.argmax(-1))
    ids = torch.cat([prompt, tokens], 1)
    at = slice(8, 8 + n)  # the prompt's last position and every new token's but the last
    full = glm5f.forward(params, cfg, ids, **kw)[:, at]
    exact = glm5f.forward(glm5f.core.params.map_with_path(lambda path, t: t.double(), params), cfg, ids, **kw)[:, at]
    bound = 4 * float((full.double() - exact).abs().max())
    assert 0 < bound and float((logits.double() - exact).abs().max()) <= bound


def test_left_padded_batch_generates_like_each_prompt_alone():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=5)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, cfg.vocab_size, (1, 12), generator=g), torch.randint(0, cfg.vocab_size, (1, 5), generator=g)
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 7:], mask[1, 7:] = b[0], 1
    out = generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=None)
    assert torch.equal(out[0, 12:], generate(params, cfg, a, 10, eos_token_id=None)[0, 12:])
    assert torch.equal(out[1, 12:], generate(params, cfg, b, 10, eos_token_id=None)[0, 5:])


def test_eos_stops_rows():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=6)
    prompt = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    free = generate(params, cfg, prompt, 6, eos_token_id=None)
    eos = int(free[0, 6])  # the third generated token
    stopped = generate(params, cfg, prompt, 6, eos_token_id=eos)
    assert eos not in free[0, 4:6].tolist()  # so decoding stops right after the third token
    assert torch.equal(stopped, free[:, :7])


def stopped_at(free_BxN: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """The reference of decoding that stops at `eos`, from the tokens of decoding that never stops: a row repeats
    the first eos it emits; the output ends at the step every row has emitted one."""
    rows = []
    for row in free_BxN.tolist():
        out = []
        for t in row:
            out.append(out[-1] if out and out[-1] in eos else t)
        rows.append(out)
    n = max(next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows)
    return torch.tensor([r[:n] for r in rows])


@pytest.mark.parametrize("draft", [None, "mtp"], ids=["stream", "speculative"])
def test_generate_stops_at_the_configs_eos_by_default(draft):
    """glm5f.generate stops at cfg.eos_token_id without being told (as Transformers' generate does, and as
    scripts/generate.py does with its tokenizer's eos); a tuple of eos ids stops each row at the first it emits;
    eos_token_id=None never stops. Against a full-forward greedy loop cut by hand (`stopped_at`)."""
    params = glm5f.init_params(MTP_CFG, seed=4)
    prompt = torch.randint(0, MTP_CFG.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    n = 8
    free = naive_greedy(params, MTP_CFG, prompt, n)[:, 4:]
    a, b = int(free[0, 2]), int(free[1, 5])  # row 0 emits a third, row 1 emits b sixth
    assert a not in free[0, :2].tolist() + free[1, :5].tolist() and b not in free[0, :2].tolist() + free[1, :5].tolist()
    for eos, ends in ((a, None), ((b, a), 6)):
        cfg = dataclasses.replace(MTP_CFG, eos_token_id=eos)
        out = glm5f.generate(params, cfg, prompt, n, draft=draft)
        expected = stopped_at(free, {eos} if isinstance(eos, int) else set(eos))
        assert torch.equal(out[:, 4:], expected), (out[:, 4:], expected)
        assert ends is None or expected.shape[1] == ends
    assert torch.equal(glm5f.generate(params, cfg, prompt, n, draft=draft, eos_token_id=None)[:, 4:], free)
    with pytest.raises(ValueError, match="eos_token_id must be an id, a tuple of ids, None"):
        glm5f.generate(params, cfg, prompt, n, eos_token_id="eos")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(1, 30), st.integers(0, 30), st.integers(0, 2**31 - 1))
def test_cached_decode_equals_full_forward(prompt, new, seed):
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=seed % 997)
    S = prompt + new
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))
    full = glm5f.forward(params, cfg, ids)
    cache = init_cache(cfg, 2, S)
    pos = torch.arange(S).expand(2, S)
    steps = [extend(params, cfg, cache, ids[:, :prompt], pos[:, :prompt])]
    steps += [extend(params, cfg, cache, ids[:, t:t + 1], pos[:, t:t + 1]) for t in range(prompt, S)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.integers(0, 2**16), st.integers(1, 10), st.integers(0, 8), st.integers(1, 2), st.integers(1, 2))
def test_speculative_decoding_is_greedy_decoding(seed, prompt_len, new, batch, depths):
    cfg = dataclasses.replace(MTP_CFG, num_nextn_predict_layers=depths)
    params = glm5f.init_params(cfg, seed=seed % 97)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    stats = {}
    out = glm5f.generate(params, cfg, prompt, new, eos_token_id=None, draft="mtp", stats=stats)
    assert torch.equal(out, glm5f.generate(params, cfg, prompt, new, eos_token_id=None))
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["accepted"] <= stats["proposed"]
    assert stats["proposed"] <= batch * depths * max(new - 1, 0)


@pytest.mark.parametrize("wrong_every", [0, 2, 3], ids=["all-right", "every-2nd-wrong", "every-3rd-wrong"])
def test_accepted_drafts_are_kept_and_rejected_ones_dropped(monkeypatch, wrong_every):
    """A draft that knows the greedy answer (but for every `wrong_every`-th proposal, one token off): the output
    stays greedy, and the acceptance rate counts exactly the drafts that were right up to the first wrong one."""
    cfg = dataclasses.replace(MTP_CFG, num_nextn_predict_layers=3)
    params = glm5f.init_params(cfg, seed=11)
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    n = 25
    greedy = glm5f.generate(params, cfg, prompt, n, eos_token_id=None)
    calls, expected = [0], [0, 0]

    def oracle(params_, cfg_, tokens, hidden, positions, valid, k):
        M = tokens.shape[1]
        assert hidden.shape[1] == positions.shape[1] == M - 1 and torch.equal(tokens, greedy[:, :M])
        out = greedy[:, M:M + k].clone()
        calls[0] += 1
        a = k
        if wrong_every and calls[0] % wrong_every == 0 and k:
            j = calls[0] % k
            out[1, j] = (out[1, j] + 1) % cfg.vocab_size  # only row 1 is off: both rows keep j drafts
            a = j
        expected[0] += 2 * k
        expected[1] += 2 * a
        return out

    monkeypatch.setattr(decode, "mtp_propose", oracle)
    stats = {}
    assert torch.equal(glm5f.generate(params, cfg, prompt, n, eos_token_id=None, draft="mtp", stats=stats), greedy)
    assert (stats["proposed"], stats["accepted"]) == tuple(expected)
    if not wrong_every:
        assert stats["acceptance_rate"] == 1.0 and calls[0] <= math.ceil(n / 4) + 1
    else:
        assert 0 < stats["acceptance_rate"] < 1


def test_speculative_decoding_with_padding_and_eos():
    cfg = MTP_CFG
    params = glm5f.init_params(cfg, seed=5)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :7] = 0
    free = glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=None)
    assert torch.equal(glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=None, draft="mtp"),
                       free)
    eos = int(free[0, 14])
    assert torch.equal(glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=eos, draft="mtp"),
                       glm5f.generate(params, cfg, batch, 10, attention_mask=mask, eos_token_id=eos))
    with pytest.raises(ValueError, match="needs MTP layers"):
        glm5f.generate(glm5f.init_params(glm5f.preset("glm5-tiny")), glm5f.preset("glm5-tiny"), batch, 3,
                       draft="mtp")
    with pytest.raises(ValueError, match="greedy"):
        glm5f.generate(params, cfg, batch, 3, draft="mtp", temperature=1.0)


def test_top_p_keeps_the_smallest_likely_set():
    logits_1xV = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    assert set(int(sample(logits_1xV, 1.0, 0.01, g)) for _ in range(50)) == {0}
    assert set(int(sample(logits_1xV, 1.0, 0.75, g)) for _ in range(200)) == {0, 1}
    assert int(sample(logits_1xV, 0.0)) == 0


def test_shared_mtp_depths_draft_through_one_layer():
    """--model.mtp_shared_depths 3: the drafts are those of a loop running the one MTP layer three times (depth d
    on depth d-1's output and the tokens so far plus the drafts before it); decoding with them stays greedy, each
    step proposes up to 3 tokens, and tokens_per_step counts the new tokens per main-model pass."""
    one = dataclasses.replace(MTP_CFG, num_nextn_predict_layers=1)
    cfg = dataclasses.replace(one, mtp_shared_depths=3)
    params = glm5f.init_params(one, seed=7)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    B, N = prompt.shape[0], prompt.shape[1] - 1
    _, hidden = extend(params, cfg, init_cache(cfg, B, N), prompt[:, :N], torch.arange(N).expand(B, N),
                       with_hidden=True)
    positions = torch.arange(N).expand(B, N)
    drafts = decode.mtp_propose(params, cfg, prompt, hidden, positions, None, 3)
    _, env = glm5f.make_env(one, {"input_ids": prompt[:, :N], "position_ids": positions}, hidden.dtype)
    seq, h = prompt, hidden
    for d in (1, 2, 3):
        h, head, _ = glm5f.model.decoder.mtp_layer(params, one, 1, h, mtp_inputs(seq, d)[:, :N], env)
        seq = torch.cat([seq, head_logits(head, h, one.rms_norm_eps)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(drafts, seq[:, -3:])
    stats, n = {}, 14
    out = glm5f.generate(params, cfg, prompt, n, eos_token_id=None, draft="mtp", stats=stats)
    assert torch.equal(out, glm5f.generate(params, cfg, prompt, n, eos_token_id=None))
    assert stats["proposed"] <= B * 3 * stats["steps"] and stats["steps"] >= math.ceil((n - 1) / 4)
    assert stats["tokens_per_step"] == pytest.approx((n - 1) / stats["steps"])


# ---- GLM-5.3: KDA layers carry a recurrent state, DSA layers their latents and pooled-indexer keys ----------------

def glm53_params(cfg, seed, dtype=torch.float64):
    """init_params of `cfg` with every leaf moved off its constant init (decays, pool terms, mHC base and scale)."""
    g = torch.Generator().manual_seed(seed)
    params = glm5f.init_params(cfg, seed=seed)
    return glm5f.core.params.map_with_path(
        lambda path, t: (t.double() + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(dtype)
        if t.is_floating_point() else t, params)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_glm53_cached_logits_are_the_full_forwards(padded):
    """glm53-tiny (KDA, DSA with pools of 2 and the tail, mHC, dense and MoE MLPs): a prompt of 7 tokens (not a
    multiple of index_kpool) prefilled, then pieces of 1 to 4 tokens on the cache (the recurrence for one, the
    chunked rule from the carried state for more), 25 positions in all (past index_topk + kpool: sparse): every
    position's logits equal the full forward's, within 1e-12 in fp64 and in fp32 within 4x the fp32 forward's own
    distance from the fp64 one."""
    cfg = glm5f.preset("glm53-tiny")
    assert cfg.index_kpool_always_select_tail and {"kda", "mla_dsa"} == {
        glm5f.core.layers.layer_spec(cfg, i).attention for i in range(cfg.num_hidden_layers)}
    B, S, pieces = 2, 25, [7, 1, 3, 1, 4, 1, 1, 2, 1, 1, 1, 1, 1]
    assert sum(pieces) == S and S > cfg.index_topk + cfg.index_kpool and 7 % cfg.index_kpool
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    mask, kw = None, {}
    if padded:  # row 1: 3 padding tokens, then 4 real ones in the prompt: its pools start at position 3
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, :3] = 0
        kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    positions = kw.get("position_ids", torch.arange(S).expand(B, S))
    exact = None
    for dtype in (torch.float64, torch.float32):
        params = glm53_params(cfg, 5, dtype)
        cache = init_cache(cfg, B, S, dtype)
        out, t = [], 0
        for n in pieces:
            out.append(extend(params, cfg, cache, ids[:, t:t + n], positions[:, t:t + n],
                              None if mask is None else mask.bool()))
            t += n
        cached = torch.cat(out, 1).double()
        full = glm5f.forward(params, cfg, ids, **kw).double()
        real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()
        if dtype == torch.float64:
            exact = full
            assert float((cached - full)[real].abs().max()) <= 1e-12
        else:
            bound = 4 * float((full - exact)[real].abs().max())
            assert 0 < bound and float((cached - exact)[real].abs().max()) <= bound


def test_glm53_greedy_generation_matches_transformers(tmp_path):
    """Greedy decoding of a random GLM-5.3 (KDA and DSA layers, pools of 2 with the tail) against Transformers'
    Glm5NextForConditionalGeneration.generate with its cache (KDA conv and recurrent states, KV cache): the same
    tokens, and every step's logits within 1e-5."""
    from conftest import stable_topk
    from test_glm53 import hf_glm53, random_config

    cfg = random_config(1, 2, 2)  # layers: KDA and DSA, dense and MoE
    model = hf_glm53(cfg, 1)
    model.save_pretrained(tmp_path)
    cfg, params = glm5f.load_hf(tmp_path)
    prompt = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    n = 16
    assert 7 + n > cfg.index_topk + cfg.index_kpool
    with torch.no_grad(), stable_topk():
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, use_cache=True)
    steps = list(decode.stream(params, cfg, prompt, n, with_logits=True))
    assert torch.equal(torch.stack([t for t, _ in steps], 1), ref.sequences[:, 7:])
    assert max(float((ours - theirs).abs().max()) for (_, ours), theirs in zip(steps, ref.logits)) <= 1e-5


def test_glm53_cache_cannot_drop_positions():
    cfg = glm5f.preset("glm53-tiny")
    params = glm5f.init_params(cfg)
    cache = init_cache(cfg, 1, 8)
    ids = torch.zeros(1, 4, dtype=torch.long)
    extend(params, cfg, cache, ids, torch.arange(4)[None])
    cache.length = 2
    with pytest.raises(ValueError, match="cannot drop any"):
        extend(params, cfg, cache, ids[:, :1], torch.tensor([[2]]))
