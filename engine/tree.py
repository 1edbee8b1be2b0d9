"""Token trees: verifying several of the drafter's guesses per position in one target pass.

The drafter fills each block position independently, so its runner-up tokens are guesses as good as the
chain's for the positions where its first choice is wrong. A tree spends the verify positions a chain of
the same width would take on the likeliest paths through each position's top tokens; greedy verification
then walks from the root down the children the target agrees with. This module owns building the tree,
its attention layout and the walk; it knows nothing about requests or caches.
"""

import heapq
from dataclasses import dataclass

import torch

TREE_TOP_K = 4  # guesses per position a tree may branch into (docs/design.md: 8 adds little)


@dataclass
class Tree:
    """A token tree after its root, nodes best first: node j sits at block index j + 1 (the root, the last
    committed token, at 0), parents[j] is its parent's block index (< j + 1), probs[j] the drafter's
    probability of its token at its position, depths[j] its distance from the root (1 for a first draft)."""

    ids: list[int]
    parents: list[int]
    probs: list[float]
    depths: list[int]

    def first(self, n: int) -> "Tree":
        """The n best nodes: a tree too (parents come first)."""
        return Tree(self.ids[:n], self.parents[:n], self.probs[:n], self.depths[:n])

    def is_chain(self) -> bool:
        return all(p == j for j, p in enumerate(self.parents))


def build_tree(top_ids: list[list[int]], top_probs: list[list[float]], num_nodes: int) -> Tree:
    """The `num_nodes` nodes most likely accepted.

    top_ids, top_probs: [depth][k] the drafter's likeliest tokens per block position and their
    probabilities (a probability of 0 marks a position that was not drafted). A node's value is the
    product of the probabilities on its path; taking nodes best first maximises the expected accepted
    length when positions are independent, as the drafter drafts them. A child's value is at most its
    parent's, so parents come first.
    """
    tree = Tree([], [], [], [])
    heap = [(-top_probs[0][0], 0, 0, 0, 1.0)] if top_probs and top_probs[0][0] > 0 else []
    while heap and len(tree.ids) < num_nodes:
        value, depth, rank, parent, parent_value = heapq.heappop(heap)
        tree.ids.append(top_ids[depth][rank])
        tree.parents.append(parent)
        tree.probs.append(top_probs[depth][rank])
        tree.depths.append(depth + 1)
        index = len(tree.ids)
        if depth + 1 < len(top_ids) and top_probs[depth + 1][0] > 0:  # its likeliest child
            heapq.heappush(heap, (value * top_probs[depth + 1][0], depth + 1, 0, index, -value))
        if rank + 1 < len(top_ids[depth]) and top_probs[depth][rank + 1] > 0:  # its next sibling
            heapq.heappush(heap, (-parent_value * top_probs[depth][rank + 1], depth, rank + 1, parent, parent_value))
    return tree


def children(parents: list[int]) -> dict[int, list[int]]:
    """Block index -> its children's block indices (parents[j] is node j + 1's parent)."""
    out: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        out.setdefault(p, []).append(j + 1)
    return out


def walk(parents: list[int], block_ids: list[int], predicted: list[int]) -> list[int]:
    """Greedy verification of a tree: block indices of the root and the accepted nodes, each the child of
    the previous whose token is what the target predicts after it.

    parents [n] of block indices 1..n; block_ids [>= n + 1]; predicted [>= n + 1] the target's argmax at each index.
    """
    below, path = children(parents), [0]
    while True:
        nxt = [c for c in below.get(path[-1], ()) if block_ids[c] == predicted[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])  # siblings hold distinct tokens: at most one matches


def outcomes(tree: Tree, committed: list[int]) -> list[tuple[int, bool]]:
    """(node, held) for every node greedy verification tested: the children of each accepted node (and of
    the root), given the tokens the step committed (the accepted path's tokens, then the target's own)."""
    below, out, index = children(tree.parents), [], 0
    for token in committed:
        tested = [c - 1 for c in below.get(index, ())]
        held = next((j for j in tested if tree.ids[j] == token), None)
        out += [(j, j == held) for j in tested]
        if held is None:
            return out
        index = held + 1
    return out


@dataclass
class TokenTree:
    """The attention layout of a verify batch in which some rows are trees (the others chains).

    depth    [batch, q] long: each block position's distance from its row's root
    visible  [batch, q, q] bool: which block positions each position sees (its ancestors and itself)
    """

    depth: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def of(cls, parents: list[list[int] | None], q_len: int, device) -> "TokenTree":
        """From each row's parents (None: a chain) of a block padded to q_len positions. Built in plain
        lists, then one tensor each: per-node tensor ops would cost milliseconds at batch 16."""
        chain = [[k <= j for k in range(q_len)] for j in range(q_len)]
        depth, visible = [], []
        for row in parents:
            if row is None:
                depth.append(list(range(q_len)))
                visible.append(chain)
                continue
            d, v = [0] * q_len, [list(r) for r in chain]
            for j, p in enumerate(row):
                d[j + 1], v[j + 1] = d[p] + 1, v[p][:]
                v[j + 1][j + 1] = True
            depth.append(d)
            visible.append(v)
        return cls(torch.tensor(depth, device=device), torch.tensor(visible, device=device))

    def rope_positions(self, positions):
        """positions [batch, q] (the cache columns written: root first, -1 padding) -> rotary positions."""
        return torch.where(positions >= 0, positions[:, :1] + self.depth, 0)

    def attention_mask(self, positions, kv_len):
        """[batch, 1, q, kv_len] bool: every cached position before the root, and the visible block positions."""
        q_len = self.visible.shape[1]
        column = torch.arange(kv_len, device=positions.device)[None, None] - positions[:, :1, None]  # [batch, 1, kv]
        in_block = self.visible.gather(2, column.clamp(0, q_len - 1).expand(-1, q_len, -1))
        return ((column < 0) | ((column < q_len) & in_block))[:, None]
