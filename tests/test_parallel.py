"""glm5f/parallel/layout.py's layout math, in one process: how a batch is shared over ranks (context-parallel positions, the
split of every per-token tensor, a rank's masks); the multi-process layouts against one process: test_distributed.py."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from glm5f.parallel.layout import cp_positions
from glm5f.model.env import split_tokens


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 4), st.integers(1, 6))
def test_cp_positions_are_chunk_pairs_of_equal_causal_work(cp, chunk):
    """Rank r holds chunks r and 2cp-1-r of 2cp equal chunks, in that order; the ranks together hold every
    position once, and each rank's queries see the same number of causal keys."""
    S = 2 * cp * chunk
    held = [cp_positions(S, cp, r) for r in range(cp)]
    for r, pos in enumerate(held):
        want = list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
        assert pos.tolist() == want
    assert sorted(torch.cat(held).tolist()) == list(range(S))
    assert len({int((pos + 1).sum()) for pos in held}) == 1  # keys seen, summed over the rank's queries


def test_split_tokens_cuts_every_per_token_leaf_whatever_its_name():
    """Rows and positions of [B, S, ...] leaves (in lists too) are taken, other leaves keep their rows only."""
    B, S = 4, 8
    batch = {"input_ids": torch.arange(B * S).view(B, S), "mtp": [torch.arange(B * S).view(B, S) + 100],
             "extra": torch.randn(B, S, 3), "mask4d": torch.ones(B, 1, S, S), "scalar": torch.tensor(7)}
    positions = cp_positions(S, 2, 1)
    out = split_tokens(batch, slice(2, 4), positions)
    assert torch.equal(out["input_ids"], batch["input_ids"][2:4][:, positions])
    assert torch.equal(out["mtp"][0], batch["mtp"][0][2:4][:, positions])
    assert torch.equal(out["extra"], batch["extra"][2:4][:, positions])
    assert out["mask4d"].shape == (2, 1, S, S) and int(out["scalar"]) == 7
    whole = split_tokens(batch, slice(None), None)
    assert torch.equal(whole["input_ids"], batch["input_ids"])


def test_make_env_masks_a_ranks_queries_over_every_key():
    """The Env of a CP rank's share: its queries' positions, causal and document masks over all S keys, the same
    rows of the one-process mask."""
    cfg = glm5f.preset("glm5-tiny")
    S = 8
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    batch = {"input_ids": torch.zeros(1, S, dtype=torch.long), "position_ids": pos}

    class Rank1(glm5f.parallel.layout.Layout):
        def share(self, B, S):
            return slice(None), cp_positions(S, 2, 1)

    _, whole = glm5f.make_env(cfg, batch, torch.float32)
    local, env = glm5f.make_env(cfg, batch, torch.float32, Rank1())
    q = cp_positions(S, 2, 1)
    assert torch.equal(local["position_ids"], pos[:, q])
    assert torch.equal(env.mask.rows(0, len(q)), whole.mask.rows(0, S)[:, q])
    assert torch.equal(env.cos, whole.cos[:, q])
