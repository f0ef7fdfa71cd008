"""Draft trees the way SGLang's EAGLE worker builds them, and greedy tree verification.

Drafting (SGLang ``select_top_k_tokens`` + ``organize_draft_results``), for one sequence:

- step 0 expands the ROOT (the last verified token): its top-k tokens become the depth-1
  candidates, score = their draft probability; all k form the frontier;
- step i >= 1 expands every frontier node: its top-k children become candidates with
  score = parent score × child probability (the product of draft probabilities along the
  path); the best ``k`` of those ``k²`` children form the next frontier;
- after ``num_steps`` steps the ``num_draft_tokens - 1`` best-scoring candidates (of all
  depths) plus the root form the tree the target verifies.

Invariants:

- Candidates are numbered in creation order, so a parent's index is below its children's.
- Selection is ancestor-closed: a child's score never exceeds its parent's (probabilities
  are <= 1, and rounding cannot push ``s * p`` above ``s``), and ties are broken by candidate
  index (stable sort), so a parent always ranks before its children. (SGLang's ``topk`` has
  no defined tie order; this only pins it down.)
- In a :class:`VerifyTree` node 0 is the root and every parent precedes its children; node
  ``i`` sits at position ``root_position + depths[i]`` and attends to its ancestors and
  itself (:meth:`VerifyTree.ancestor_mask`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.drafters.protocol import ROOT, CandidateTree

# propose(tree, frontier, k) -> (probs (F, k) fp32, target token ids (F, k))
ProposeFn = Callable[[CandidateTree, Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class VerifyTree:
    """The nodes the target verifies: node 0 = root, parents before children."""

    tokens: torch.Tensor  # (N,) int64, target ids
    parents: torch.Tensor  # (N,) int64, -1 for the root
    depths: torch.Tensor  # (N,) int64, 0 for the root

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def draft_tree(propose: ProposeFn, root_token: int, num_steps: int, topk: int,
               num_draft_tokens: int) -> tuple[CandidateTree, VerifyTree]:
    """Run the drafter ``num_steps`` deep and select the verified tree (module docstring)."""
    tree = CandidateTree()
    probs, ids = propose(tree, [ROOT], topk)  # (1, k)
    frontier_scores = probs[0].float()  # (k,)
    frontier = tree.add(ids[0].tolist(), [ROOT] * topk, 1, frontier_scores)
    for step in range(1, num_steps):
        probs, ids = propose(tree, frontier, topk)  # (F, k)
        expanded = (frontier_scores[:, None] * probs.float()).reshape(-1)  # (F·k,)
        parents = [p for p in frontier for _ in range(topk)]
        children = tree.add(ids.reshape(-1).tolist(), parents, step + 1, expanded)
        best = _best(expanded, topk)
        frontier = [children[i] for i in best.tolist()]
        frontier_scores = expanded[best]
    return tree, select_verify_tree(tree, root_token, num_draft_tokens - 1)


def select_verify_tree(tree: CandidateTree, root_token: int, n: int) -> VerifyTree:
    """The root plus the ``n`` best candidates, in candidate order (ancestor-closed)."""
    scores = torch.cat(tree.scores)  # (C,)
    chosen = sorted(_best(scores, min(n, len(tree))).tolist())
    index = {node: i + 1 for i, node in enumerate(chosen)}  # candidate -> tree node
    parents = [-1]
    for node in chosen:
        parent = tree.parents[node]
        if parent != ROOT and parent not in index:
            raise RuntimeError(f"draft tree selection is not ancestor-closed at node {node}")
        parents.append(0 if parent == ROOT else index[parent])
    return VerifyTree(
        tokens=torch.tensor([root_token] + [tree.tokens[c] for c in chosen], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor([0] + [tree.depths[c] for c in chosen], dtype=torch.long))


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores; ties go to the lower index."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def accept_greedy(tree: VerifyTree, predictions: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: from the root, follow the child whose token is the target's
    prediction at the current node, until none matches or a leaf is reached.

    ``predictions`` (N,): the target's argmax at every node. Returns ``(path, attempted)``:
    the accepted node indices starting with the root (0), and how many draft positions were
    judged (``len(path) - 1``, plus one if the walk stopped at a node that had children).
    """
    tokens, preds, kids = tree.tokens.tolist(), predictions.tolist(), tree.children()
    path, attempted, node = [0], 0, 0
    while kids[node]:
        attempted += 1
        match = next((c for c in kids[node] if tokens[c] == preds[node]), None)
        if match is None:
            break
        path.append(match)
        node = match
    return path, attempted
