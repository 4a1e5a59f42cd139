"""Batches as trees of token segments: a shared prefix is laid out once and each branch sees it through the mask, so
every token computes what it computes in each unshared sequence that contains it (`TreeBatch`, `build_tree`).

A row holds segments in pre-order (each segment's descendants follow it, before its next sibling), each with a
parent segment or none (a root: packed documents are a forest). A token sees the tokens before it in its own
segment and every token of its ancestor segments; its position continues from its parent's last token's. In
pre-order that is one rule over row indices: key j is visible to query i when j <= i <= reach[j], reach[j] the last
row index of the subtree of j's segment. Shape suffixes: B rows, S row length, N next-token pairs, P path length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch


@dataclass(frozen=True)
class Tree:
    """The tree structure of a batch's rows (keys over all S positions of each row).

    segments: per row, (start, stop, parent segment or -1) of each segment in pre-order (host ints). prev [B, S]:
    the row index of the token before each one on its path (-1 at a root's first token); reach [B, S]: the last
    row index whose path holds the token; position [B, S]: the token's index on its path, less `shift` (negative:
    not a token of this tree's sequences; MTP's layouts, `shifted`)."""

    segments: tuple[tuple[tuple[int, int, int], ...], ...]
    prev: torch.Tensor
    reach: torch.Tensor
    position: torch.Tensor
    shift: int = 0

    @classmethod
    def of(cls, prev_BxS: torch.Tensor, reach_BxS: torch.Tensor, position_BxS: torch.Tensor) -> Tree:
        """The Tree of a batch's per-token tensors ("tree_prev", "tree_reach", "position_ids"; `TreeBatch.batch`):
        a segment starts where a token does not follow the one before it and after each token that another
        follows out of order (so every parent token ends its segment). Reads prev to the host."""
        segments = []
        for row in prev_BxS.tolist():
            jumps = [(i, p) for i, p in enumerate(row) if p != i - 1]
            starts = sorted({i for i, _ in jumps} | {p + 1 for _, p in jumps if p >= 0} | {0})
            seg_of = {}
            out = []
            for k, a in enumerate(starts):
                stop = starts[k + 1] if k + 1 < len(starts) else len(row)
                for t in range(a, stop):
                    seg_of[t] = k
                p = row[a]
                out.append((a, stop, -1 if p < 0 else seg_of[p]))
            segments.append(tuple(out))
        return cls(tuple(segments), prev_BxS, reach_BxS, position_BxS)

    def rows(self, rows: slice) -> Tree:
        """The tree of rows `rows`."""
        return Tree(self.segments[rows], self.prev[rows], self.reach[rows], self.position[rows], self.shift)

    def ancestors(self, n: int) -> torch.Tensor:
        """[B, S, n]: the row index of each token's d-th predecessor on its path at [..., d] (d = 0: itself), -1
        where the path has none."""
        prev_BxS = self.prev
        out, cur = [], torch.arange(prev_BxS.shape[1], device=prev_BxS.device).expand_as(prev_BxS)
        for _ in range(n):
            out.append(cur)
            cur = torch.where(cur >= 0, prev_BxS.gather(1, cur.clamp(min=0)), -1)
        return torch.stack(out, -1)

    def shifted(self, depth: int) -> Tree:
        """The tree of MTP depth `depth`: its node at row index j is the sequence position `depth` before token j
        (which holds t_j as that depth's input), so its position is `depth` less; rows of nodes with no such
        position (the first `depth` tokens of each path) are not keys (`valid`)."""
        return replace(self, position=self.position - depth, shift=self.shift + depth)

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, S] bool: the tokens that are nodes of this tree's sequences (None: all)."""
        return None if self.shift == 0 else self.position >= 0


@dataclass(frozen=True)
class TreeBatch:
    """A tree batch: input_ids and position_ids [B, S] and the Tree; `src`, `dst` [N]: every next-token pair
    (flat indices b * S + s; the token at src predicts the token at dst: one pair per child where a segment ends
    with children), `count` [N] how many root-to-leaf paths hold the pair, `segment` [N] the segment of dst in
    its row, `row` [N] its row. `paths`: per row, each root-to-leaf path's row indices (leaves in pre-order)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tree: Tree
    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor
    segment: torch.Tensor
    row: torch.Tensor
    paths: tuple[tuple[tuple[int, ...], ...], ...]

    def batch(self) -> dict:
        """The batch tensors `env.make_env` reads a tree from: input_ids, position_ids, tree_prev, tree_reach."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "tree_prev": self.tree.prev,
                "tree_reach": self.tree.reach}

    @property
    def targets(self) -> torch.Tensor:
        """[N]: the token each pair predicts."""
        return self.input_ids.flatten()[self.dst]


