"""The shared prefill of the on-policy sampler: each prompt prefilled once, its cache copied to its group's rows
(`decode.expand_cache`), samples what G prefilled copies sample, with a full forward's log-probabilities (fp64)."""

import pytest
import torch

import glm5f
from glm5f.data.tokens import make_tokenizer
from glm5f.model import decode
from glm5f.model.decode import expand_cache, init_cache
from glm5f.posttrain import sampler
from glm5f.posttrain.grpo import RLConfig

TOK = make_tokenizer(None)
CONFIGS = {"glm5-tiny": {}, "glm5-tiny-mtp": {"num_nextn_predict_layers": 1}, "glm53-tiny": {},
           "glm53-tiny-share": {"layer_types": ("linear_attention", "indexed_attention", "indexed_attention",
                                                "linear_attention"), "index_topk_pattern": "FFSF"}}  # IndexShare
BUFFERS = {"glm5-tiny": {"latent", "index_keys"}, "glm53-tiny": {"latent", "index_keys", "recurrent", "conv_q",
                                                                   "conv_k", "conv_v"}}


def config(name: str):
    return glm5f.preset(name.removesuffix("-mtp").removesuffix("-share"), **CONFIGS[name])


def prompts() -> list[sampler.Prompt]:
    """Prompts of 3, 18 and 9 tokens (left padding in a batch; past glm5-tiny's index_topk 16, so its indexer keys
    choose); the second stops at any odd id, so its rows end at different steps."""
    lengths, stops = (3, 18, 9), [(TOK.eos_id,), tuple(range(1, 512, 2)), (TOK.eos_id,)]
    return [sampler.Prompt([TOK.bos_id] + TOK.encode("abcdefghijklmnopqrstu"[:n - 1]), "", stops[i], {}, f"p:{i}")
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_expand_cache_copies_every_buffer_of_the_chosen_rows(preset):
    """Every buffer of every layer (MLA's latent rows, the DSA or pooled indexer's keys, KDA's recurrent and
    convolution states) of the expanded cache holds, in its row r, row rows[r] of the source, in its own storage."""
    cfg = glm5f.preset(preset)
    cache = init_cache(cfg, 3, 10, torch.float64)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for buf in layer.values():
            buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float64))
    cache.length = cache.state_length = 4
    rows = [2, 0, 0, 1, 2]
    out = expand_cache(cache, torch.tensor(rows))
    assert {name for layer in out.layers for name in layer} == BUFFERS[preset]
    assert (out.length, out.state_length, out.capacity, out.recurrent) == (4, 4, 10, cache.recurrent)
    for src, dst in zip(cache.layers, out.layers):
        assert dst.keys() == src.keys()
        for name, buf in dst.items():
            assert buf.shape == (len(rows), *src[name].shape[1:]) and buf.dtype == src[name].dtype, name
            for r, s in enumerate(rows):
                assert torch.equal(buf[r], src[name][s]), (name, r)
            buf.zero_()  # decoding writes into the copies: the source keeps its rows
            assert src[name].abs().sum() > 0


def test_expand_cache_refuses_a_buffer_without_its_rows_on_dim_0():
    cache = init_cache(glm5f.preset("glm5-tiny"), 3, 10)
    cache.layers[1]["odd"] = torch.zeros(10, 3)
    with pytest.raises(ValueError, match=r"3 rows on dim 0, but layer 1 'odd' \[10, 3\] does not"):
        expand_cache(cache, torch.tensor([0, 0, 1]))


def unshared_and_shared(params, cfg, s, generators):
    """decode_rows of each prompt repeated s.group_size times (G prefills each), then with group= (one each)."""
    ps, G = prompts(), s.group_size
    seeds = [g.initial_seed() for g in generators] if isinstance(generators, list) else None

    def gens():  # the same seeds, fresh, for each call
        if seeds is None:
            return None if generators is None else torch.Generator().manual_seed(generators.initial_seed())
        return [torch.Generator().manual_seed(x) for x in seeds]
    rows = [p for p in ps for _ in range(G)]
    unshared = sampler.decode_rows(params, cfg, rows, s, TOK.pad_id, gens(), "cpu")
    shared = sampler.decode_rows(params, cfg, ps, s, TOK.pad_id, gens(), "cpu", group=G)
    return rows, unshared, shared


@pytest.mark.parametrize("preset,temperature", [("glm5-tiny", 0.0), ("glm53-tiny", 0.0)] +
                         [(name, 0.8) for name in CONFIGS])
def test_shared_prefill_samples_the_unshared_tokens_and_a_full_forwards_logprobs(preset, temperature):
    """fp64, groups of 3 (greedy; sampled at top_p 0.9 with one generator per prompt): the shared prefill's tokens
    and routing / indexer records equal those of the prompts prefilled once per row, and each completion's
    log-probabilities equal token_logprobs of its prompt + completion alone within 1e-10."""
    cfg = config(preset)
    params = glm5f.init_params(cfg, 0, torch.float64)
    s = RLConfig(group_size=3, temperature=temperature, top_p=0.9, max_new_tokens=6, replay="routing,indexer")
    generators = [torch.Generator().manual_seed(10 + i) for i in range(3)] if temperature else None
    rows, (ids_u, logps_u, recs_u), (ids_s, logps_s, recs_s) = unshared_and_shared(params, cfg, s, generators)
    assert ids_s == ids_u
    assert len({len(c) for c in ids_s}) > 1  # rows ended at different steps
    if temperature:
        assert len({tuple(c) for c in ids_s[3:6]}) > 1  # a group's rows sampled differently
    for f in s.replayed:
        assert all(torch.equal(a, b) for a, b in zip(recs_s[f], recs_u[f])), f
    for p, c, lp, lp_u in zip(rows, ids_s, logps_s, logps_u):
        want = glm5f.token_logprobs(params, cfg, torch.tensor([p.ids + c]))[0, len(p.ids) - 1:-1]
        got = torch.tensor(lp, dtype=torch.float64)
        assert (got - want).abs().max() <= 1e-10
        assert (got - torch.tensor(lp_u, dtype=torch.float64)).abs().max() <= 1e-10


def test_the_prompts_are_run_once_and_the_rows_decoded_from_their_copies(monkeypatch):
    """The prefill runs P prompt rows, every decode step P * G rows."""
    shapes, real = [], decode.extend

    def extend(params, cfg, cache, input_ids_BxS, *args, **kw):
        shapes.append(tuple(input_ids_BxS.shape))
        return real(params, cfg, cache, input_ids_BxS, *args, **kw)
    monkeypatch.setattr(decode, "extend", extend)
    cfg = glm5f.preset("glm5-tiny")
    s = RLConfig(group_size=4, temperature=1.0, max_new_tokens=3)
    sampler.sample_groups(glm5f.init_params(cfg, 0, torch.float32), cfg, prompts(), s, lambda **kw: 0.0, TOK,
                          TOK.pad_id, torch.Generator().manual_seed(0))
    assert shapes == [(3, 18), (12, 1), (12, 1)]


def test_one_generator_for_all_rows_draws_as_before():
    """One generator for the whole call (not one per prompt): the shared prefill's rows draw the same tokens."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 1, torch.float64)
    s = RLConfig(group_size=4, temperature=1.0, max_new_tokens=5)
    _, (ids_u, _, _), (ids_s, _, _) = unshared_and_shared(params, cfg, s, torch.Generator().manual_seed(3))
    assert ids_s == ids_u and len({tuple(c) for c in ids_s[:4]}) > 1
