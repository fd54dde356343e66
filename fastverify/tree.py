"""Draft trees: one request's draft as (tokens, parents), its builders, and packing into the batch layout.

A tree of n draft nodes holds tokens int64 [n] and parents int32 [n] (local indices, -1 = child of the root,
the root being the last committed token). Parents precede children (parents[j] < j), which every kernel
relies on: depths, masks and verification visit nodes in index order.

Builders:
  Tree.from_parents(tokens, parents)           an explicit tree
  Tree.from_choices(choices, tokens_per_depth) Medusa's choice paths, e.g. [[0], [1], [0, 0], [0, 1]]: node
                                               [c1, ..., cd] takes the c_d-th candidate token of depth d
  Tree.from_sequences(sequences)               a trie of candidate token sequences (n-gram / lookup drafters),
                                               duplicate prefixes merged
  Tree.from_topk(tokens, scores, budget)       best-first top-k expansion of per-depth candidates (proposal
                                               heads, a draft model's top-k): the `budget` paths of highest
                                               cumulative score
pack(trees) -> (draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N]); unpack is its inverse.
"""

import heapq
import math

import torch

__all__ = ["Tree", "pack", "unpack"]


class Tree:
    """One request's draft tree. tokens int64 [n]; parents int32 [n] (local, -1 = child of the root)."""

    def __init__(self, tokens, parents, *, validate: bool = True):
        self.tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).cpu()
        self.parents = torch.as_tensor(parents, dtype=torch.int32).reshape(-1).cpu()
        if self.tokens.numel() != self.parents.numel():
            raise ValueError(f"tokens and parents: expected the same length, got {self.tokens.numel()} and "
                             f"{self.parents.numel()}")
        self._depth = None
        if validate:
            self.validate()

    def __len__(self):
        return self.tokens.numel()

    def __repr__(self):
        return f"Tree(n={len(self)}, max_depth={self.max_depth}, tokens={self.tokens.tolist()}, " \
               f"parents={self.parents.tolist()})"

    # -- structure ---------------------------------------------------------------------------------------

    def validate(self) -> "Tree":
        """Raise ValueError when a parent is out of range, the parent links form a cycle, or a parent does not
        precede its child. Returns self."""
        par = self.parents.tolist()
        n = len(par)
        for j, p in enumerate(par):
            if p < -1 or p >= n:
                raise ValueError(f"parents: node {j} has parent {p}, out of range (expected -1 for a child of the "
                                 f"root, or a node index in [0, {n}))")
        # Cycle check before the ordering check, so a cycle is reported as such.
        state = [0] * n  # 0 unvisited, 1 on the current walk, 2 reaches the root
        for start in range(n):
            walk, j = [], start
            while j != -1 and state[j] == 0:
                state[j] = 1
                walk.append(j)
                j = par[j]
            if j != -1 and state[j] == 1:
                cyc = walk[walk.index(j):]
                raise ValueError(f"parents: cycle through nodes {cyc} (every node must lead to the root, -1)")
            for w in walk:
                state[w] = 2
        for j, p in enumerate(par):
            if p >= j:
                raise ValueError(f"parents: node {j} has parent {p}, which does not precede it (parents must "
                                 f"satisfy parents[j] < j; reorder the nodes, e.g. with Tree.from_parents(..., "
                                 f"reorder=True))")
        return self

    @property
    def depth(self) -> torch.Tensor:
        """int32 [n]: depth of each node; a child of the root has depth 1."""
        if self._depth is None:
            d = []
            for p in self.parents.tolist():
                d.append(1 if p < 0 else d[p] + 1)
            self._depth = torch.tensor(d, dtype=torch.int32)
            self._max_depth = max(d, default=0)
        return self._depth

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0: no nodes), counted with ``depth`` (the loop reads it several times a step)."""
        if self._depth is None:
            self.depth
        return self._max_depth

    @property
    def children(self) -> list:
        """children[j]: the local indices of node j's children, in node order; the root's are `root_children`."""
        ch = [[] for _ in range(len(self))]
        for j, p in enumerate(self.parents.tolist()):
            if p >= 0:
                ch[p].append(j)
        return ch

    @property
    def root_children(self) -> list:
        return [j for j, p in enumerate(self.parents.tolist()) if p < 0]

    def leaves(self) -> list:
        has_child = set(p for p in self.parents.tolist() if p >= 0)
        return [j for j in range(len(self)) if j not in has_child]

    def paths(self) -> torch.Tensor:
        """int64 [num_leaves, max_depth]: for each leaf (in node order), the local node indices from the
        root's child down to the leaf, -1 padded. Like Medusa's retrieve_indices without the root column
        (add 1 and prepend 0 to get Medusa's convention, where index 0 is the root token)."""
        par = self.parents.tolist()
        leaves = self.leaves()
        out = torch.full((len(leaves), self.max_depth), -1, dtype=torch.int64)
        for r, leaf in enumerate(leaves):
            path, j = [], leaf
            while j != -1:
                path.append(j)
                j = par[j]
            out[r, :len(path)] = torch.tensor(path[::-1], dtype=torch.int64)
        return out

    # -- builders ----------------------------------------------------------------------------------------

    @classmethod
    def from_parents(cls, tokens, parents, *, reorder: bool = False) -> "Tree":
        """A tree from explicit tokens [n] and parents [n]. With reorder=True, nodes are first renumbered in
        breadth-first order (stable by index within a level) so that parents precede children."""
        if not reorder:
            return cls(tokens, parents)
        t = cls(tokens, parents, validate=False)
        par = t.parents.tolist()
        n = len(par)
        for j, p in enumerate(par):
            if p < -1 or p >= n:
                t.validate()  # raises the out-of-range error
        ch = [[] for _ in range(n + 1)]  # ch[n] = root
        for j, p in enumerate(par):
            ch[p if p >= 0 else n].append(j)
        order, frontier = [], ch[n]
        while frontier:
            order.extend(frontier)
            frontier = [c for j in frontier for c in ch[j]]
        if len(order) != n:
            t.validate()  # the remaining nodes are on a cycle: raises
        new = {old: i for i, old in enumerate(order)}
        return cls(t.tokens[order], [new[par[o]] if par[o] >= 0 else -1 for o in order])

    @classmethod
    def from_choices(cls, choices, tokens_per_depth) -> "Tree":
        """Medusa-style tree. choices: list of paths (lists of candidate ranks), e.g. [[0], [1], [0, 0]];
        every prefix of a path must itself be a path. tokens_per_depth: [depth][k] candidate tokens (list of
        lists or int tensor [D, k]): node [c1, ..., cd] drafts tokens_per_depth[d - 1][cd].
        Nodes are ordered as Medusa sorts its choices: by depth, then lexicographically."""
        cand = [list(map(int, row)) for row in (tokens_per_depth.tolist() if isinstance(tokens_per_depth,
                                                torch.Tensor) else tokens_per_depth)]
        paths = sorted({tuple(int(c) for c in ch) for ch in choices}, key=lambda x: (len(x), x))
        index = {}
        tokens, parents = [], []
        for path in paths:
            if len(path) == 0:
                raise ValueError("choices: empty path (the root is implicit)")
            d = len(path)
            if d > len(cand):
                raise ValueError(f"choices: path {list(path)} has depth {d} but tokens_per_depth has only "
                                 f"{len(cand)} depths")
            if path[-1] < 0 or path[-1] >= len(cand[d - 1]):
                raise ValueError(f"choices: path {list(path)} picks candidate {path[-1]} at depth {d}, which has "
                                 f"{len(cand[d - 1])} candidates")
            if d > 1 and path[:-1] not in index:
                raise ValueError(f"choices: path {list(path)} has no parent path {list(path[:-1])}")
            index[path] = len(tokens)
            tokens.append(cand[d - 1][path[-1]])
            parents.append(index[path[:-1]] if d > 1 else -1)
        return cls(tokens, parents)

    @classmethod
    def from_sequences(cls, sequences, max_nodes: int = None) -> "Tree":
        """A trie of candidate token sequences (each a list / 1-D tensor of token ids), duplicate prefixes
        merged; nodes numbered in order of first appearance. With max_nodes, insertion stops at the budget
        (a sequence that does not fit is truncated)."""
        tokens, parents = [], []
        child = {}  # (parent, token) -> node
        for seq in sequences:
            seq = seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
            p = -1
            for tok in seq:
                key = (p, int(tok))
                if key not in child:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    child[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(p)
                p = child[key]
        return cls(tokens, parents)

    @classmethod
    def from_topk(cls, tokens, scores=None, budget: int = 64, max_children=None) -> "Tree":
        """Best-first expansion of per-depth top-k candidates (Medusa / proposal heads, or a draft model's
        top-k per step), keeping the `budget` nodes of highest cumulative score.

        tokens: int [D, k] candidate tokens of depths 1..D (column 0 the most likely); scores: float [D, k]
        log-probabilities (default: log(1 / (rank + 1)), a Zipf prior); a node at depth d with path score s
        has, as candidate children, the tokens of depth d + 1 with scores s + scores[d]. Nodes are added in
        order of decreasing path score (ties: earlier first), and a node becomes a candidate only once its
        parent is in the tree, so parents always precede children. max_children (int or per-depth list)
        limits the branching at each depth."""
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [D, k], got shape {tuple(tokens.shape)}")
        D, k = tokens.shape
        if scores is None:
            scores = -torch.log(torch.arange(1, k + 1, dtype=torch.float64)).expand(D, k)
        scores = torch.as_tensor(scores, dtype=torch.float64)
        if tuple(scores.shape) != (D, k):
            raise ValueError(f"scores: expected shape {(D, k)} (as tokens), got {tuple(scores.shape)}")
        if bool(torch.isnan(scores).any()):
            raise ValueError("scores: contains NaN")
        if budget < 0:
            raise ValueError(f"budget: expected >= 0, got {budget}")
        if max_children is None:
            width = [k] * D
        elif isinstance(max_children, int):
            width = [min(k, max_children)] * D
        else:
            width = [min(k, int(w)) for w in max_children]
            if len(width) != D:
                raise ValueError(f"max_children: expected {D} entries, got {len(width)}")
        tok, sc = tokens.tolist(), scores.tolist()
        out_tokens, out_parents = [], []
        heap, counter = [], 0

        def push(parent, depth, base):  # depth: 0-based index of the children's depth
            nonlocal counter
            if depth >= D:
                return
            for r in range(width[depth]):
                heapq.heappush(heap, (-(base + sc[depth][r]), counter, parent, depth, r))
                counter += 1

        push(-1, 0, 0.0)
        while heap and len(out_tokens) < budget:
            neg, _, parent, depth, r = heapq.heappop(heap)
            if math.isinf(neg) and neg > 0:  # -inf log-probability: never worth drafting
                break
            out_tokens.append(int(tok[depth][r]))
            out_parents.append(parent)
            push(len(out_tokens) - 1, depth + 1, -neg)
        return cls(out_tokens, out_parents)

    @classmethod
    def chain(cls, tokens) -> "Tree":
        """A chain (each node the child of the previous one)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        return cls(tokens, torch.arange(tokens.numel(), dtype=torch.int32) - 1)


def pack(trees, device=None):
    """Batch layout of a list of trees: (draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N])."""
    trees = list(trees)
    sizes = torch.tensor([len(t) for t in trees], dtype=torch.int64)
    cu = torch.zeros(len(trees) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(sizes, 0).to(torch.int32)
    tokens = torch.cat([t.tokens for t in trees]) if trees else torch.zeros(0, dtype=torch.int64)
    parents = torch.cat([t.parents for t in trees]) if trees else torch.zeros(0, dtype=torch.int32)
    if device is not None:
        tokens, cu, parents = tokens.to(device), cu.to(device), parents.to(device)
    return tokens, cu, parents


def unpack(draft_tokens, cu_nodes, parents=None):
    """Inverse of pack: a list of B trees (parents None = chains)."""
    cu = cu_nodes.tolist()
    out = []
    for b in range(len(cu) - 1):
        tok = draft_tokens[cu[b]:cu[b + 1]].cpu()
        par = (parents[cu[b]:cu[b + 1]].cpu() if parents is not None
               else torch.arange(cu[b + 1] - cu[b], dtype=torch.int32) - 1)
        out.append(Tree(tok, par))
    return out
