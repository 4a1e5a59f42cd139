"""Tree batches (glm5f.model.tree) against each root-to-leaf sequence run alone: log-probabilities, MTP terms and
gradients of count-weighted sums equal the unshared ones in fp64; the layout and its refusals.

Shape suffixes: B rows, S row length, N next-token pairs.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import glm5f
from glm5f.model.decoder import hidden_states, mtp_states
from glm5f.model.env import make_env
from glm5f.model.head import mtp_inputs, mtp_targets
from glm5f.model.logprobs import head_logprobs, tree_logprobs
from glm5f.model.tree import build_tree

TOL = 1e-10


def random_rows(vocab: int, shape: list[list[tuple[int, int | None]]], seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(2, vocab, (n,), generator=g).tolist(), p) for n, p in row] for row in shape]


# prompt -> 3 children of unequal lengths (one of a single token); a 3-level tree beside a second tree and padding
SHAPES = [[(19, None), (7, 0), (1, 0), (12, 0)],
          [(5, None), (4, 0), (3, 1), (6, 1), (9, 0), (6, None), (8, 5)]]


def path_terms(params, cfg, ids_1xL: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Each unshared sequence's per-token log-probabilities: the main head's [L - 1], then each MTP depth d's
    [L - d - 1] (position i predicting t_{i+d+1}), through glm5f.token_logprobs and the MTP states."""
    out = [glm5f.token_logprobs(params, cfg, ids_1xL)[0, :-1]]
    if depths:
        local, env = make_env(cfg, {"input_ids": ids_1xL, "position_ids": None}, torch.float64)
        h, _ = hidden_states(params, cfg, ids_1xL, env)
        states, _ = mtp_states(params, cfg, h, [mtp_inputs(ids_1xL, d) for d in range(1, depths + 1)], env)
        L = ids_1xL.shape[1]
        out += [head_logprobs(head, hd, mtp_targets(ids_1xL, d), cfg.rms_norm_eps)[0, :L - d - 1]
                for d, (hd, head) in enumerate(states, 1)]
    return out


def f(lp: torch.Tensor) -> torch.Tensor:
    return lp + 0.3 * lp * lp  # any per-token term: not linear, so each shared token must weigh what it is shared by


