"""Drafters: who proposes the draft tree of each request at each step of the loop.

Interface (``Drafter``), called by fastverify.hf.loop once per step for the whole batch:

  reset(batch_size)              a new ``generate`` call begins
  propose(contexts, budget)      contexts: list of B token-id lists (the request's prompt without padding and
                                 every committed token; the last one is the root, not yet in the target's
                                 cache); budget: list of B ints, the most draft nodes the loop will score for
                                 each request (0 = finished, propose nothing). Returns B ``fastverify.tree.Tree``
                                 (possibly empty).
  update(accepted)               after verification: accepted draft nodes per request (None for requests
                                 that were not drafted for / are finished).

Drafters here:

  NGramDrafter       prompt + output lookup (transformers' prompt_lookup_num_tokens, vLLM's n-gram proposer),
                     but proposing a trie of the continuations of several earlier matches, with an incremental
                     n-gram index and adaptive depth/width.
  DraftModelDrafter  a smaller causal LM with the same tokenizer; greedy chain of k tokens, optionally with
                     the draft's top-k alternatives as sibling leaves at each depth.
"""

import torch

from fastverify.tree import Tree

__all__ = ["Drafter", "NGramDrafter", "DraftModelDrafter", "empty_tree"]


def empty_tree() -> Tree:
    return Tree(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), validate=False)


