"""Draft-tree building (SGLang's selection rules), tree masks and greedy tree verification."""

from __future__ import annotations

import pytest
import torch

from pipeline.evaluation.tree import (
    ROOT,
    CandidateTree,
    VerifyTree,
    accept_greedy,
    draft_tree,
)

# node token -> (probs, ids) of its children; 0 stands for the root (token 0 never drafted)
SCRIPT = {
    0: ([0.6, 0.4], [10, 11]),
    10: ([0.5, 0.3], [20, 21]),
    11: ([0.9, 0.1], [22, 23]),
    22: ([0.5, 0.5], [30, 31]),
    20: ([0.8, 0.2], [32, 33]),
}


def scripted(calls):
    def propose(tree: CandidateTree, frontier, k):
        calls.append([tree.path_tokens(n) for n in frontier])
        rows = [SCRIPT[0 if n == ROOT else tree.tokens[n]] for n in frontier]
        return (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))
    return propose


def test_tree_by_hand():
    """Scores: 10 .6, 11 .4 | 20 .30, 21 .18, 22 .36, 23 .04 -> frontier 22, 20 |
    30 .18, 31 .18, 32 .24, 33 .06. The best 5: 10, 11, 22, 20, 32."""
    calls = []
    candidates, tree = draft_tree(scripted(calls), root_token=7, num_steps=3, topk=2,
                                  num_draft_tokens=6)
    assert calls == [[[]], [[10], [11]], [[11, 22], [10, 20]]]  # frontier best first
    assert candidates.tokens == [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
    assert tree.tokens.tolist() == [7, 10, 11, 20, 22, 32]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert torch.allclose(torch.cat(candidates.scores),
                          torch.tensor([.6, .4, .3, .18, .36, .04, .18, .18, .24, .06]))


def test_fewer_draft_tokens_keep_the_best_and_stay_a_tree():
    _, tree = draft_tree(scripted([]), 7, num_steps=3, topk=2, num_draft_tokens=4)
    assert tree.tokens.tolist() == [7, 10, 11, 22]  # .6, .4, .36: 20 (.30) is out
    assert tree.parents.tolist() == [-1, 0, 0, 2]


def test_chain():
    def propose(tree, frontier, k):
        assert k == 1 and len(frontier) == 1
        return torch.tensor([[0.5]]), torch.tensor([[100 + tree.depth(frontier[0])]])

    _, tree = draft_tree(propose, 7, num_steps=4, topk=1, num_draft_tokens=5)
    assert tree.tokens.tolist() == [7, 100, 101, 102, 103]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask(), torch.ones(5, 5, dtype=torch.bool).tril())


def test_ties_still_give_an_ancestor_closed_tree():
    """All scores equal (probabilities of one): parents must still precede their children."""
    def propose(tree, frontier, k):
        base = 10 * (len(tree) + 1)
        ids = torch.arange(len(frontier) * k).view(len(frontier), k) + base
        return torch.ones(len(frontier), k), ids

    for n in range(2, 12):
        _, tree = draft_tree(propose, 7, num_steps=3, topk=2, num_draft_tokens=n)
        parents = tree.parents.tolist()
        assert all(p < i for i, p in enumerate(parents) if i), parents


def test_ancestor_mask():
    tree = VerifyTree(torch.tensor([7, 10, 11, 20, 22, 32]),
                      torch.tensor([-1, 0, 0, 1, 2, 3]), torch.tensor([0, 1, 1, 2, 2, 3]))
    mask = tree.ancestor_mask()
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    for i, row in enumerate(mask.tolist()):
        assert {j for j, v in enumerate(row) if v} == expected[i]


@pytest.mark.parametrize("preds, path, attempted", [
    ({0: 11, 2: 22}, [0, 2, 4], 2),  # second child of the root, then a leaf
    ({0: 10, 1: 99}, [0, 1], 2),  # rejected at depth 2
    ({0: 5}, [0], 1),  # rejected at once
    ({0: 10, 1: 20, 3: 32}, [0, 1, 3, 5], 3),  # the deepest leaf
])
def test_accept_greedy(preds, path, attempted):
    tree = VerifyTree(torch.tensor([7, 10, 11, 20, 22, 32]),
                      torch.tensor([-1, 0, 0, 1, 2, 3]), torch.tensor([0, 1, 1, 2, 2, 3]))
    predictions = torch.full((6,), 1)
    for node, token in preds.items():
        predictions[node] = token
    assert accept_greedy(tree, predictions) == (path, attempted)