CONFIGS = {
    # IndexShare (its third layer reuses the second's top-k), sparse DSA (top-k 8 of up to 35 keys), MTP 2 depths
    "glm5-mtp": lambda: glm5f.preset("glm5-tiny", num_nextn_predict_layers=2, index_topk=8),
    "glm5": lambda: glm5f.preset("glm5-tiny", index_topk=8),
    # KDA layers, the pooled indexer (pools of 2, top-k 8), mHC streams
    "glm53": lambda: glm5f.preset("glm53-tiny"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_equals_each_sequence_alone(name):
    cfg = CONFIGS[name]()
    depths = cfg.mtp_depths
    params = glm5f.init_params(cfg, seed=3, dtype=torch.float64)
    leaves = [t for t in glm5f.flatten(params).values()]
    for t in leaves:
        t.requires_grad_(True)
    tb = build_tree(random_rows(cfg.vocab_size, SHAPES, 1), length=64)
    lp = tree_logprobs(params, cfg, tb, mtp_depths=depths)
    lp_DxN = lp if depths else lp[None]
    S = tb.input_ids.shape[1]
    pair = {(s, d): n for n, (s, d) in enumerate(zip(tb.src.tolist(), tb.dst.tolist()))}
    src_pos = tb.tree.position.flatten()[tb.src]
    tree_loss = sum((tb.count * f(lp_DxN[d]) * (src_pos >= d)).sum() for d in range(depths + 1))
    ref_loss, compared = 0.0, 0
    for b, paths in enumerate(tb.paths):
        for path in paths:
            terms = path_terms(params, cfg, tb.input_ids[b, list(path)][None], depths)
            for d, ref in enumerate(terms):
                got = torch.stack([lp_DxN[d, pair[(b * S + path[i + d], b * S + path[i + d + 1])]]
                                   for i in range(len(ref))])
                torch.testing.assert_close(got, ref, rtol=0, atol=TOL)
                compared += len(ref)
                ref_loss = ref_loss + f(ref).sum()
    assert compared > 100
    torch.testing.assert_close(tree_loss, ref_loss, rtol=0, atol=TOL)
    got_g = torch.autograd.grad(tree_loss, leaves, allow_unused=True)
    ref_g = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    for a, r in zip(got_g, ref_g):
        if r is None:
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, r, rtol=0, atol=TOL)
    assert sum(int(r is not None) for r in ref_g) > len(leaves) // 2


def test_layout_by_hand():
    tb = build_tree([[([5, 6], None), ([7], 0), ([8, 9], 0), ([3], 2)], [([4], None)]], length=7)
    assert tb.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 0], [4, 0, 0, 0, 0, 0, 0]]
    assert tb.position_ids.tolist() == [[0, 1, 2, 2, 3, 4, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert tb.tree.prev.tolist() == [[-1, 0, 1, 1, 3, 4, -1], [-1, -1, 1, 2, 3, 4, 5]]
    assert tb.tree.reach.tolist() == [[5, 5, 2, 5, 5, 5, 6], [0, 6, 6, 6, 6, 6, 6]]
    assert list(zip(tb.src.tolist(), tb.dst.tolist())) == [(0, 1), (1, 2), (1, 3), (3, 4), (4, 5)]
    assert tb.count.tolist() == [2, 1, 1, 1, 1]  # the prompt's second token is in both sequences
    assert tb.targets.tolist() == [6, 7, 8, 9, 3]
    assert tb.paths == (((0, 1, 2), (0, 1, 3, 4, 5)), ((0,),))
    assert tb.row.tolist() == [0] * 5 and tb.segment.tolist() == [0, 1, 2, 2, 3]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=7), st.integers(0, 2))
def test_mask_is_the_path_relation(segs, pad):
    """Mask.rows / Mask.at of a random pre-order tree equal "key j lies on query i's path" (walked by hand)."""
    rows, stack = [], []
    for i, (n, up) in enumerate(segs):  # parent: the segment `up` steps up the current path (None past its root)
        parent = None if up >= len(stack) else stack[len(stack) - 1 - up]
        stack = [] if parent is None else stack[:stack.index(parent) + 1]
        stack.append(i)
        rows.append((list(range(n)), parent))
    L = sum(n for n, _ in segs)
    tb = build_tree([rows], length=L + pad)
    _, env = make_env(glm5f.preset("glm5-tiny"), {"input_ids": tb.input_ids, "tree": tb.tree}, torch.float64)
    S = L + pad
    prev = tb.tree.prev[0].tolist()
    want = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        j = i
        while j >= 0:
            want[i, j] = True
            j = prev[j]
        assert tb.position_ids[0, i] == int(want[i].sum()) - 1
    assert torch.equal(env.mask.rows(0, S)[0], want)
    idx = torch.arange(S).expand(1, S, S)
    assert torch.equal(env.mask.at(idx)[0], want)


def test_refusals():
    with pytest.raises(ValueError, match="pre-order"):
        build_tree([[([1], None), ([2], 0), ([3], None), ([4], 1)]])
    with pytest.raises(ValueError, match="empty"):
        build_tree([[([1], None), ([], 0)]])
    with pytest.raises(ValueError, match="more than the row length"):
        build_tree([[([1, 2, 3], None)]], length=2)
    cfg = glm5f.preset("glm5-tiny")
    tb = build_tree([[([1, 2], None), ([3], 0), ([4], 0)]])
    batch = {"input_ids": tb.input_ids, "tree": tb.tree}
    with pytest.raises(ValueError, match="attention_mask"):
        make_env(cfg, {**batch, "attention_mask": torch.ones(1, 4)}, torch.float64)
    from glm5f.model.env import Objectives
    with pytest.raises(ValueError, match="indexer loss"):
        make_env(cfg, batch, torch.float64, objectives=Objectives(indexer_loss="dense"))
