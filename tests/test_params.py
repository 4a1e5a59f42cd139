"""glm5f/core/params.py: init of a region as that part of the whole init, and params checked against their config."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f


@settings(max_examples=25, deadline=None, derandomize=True)
@given(block=st.integers(1, 3000), lo=st.integers(0, 40), n=st.integers(1, 40), lo1=st.integers(0, 8),
       n1=st.integers(1, 64))
def test_init_of_a_region_is_that_part_of_the_whole_init(block, lo, n, lo1, n1):
    """init_params(region=...) makes each leaf's part alone, block of rows by block of rows, equal to the same part
    of the whole init; the blocks (INIT_BLOCK_ELEMS elements) cut through the region anywhere."""
    import glm5f.core.params as params_mod

    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS", pad_token_id=7)
    whole = glm5f.flatten(glm5f.init_params(cfg, seed=1))
    old = params_mod.INIT_BLOCK_ELEMS
    params_mod.INIT_BLOCK_ELEMS = block
    try:
        def region(path, shape):
            if not shape:
                return ()
            return (slice(min(lo, shape[0]), min(lo + n, shape[0])),
                    *((slice(min(lo1, shape[1]), min(lo1 + n1, shape[1])),) if len(shape) > 1 else ()),
                    *(slice(0, d) for d in shape[2:]))
        parts = glm5f.flatten(glm5f.init_params(cfg, seed=1, region=region))
        blocked = glm5f.flatten(glm5f.init_params(cfg, seed=1))
    finally:
        params_mod.INIT_BLOCK_ELEMS = old
    for k, t in whole.items():
        assert torch.equal(parts[k], blocked[k][region(k, tuple(t.shape))]), k
        if blocked[k].numel() <= block:  # one block: the values of the unblocked init
            assert torch.equal(blocked[k], t), k


def test_params_of_another_config(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: expected \[1024, 64\], found \[512, 64\]"):
        glm5f.check_params(params, dataclasses.replace(cfg, vocab_size=1024))
    with pytest.raises(ValueError, match="missing"):
        glm5f.check_params(params, glm5f.preset("glm5-tiny", num_hidden_layers=4))
