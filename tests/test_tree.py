"""fastverify.tree: Tree structure, builders (parents, Medusa choices, trie of sequences, top-k), pack/unpack."""

import random

import pytest
import torch

from fastverify.tree import Tree, pack, unpack


def walk_depth(par, i):
    d = 0
    while i != -1:
        d, i = d + 1, par[i]
    return d


def _ancestors(par, i):
    out = []
    while i != -1:
        out.append(i)
        i = par[i]
    return out


def random_parents(n, rng):
    return [rng.randint(-1, j - 1) for j in range(n)]


@pytest.mark.parametrize("n", [0, 1, 5, 64, 512])
def test_structure_matches_walk(n):
    rng = random.Random(n)
    par = random_parents(n, rng)
    t = Tree.from_parents(torch.arange(n) + 100, par)
    assert t.depth.dtype == torch.int32
    assert t.depth.tolist() == [walk_depth(par, i) for i in range(n)]
    assert t.max_depth == max([walk_depth(par, i) for i in range(n)], default=0)
    ch = t.children
    for j in range(n):
        assert ch[j] == [c for c in range(n) if par[c] == j]
    assert t.root_children == [c for c in range(n) if par[c] == -1]
    paths = t.paths()
    leaves = [j for j in range(n) if j not in set(par)]
    assert paths.shape == (len(leaves), t.max_depth) and paths.dtype == torch.int64
    for row, leaf in zip(paths.tolist(), leaves):
        path = [x for x in row if x != -1]
        assert row[len(path):] == [-1] * (len(row) - len(path))  # padding only at the end
        assert path[-1] == leaf and par[path[0]] == -1
        assert all(par[b] == a for a, b in zip(path, path[1:]))


def test_medusa_choices():
    # A Medusa-style choice list, given unsorted: nodes come out sorted by (depth, path).
    choices = [[0, 0], [1], [0], [0, 1], [2], [1, 0], [0, 0, 0]]
    topk = [[11, 12, 13], [21, 22], [31]]
    t = Tree.from_choices(choices, topk)
    order = sorted(map(tuple, choices), key=lambda x: (len(x), x))
    assert order == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert t.tokens.tolist() == [topk[len(c) - 1][c[-1]] for c in order]
    assert t.parents.tolist() == [-1, -1, -1, 0, 0, 1, 3]
    assert t.paths().tolist() == [[2, -1, -1], [0, 4, -1], [1, 5, -1], [0, 3, 6]]
    assert torch.equal(Tree.from_choices(choices, torch.tensor([[11, 12, 13], [21, 22, 0], [31, 0, 0]])).tokens,
                       t.tokens)
    with pytest.raises(ValueError, match=r"choices: path \[1, 1\] has no parent path|picks candidate"):
        Tree.from_choices([[0], [1, 1]], topk)
    with pytest.raises(ValueError, match=r"choices: path \[0, 5\] picks candidate 5 at depth 2"):
        Tree.from_choices([[0], [0, 5]], topk)
    with pytest.raises(ValueError, match="has depth 4 but tokens_per_depth has only 3"):
        Tree.from_choices([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], topk)
    with pytest.raises(ValueError, match=r"choices: path \[1, 0\] has no parent path \[1\]"):
        Tree.from_choices([[0], [1, 0]], topk)


def test_sequences_trie():
    seqs = [[5, 6, 7], [5, 6, 8], [5, 9], [4], [5, 6, 7, 1], [], torch.tensor([4, 2])]
    t = Tree.from_sequences(seqs)
    assert t.tokens.tolist() == [5, 6, 7, 8, 9, 4, 1, 2]
    assert t.parents.tolist() == [-1, 0, 1, 1, 0, -1, 2, 5]
    # every sequence is a root-to-node path, and no two siblings share a token
    for seq in seqs:
        seq = list(map(int, seq))
        p = -1
        for tok in seq:
            kids = [j for j in range(len(t)) if t.parents[j] == p and t.tokens[j] == tok]
            assert len(kids) == 1
            p = kids[0]
    budget = Tree.from_sequences(seqs, max_nodes=4)
    assert budget.tokens.tolist() == [5, 6, 7, 8]