def predecessor_states(h_BxSxD: torch.Tensor, prev_BxS: torch.Tensor) -> torch.Tensor:
    """[B, S, D]: at each token, the state of the token before it on its path (the one that predicts it; a root's
    first token gets row 0's, and predicts nothing)."""
    return h_BxSxD.gather(1, prev_BxS.clamp(min=0)[..., None].expand(-1, -1, h_BxSxD.shape[-1]))


def check_segments(segments: Sequence[tuple[Sequence[int], int | None]], row: int) -> None:
    """Refuses a row whose segments are not in pre-order with earlier parents, or that holds an empty segment."""
    stack: list[int] = []
    for i, (tokens, parent) in enumerate(segments):
        if len(tokens) == 0:
            raise ValueError(f"tree row {row}: segment {i} is empty; every segment holds at least one token")
        if parent is not None and not 0 <= parent < i:
            raise ValueError(f"tree row {row}: segment {i} names parent {parent}; a parent is an earlier segment of "
                             f"the row (or None for a root)")
        if parent is None:
            stack = []
        else:
            if parent not in stack:
                raise ValueError(f"tree row {row}: segment {i}'s parent {parent} is not on the path of the segment "
                                 f"before it; lay segments out in pre-order (each subtree contiguous)")
            stack = stack[:stack.index(parent) + 1]
        stack.append(i)


def build_tree(rows: Sequence[Sequence[tuple[Sequence[int], int | None]]], length: int | None = None,
               pad_id: int = 0, device: torch.device | str = "cpu") -> TreeBatch:
    """A TreeBatch of rows of (token ids, parent segment index or None) in pre-order (`check_segments`), each row
    padded to `length` (default the longest) by a root segment of pad_id tokens that no pair reads."""
    longest = max((sum(len(t) for t, _ in r) for r in rows), default=0)
    S = longest if length is None else length
    if longest > S:
        raise ValueError(f"a tree row holds {longest} tokens, more than the row length {S}; raise the row length or "
                         f"split the tree")
    ids, prev, reach, pos, segs, pairs, paths = [], [], [], [], [], [], []
    for b, r in enumerate(rows):
        check_segments(r, b)
        starts, offset = [], 0
        for tokens, _ in r:
            starts.append(offset)
            offset += len(tokens)
        stops = [a + len(t) for a, (t, _) in zip(starts, r)]
        parents = [-1 if p is None else p for _, p in r]
        children: list[list[int]] = [[] for _ in r]
        for i, p in enumerate(parents):
            if p >= 0:
                children[p].append(i)
        end = list(stops)  # each segment's subtree end, children before parents (pre-order: later index)
        for i in reversed(range(len(r))):
            for c in children[i]:
                end[i] = max(end[i], end[c])
        leaves_below = [0] * len(r)
        for i in reversed(range(len(r))):
            leaves_below[i] = 1 if not children[i] else sum(leaves_below[c] for c in children[i])
        row_ids, row_prev, row_reach, row_pos = [], [], [], []
        for i, (tokens, _) in enumerate(r):
            p = parents[i]
            first_pos = 0 if p < 0 else row_pos[stops[p] - 1] + 1
            for k, t in enumerate(tokens):
                row_ids.append(int(t))
                row_prev.append((stops[p] - 1 if p >= 0 else -1) if k == 0 else starts[i] + k - 1)
                row_reach.append(end[i] - 1)
                row_pos.append(first_pos + k)
                if k > 0 or p >= 0:
                    pairs.append((b, row_prev[-1], starts[i] + k, leaves_below[i], i))
        segments = [(starts[i], stops[i], parents[i]) for i in range(len(r))]
        row_paths = []
        for i in range(len(r)):
            if not children[i]:
                path, s = [], i
                while s >= 0:
                    path = list(range(starts[s], stops[s])) + path
                    s = parents[s]
                row_paths.append(tuple(path))
        if offset < S:  # the padding: a root of its own
            segments.append((offset, S, -1))
            row_ids += [pad_id] * (S - offset)
            row_prev += [-1] + list(range(offset, S - 1))
            row_reach += [S - 1] * (S - offset)
            row_pos += list(range(S - offset))
        ids.append(row_ids)
        prev.append(row_prev)
        reach.append(row_reach)
        pos.append(row_pos)
        segs.append(tuple(segments))
        paths.append(tuple(row_paths))

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device).view(len(rows), S)

    b_N, src_N, dst_N, count_N, seg_N = (torch.tensor([p[i] for p in pairs], dtype=torch.long, device=device)
                                         for i in range(5))
    tree = Tree(tuple(segs), t(prev), t(reach), t(pos))
    return TreeBatch(t(ids), t(pos), tree, b_N * S + src_N, b_N * S + dst_N, count_N, seg_N, b_N, tuple(paths))