class Drafter:
    """Base class: proposes nothing (the loop then runs plain autoregressive decoding)."""

    def reset(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def propose(self, contexts, budget):
        return [empty_tree() for _ in contexts]

    def update(self, accepted) -> None:
        pass


class _NGramState:
    __slots__ = ("index", "indexed", "depth", "width", "last_depth")

    def __init__(self, depth, width):
        self.index = {}       # n-gram tuple -> positions e (the continuation starts at context[e]), oldest first
        self.indexed = 0      # end positions e < indexed are in the index
        self.depth = depth
        self.width = width
        self.last_depth = 0   # depth of the tree proposed at the last step (0 = nothing proposed)


class NGramDrafter(Drafter):
    """Prompt/output lookup drafter proposing a tree of continuations.

    The suffix n-gram of the context (longest n in [min_n, max_n] that occurred before) is looked up in an
    index of earlier occurrences; the continuations that followed the most recent ``width`` distinct
    matches (each ``depth`` tokens long) become a trie (``Tree.from_sequences``; shared prefixes merged).
    No match: no draft, so the step costs what a plain decoding step costs.

    The index is incremental: each step indexes only the newly committed tokens (O(new tokens * n-gram
    sizes)). Depth and width adapt per request (as vLLM / transformers' assisted generation adapt
    num_assistant_tokens): a step that rejects the whole draft halves the depth and narrows the tree; a step
    that accepts the whole path doubles the depth. Defaults are sized for CPU decoding where a forward over
    8 extra tokens costs ~1.2x a single-token step and 64 ~2.6x.

    Args: min_n, max_n: n-gram sizes; depth, max_depth, min_depth: initial / largest / smallest continuation
    length; width, max_width: initial / largest number of continuations; max_nodes: cap on the tree size;
    scan: how many most recent matches are examined to find ``width`` distinct continuations.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, depth: int = 4, max_depth: int = 12, min_depth: int = 1,
                 width: int = 2, max_width: int = 4, max_nodes: int = 16, scan: int = 32):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"min_n, max_n: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if not (1 <= min_depth <= depth <= max_depth):
            raise ValueError(f"depth: expected 1 <= min_depth <= depth <= max_depth, got {min_depth}, {depth}, "
                             f"{max_depth}")
        if not (1 <= width <= max_width):
            raise ValueError(f"width: expected 1 <= width <= max_width, got {width}, {max_width}")
        if max_nodes < 1 or scan < 1:
            raise ValueError(f"max_nodes, scan: expected >= 1, got {max_nodes}, {scan}")
        self.min_n, self.max_n = min_n, max_n
        self.depth0, self.max_depth, self.min_depth = depth, max_depth, min_depth
        self.width0, self.max_width = width, max_width
        self.max_nodes, self.scan = max_nodes, scan
        self.states = []

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self.states = [_NGramState(self.depth0, self.width0) for _ in range(batch_size)]

    def _index(self, st: _NGramState, ctx: list) -> None:
        # Index n-grams ending at e for every e with a continuation token ctx[e] (e <= len - 1).
        index = st.index
        for e in range(max(st.indexed, self.min_n), len(ctx)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                key = tuple(ctx[e - n:e])
                hits = index.get(key)
                if hits is None:
                    index[key] = [e]
                else:
                    hits.append(e)
        st.indexed = max(st.indexed, len(ctx))

    def _continuations(self, st: _NGramState, ctx: list, depth: int, width: int) -> list:
        L = len(ctx)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            hits = st.index.get(tuple(ctx[L - n:]))
            if not hits:
                continue
            seqs, seen = [], set()
            for e in reversed(hits[-self.scan:]):  # most recent matches first
                cont = tuple(ctx[e:e + depth])
                if cont and cont not in seen:
                    seen.add(cont)
                    seqs.append(cont)
                    if len(seqs) == width:
                        break
            return seqs
        return []

    def propose(self, contexts, budget):
        if len(self.states) != len(contexts):
            self.reset(len(contexts))
        trees = []
        for st, ctx, bud in zip(self.states, contexts, budget):
            ctx = ctx.tolist() if isinstance(ctx, torch.Tensor) else ctx
            self._index(st, ctx)
            st.last_depth = 0
            bud = min(int(bud), self.max_nodes)
            if bud <= 0:
                trees.append(empty_tree())
                continue
            depth = min(st.depth, bud)
            seqs = self._continuations(st, ctx, depth, st.width)
            if not seqs:
                trees.append(empty_tree())
                continue
            tree = Tree.from_sequences(seqs, max_nodes=bud)
            st.last_depth = tree.max_depth
            trees.append(tree)
        return trees

    def update(self, accepted) -> None:
        for st, acc in zip(self.states, accepted):
            if acc is None or st.last_depth == 0:
                continue
            if acc == 0:
                st.depth = max(self.min_depth, st.depth // 2)
                st.width = max(1, st.width - 1)
            elif acc >= st.last_depth:
                st.depth = min(self.max_depth, st.depth * 2)
            else:
                # Partial acceptance: aim just past what was accepted; a wider tree may catch the divergence.
                st.depth = max(self.min_depth, min(self.max_depth, acc + 2))
                st.width = min(self.max_width, st.width + 1)


class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM sharing the target's tokenizer.

    Each step it feeds the tokens committed since the last step (one forward over them), then decodes k
    tokens greedily (k - 1 more single-token forwards); with tree_topk > 1, the draft's top tree_topk
    tokens at each depth become siblings (the greedy token continues the chain, the others are leaves), so a
    tree costs no extra draft forwards. Its cache is cropped back to the committed context after drafting.
    One DynamicCache per request (requests have ragged contexts); draft models are small.

    Args: draft_model: a transformers causal LM (vocabulary must index the target's token ids); k: draft
    depth; tree_topk: candidates per depth (1 = chain).
    """

    def __init__(self, draft_model, k: int = 4, tree_topk: int = 1):
        if k < 1:
            raise ValueError(f"k: expected >= 1, got {k}")
        if tree_topk < 1:
            raise ValueError(f"tree_topk: expected >= 1, got {tree_topk}")
        self.model, self.k, self.tree_topk = draft_model, k, tree_topk
        self.caches, self.cached = [], []

    def reset(self, batch_size: int) -> None:
        from transformers import DynamicCache
        super().reset(batch_size)
        self.caches = [DynamicCache() for _ in range(batch_size)]
        self.cached = [0] * batch_size

    def _forward(self, b: int, tokens: list) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.tensor([tokens], dtype=torch.int64, device=device)
        pos = torch.arange(self.cached[b], self.cached[b] + len(tokens), device=device)[None]
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.caches[b], use_cache=True)
        self.cached[b] += len(tokens)
        return out.logits[0, -1].float()

    @torch.no_grad()
    def propose(self, contexts, budget):
        from fastverify.hf.attention import crop_cache
        if len(self.caches) != len(contexts):
            self.reset(len(contexts))
        trees = []
        for b, (ctx, bud) in enumerate(zip(contexts, budget)):
            ctx = ctx.tolist() if isinstance(ctx, torch.Tensor) else ctx
            bud = int(bud)
            if bud <= 0:
                trees.append(empty_tree())
                continue
            topk = min(self.tree_topk, bud)
            depth = max(1, min(self.k, bud // topk))
            logits = self._forward(b, ctx[self.cached[b]:])
            tokens, parents, chain_parent = [], [], -1
            for d in range(depth):
                cand = torch.topk(logits, topk).indices.tolist() if topk > 1 else [int(logits.argmax())]
                head = len(tokens)
                for t in cand:
                    tokens.append(t)
                    parents.append(chain_parent)
                chain_parent = head
                if d + 1 < depth:
                    logits = self._forward(b, [cand[0]])
            crop_cache(self.caches[b], len(ctx))
            self.cached[b] = len(ctx)
            trees.append(Tree(tokens, parents, validate=False))
        return trees