def test_topk_expansion():
    tokens = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]))
    t = Tree.from_topk(tokens, logp, budget=6)
    # best paths by cumulative probability: 10 (.6), 10-20 (.54), 11 (.3), 10-20-30 (.27), 11-20 (.27),
    # 10-20-31 (.216)
    assert t.tokens.tolist() == [10, 20, 11, 30, 20, 31]
    assert t.parents.tolist() == [-1, 0, -1, 1, 2, 1]
    # the tree holds exactly the `budget` best paths: every excluded candidate scores no better than the worst kept
    import itertools
    nodes = {tuple(t.tokens[j].item() for j in reversed(_ancestors(t.parents.tolist(), i))) for i in range(len(t))}
    every = [path for d in (1, 2, 3) for path in itertools.product(range(3), repeat=d)]
    prob = {tuple(tokens[i][r].item() for i, r in enumerate(path)): float(sum(logp[i][r] for i, r in enumerate(path)))
            for path in every}
    best = sorted(prob, key=lambda x: -prob[x])[:6]
    assert nodes == set(best)
    assert len(Tree.from_topk(tokens, logp, budget=100)) == 3 + 9 + 27
    assert len(Tree.from_topk(tokens, logp, budget=0)) == 0
    narrow = Tree.from_topk(tokens, logp, budget=100, max_children=[2, 1, 1])
    assert len(narrow) == 2 + 2 + 2
    default = Tree.from_topk(tokens, budget=5)  # Zipf prior: ranks matter
    assert default.tokens[0] == 10 and len(default) == 5
    with pytest.raises(ValueError, match=r"scores: expected shape \(3, 3\)"):
        Tree.from_topk(tokens, logp[:2], budget=4)


@pytest.mark.parametrize("seed", range(3))
def test_topk_parents_precede(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (5, 4), generator=g)
    scores = torch.randn(5, 4, generator=g)  # arbitrary scores, even positive: order must still hold
    t = Tree.from_topk(tokens, scores, budget=40)
    assert len(t) == 40
    assert all(p < j for j, p in enumerate(t.parents.tolist()))


def test_validate_errors():
    with pytest.raises(ValueError, match=r"parents: cycle through nodes \[0, 1\]"):
        Tree([1, 2, 3], [1, 0, -1])
    with pytest.raises(ValueError, match=r"parents: cycle through nodes \[2\]"):
        Tree([1, 2, 3], [-1, 0, 2])
    with pytest.raises(ValueError, match="parents: node 1 has parent 5, out of range"):
        Tree([1, 2], [-1, 5])
    with pytest.raises(ValueError, match="parents: node 0 has parent -3, out of range"):
        Tree([1], [-3])
    with pytest.raises(ValueError, match="parents: node 0 has parent 1, which does not precede it"):
        Tree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="tokens and parents: expected the same length"):
        Tree([1, 2], [-1])


def test_reorder():
    t = Tree.from_parents([7, 8, 9, 6], [1, 3, 1, -1], reorder=True)
    assert t.tokens.tolist() == [6, 8, 7, 9]
    assert t.parents.tolist() == [-1, 0, 1, 1]
    with pytest.raises(ValueError, match="cycle"):
        Tree.from_parents([1, 2, 3], [-1, 2, 1], reorder=True)


def test_pack_unpack_roundtrip():
    rng = random.Random(11)
    trees = [Tree.from_parents(torch.randint(0, 50, (n,)), random_parents(n, rng)) for n in (3, 0, 17, 1)]
    tokens, cu, parents = pack(trees)
    assert tokens.dtype == torch.int64 and cu.dtype == torch.int32 and parents.dtype == torch.int32
    assert cu.tolist() == [0, 3, 3, 20, 21]
    back = unpack(tokens, cu, parents)
    for a, b in zip(trees, back):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    chains = unpack(torch.arange(5), torch.tensor([0, 2, 5]))
    assert chains[1].parents.tolist() == [-1, 0, 1]
    empty = pack([])
    assert empty[0].numel() == 0 and empty[1].tolist() == [0]
    assert Tree.chain([4, 5, 6]).depth.tolist() == [1, 2, 3]
