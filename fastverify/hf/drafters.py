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

Opt-in: ``set_processors(repetition_penalty=..., banned=...)``, called by the loop before ``reset`` with what the
generate call's logits processors do to the target's rows (the base class keeps them as attributes).
``DraftModelDrafter`` processes its draft model's logits the same way, so that its drafts follow the processed
target, as transformers' assisted generation hands its logits processors to the assistant; the output never depends
on it.

Opt-in for drafters that read the target (DESIGN "Drafters that read the target"): a drafter with
``wants_hidden = True`` also gets, after ``update`` at every step,

  observe_hidden(hidden, active) hidden [B, D]: the target's final hidden state (the input of its output
                                 projection) at the row whose logits gave each request's next token, taken from
                                 the verify forward by a hook (no extra forward); active: B bools (False for
                                 finished requests). The first propose of a generate comes before any of these.

and one with ``wants_path_hidden = True`` as well gets, instead of observe_hidden,

  observe_path(rows, active)     rows: B tensors [n_b, D], the final hidden states along each request's accepted
                                 path (its root row, then each accepted node's row): the rows that produced the
                                 n_b tokens committed this step (fastverify.hf.eagle reads every generated row).

Such a drafter's ``hidden_size`` (D), where it sets one, is checked against the target's output projection before
the first step: a drafter made for a model of another width is refused by name.

Drafters here:

  NGramDrafter       prompt + output lookup (transformers' prompt_lookup_num_tokens, vLLM's n-gram proposer),
                     but proposing a trie of the continuations of several earlier matches, with an incremental
                     n-gram index and adaptive depth/width.
  DraftModelDrafter  a smaller causal LM with the same tokenizer; greedy chain of k tokens, optionally with
                     the draft's top-k alternatives as sibling leaves at each depth.
"""

import bisect
import numbers
import time
from collections import deque

import torch

from fastverify.hf.attention import cache_kwargs
from fastverify.tree import Tree

__all__ = ["Drafter", "NGramDrafter", "DraftModelDrafter", "empty_tree", "merge_scored", "cut_scored",
           "GPU_NODE_COST", "device_node_cost"]


def check_ints(**values) -> None:
    """TypeError naming the first of the keyword arguments that is not an integer (a bool is not one)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")


def penalized(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """generate's repetition penalty (RepetitionPenaltyLogitsProcessor's expression) on the scores of tokens the
    sequence holds: s < 0 ? s * penalty : s / penalty. A new tensor. The loop's verify rows and a draft model's
    chain (``DraftModelDrafter``) both take it from here."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def batch_drafting(budget) -> int:
    """The number of requests that may draft this step (budget > 0): R in the batched cost model. A batch of R
    requests shares one forward; each extra row costs it about what it costs a batch of one, so request b's
    expected tokens (1 + G_b) over its share of the step, (1 + fixed_cost) / R + node_cost * k_b, is the per-request
    ratio of (1 + G_b) / (1 + fixed_cost + R * node_cost * k_b)."""
    return max(1, sum(1 for bud in budget if int(bud) > 0))


# A drafted node's cost in plain steps where the model runs on a GPU and the drafter was given no node_cost. The
# drafters' defaults are CPU fits, where every verify row costs the linear layers its FMAs; on a GPU the verify
# step of a few rows is bound by its launches, not its rows. On an H200 with SmolLM2-135M (float32, batch 1, Spec-
# Bench's 39 questions, 128 new tokens; per question, the loop's time a step against its draft nodes a step): a
# step took 16.6-18.2 ms, its least-squares slope -0.18 / +0.16 ms per node (n-gram drafter, two runs) and -0.04
# (heads + n-gram), the host work around the forward (inputs, verify, commit, cache) +0.006-0.024 ms per node. A
# node costs within 1% of a step, the noise's bound: this value.
GPU_NODE_COST = 0.01


def device_node_cost(device, cpu_cost: float) -> float:
    """The node cost a drafter without an explicit ``node_cost`` uses on ``device``: its CPU fit on the CPU,
    ``GPU_NODE_COST`` elsewhere."""
    return float(cpu_cost) if torch.device(device).type == "cpu" else GPU_NODE_COST


_NO_TOKENS, _NO_PARENTS = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)


def empty_tree() -> Tree:
    """A tree of no nodes (its tensors, of no elements, shared by every empty tree: nothing to write in them)."""
    return Tree(_NO_TOKENS, _NO_PARENTS, validate=False)


def _conditionals(nodes):
    """{path: estimate that the path's last token is accepted given its parent is} of scored nodes (each path's
    prefixes among them)."""
    est = dict(nodes)
    out = {}
    for path, prob in nodes:
        above = est.get(path[:-1], 1.0)  # the root's (), or a prefix the list lacks: the path's own estimate
        out[path] = min(prob / above, 1.0) if above > 0 else 0.0
    return out


MERGE_RULES = ("max", "noisy_or")  # merge_scored's ways to score a path both sources propose


def merge_scored(own, other, limit: int, agree: str = "max"):
    """One trie of two drafters' scored nodes (lists of (path tuple, estimated probability that the whole path is
    accepted), each holding every prefix of its paths); best first, at most ``limit``. A path proposed by both:
    ``agree="max"`` keeps the larger estimate; ``agree="noisy_or"`` treats the two as independent evidence for the
    node: its conditional estimate (given its parent) is 1 - (1 - c_own)(1 - c_other), a node of one source keeps
    its own conditional, and a path's estimate is the product along it, so the subtree below an agreed node rises
    with it. Either way a parent's estimate is >= its children's, so a parent still comes before its children
    (ties: the shorter path first)."""
    if agree == "max":
        merged = dict(own)
        for path, prob in other:
            merged[path] = max(prob, merged.get(path, 0.0))
    elif agree == "noisy_or":
        cond = _conditionals(own)
        for path, c in _conditionals(other).items():
            cond[path] = 1.0 - (1.0 - cond[path]) * (1.0 - c) if path in cond else c
        merged = {}
        for path in sorted(cond, key=len):  # parents first
            merged[path] = cond[path] * merged.get(path[:-1], 1.0)
    else:
        raise ValueError(f"agree: expected one of {MERGE_RULES}, got {agree!r}")
    return sorted(merged.items(), key=lambda item: (-item[1], len(item[0])))[:limit]


def tree_of_paths(paths) -> Tree:
    """The Tree of token paths listed a parent before its children (node j is ``paths[j]``'s last token)."""
    index, tokens, parents = {(): -1}, [], []
    for path in paths:
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
    return Tree(tokens, parents, validate=False) if tokens else empty_tree()


def cut_scored(nodes, fixed_cost: float, node_cost: float, min_gain: float, drafting: int = 1):
    """The prefix of scored ``nodes`` (best first) that maximises the expected tokens per unit of cost,
    ``(1 + sum P) / (1 + fixed_cost + node_cost * drafting * k)`` (NGramDrafter's cost model; nothing unless the
    ratio beats ``min_gain``): (Tree, the kept paths). drafting: ``batch_drafting`` of the step's budgets."""
    best, keep, gain = min_gain, 0, 1.0
    for k, (_, prob) in enumerate(nodes, 1):
        gain += prob
        ratio = gain / (1.0 + fixed_cost + node_cost * drafting * k)
        if ratio > best:
            best, keep = ratio, k
    kept = [path for path, _ in nodes[:keep]]
    return tree_of_paths(kept), kept


class Drafter:
    """Base class: proposes nothing (the loop then runs plain autoregressive decoding)."""

    def reset(self, batch_size: int) -> None:
        self.batch_size = batch_size

    repetition_penalty = 1.0  # the generate call's (``set_processors``); 1.0: none
    banned = None  # (request, draft path) -> the tokens the target's row after that path has at -inf; None: none

    def set_processors(self, repetition_penalty: float = 1.0, banned=None) -> None:
        """Called by the loop before ``reset`` with what generate's logits processors do to the target's rows:
        repetition_penalty (the call's), banned (a function of a request's index and a tuple of draft tokens
        after its context: the set of tokens generate's processors set to -inf on that row; None when none
        does); and with the defaults once the call ends."""
        self.repetition_penalty = float(repetition_penalty)
        self.banned = banned

    # A cost-aware drafter's node_cost when none is given: its fit on a CPU; on another device ``set_device`` takes
    # ``device_node_cost``'s. None: the drafter has no cost model.
    CPU_NODE_COST = None

    def _default_node_cost(self, node_cost):
        """``node_cost`` as given, or (None) ``CPU_NODE_COST``, which ``set_device`` then follows the device with."""
        self._node_cost = node_cost
        return self.CPU_NODE_COST if node_cost is None else node_cost

    def set_device(self, device) -> None:
        """Called by the loop before ``reset`` with the device the model runs on: a drafter given no node_cost takes
        the device's (``device_node_cost``)."""
        if self.CPU_NODE_COST is not None and getattr(self, "_node_cost", 0) is None:
            self.node_cost = device_node_cost(device, self.CPU_NODE_COST)

    def propose(self, contexts, budget):
        return [empty_tree() for _ in contexts]

    def update(self, accepted) -> None:
        pass

    wants_hidden = False  # True: the loop calls observe_hidden after every verify (fastverify.hf.bpd)
    wants_path_hidden = False  # and True: observe_path (every accepted row's hidden state) instead
    hidden_size = None  # the width of the hidden state such a drafter reads, where it knows it (checked by the loop)

    def observe_hidden(self, hidden, active) -> None:
        """hidden [B, D]: the target's final hidden state at the row that gave each request's next token (it may
        view the forward's own rows: copy what is kept past the call); active: B bools (False: finished)."""

    # Opt-in: a drafter that knows its own confidence defines ``confident_prefix(trees, roots, beta) -> [int] * B``
    # (roots: each request's last committed token), the number of leading nodes of each tree's first path it
    # asserts at threshold beta. Under rule "confidence" the
    # loop accepts those nodes without the target's check (Lexical Unit Decoding's lookahead acceptance: lossy,
    # as the paper) and the target's argmax below them (fastverify.hf.loop, fastverify.hf.slots).
    confident_prefix = None


class _NGramState:
    __slots__ = ("index", "indexed", "depth", "width", "last_depth", "pending", "ctx")

    def __init__(self, depth, width):
        self.ctx = None       # the request's context as last seen (the memory takes it when the call ends)
        self.index = {}       # n-gram tuple -> positions e (the continuation starts at context[e]), oldest first
        self.indexed = 0      # end positions e < indexed are in the index
        self.depth = depth
        self.width = width
        self.last_depth = 0   # depth of the tree proposed at the last step (0 = nothing proposed)
        # the last proposal, scored against the committed tokens at the next propose:
        # (context length, accept_len or None, [(stat key, path tuple), ...])
        self.pending = None


def _distinct(continuations, width: int):
    """Continuations of earlier matches (token tuples, most recent match first) -> (the first ``width`` distinct
    non-empty ones, support: {path tuple: how many of the continuations run through it})."""
    seqs, seen, support = [], set(), {}
    for cont in continuations:
        for d in range(1, len(cont) + 1):
            support[cont[:d]] = support.get(cont[:d], 0) + 1
        if cont and cont not in seen and len(seqs) < width:
            seen.add(cont)
            seqs.append(cont)
    return seqs, support


class _NGramMemory:
    """The token sequences of earlier generate calls (each request's prompt and output), for ``NGramDrafter``'s
    lookups where they match a request's context further back than its own (vLLM's suffix decoding, SGLang's n-gram
    cache).

    One flat buffer of at most ``capacity`` tokens, the oldest sequences dropped first, a separator (-1, never a
    token) after each sequence, so that no match or continuation crosses one. The index maps each 2-gram to the
    global buffer positions that follow it (increasing); a lookup takes the context's last 2-gram and extends each
    of its most recent hits backwards while the tokens agree, up to ``max_n``: the longest match length found, and
    the continuations of the hits of that length, most recent first. ``base`` is the global position of
    ``buf[0]``: the index's entries below it (dropped sequences) are skipped, and removed once they are as many as
    the live ones."""

    SEP = -1

    def __init__(self, capacity: int, max_n: int = 8):
        self.capacity, self.max_n = capacity, max_n
        self.buf, self.base = [], 0  # tokens and separators; the global position of buf[0]
        self.seqs = deque()  # per sequence held, oldest first: its length in buf, separator included
        self.index = {}  # 2-gram -> global positions e (increasing): buf[e - base] follows that 2-gram
        self.live = self.stale = 0  # index entries of the sequences held / of those dropped, not yet removed

    def __len__(self) -> int:
        return len(self.buf)

    def add(self, tokens) -> None:
        """Remembers one sequence (its last ``capacity`` - 1 tokens), dropping the oldest to make room."""
        keep = self.capacity - 1
        tokens = list(tokens)[-keep:] if keep > 0 else []
        if len(tokens) < 3:  # no 2-gram with a continuation
            return
        while self.seqs and len(self.buf) + len(tokens) + 1 > self.capacity:
            size = self.seqs.popleft()
            del self.buf[:size]
            self.base += size
            self.live -= size - 3  # its index entries: a 2-gram before each of its tokens from the third
            self.stale += size - 3
        start, index = self.base + len(self.buf), self.index
        for i in range(2, len(tokens)):
            key = (tokens[i - 2], tokens[i - 1])
            hits = index.get(key)
            if hits is None:
                index[key] = [start + i]
            else:
                hits.append(start + i)
        self.buf += tokens
        self.buf.append(self.SEP)
        self.seqs.append(len(tokens) + 1)
        self.live += len(tokens) - 2
        if self.stale > self.live:
            self._prune()

    def _prune(self) -> None:
        """Removes the index's entries of the dropped sequences."""
        base, index = self.base, self.index
        for key in list(index):
            hits = index[key]
            if hits[0] < base:
                keep = hits[bisect.bisect_left(hits, base):]
                if keep:
                    index[key] = keep
                else:
                    del index[key]
        self.stale = 0

    def continuations(self, ctx: list, depth: int, width: int, scan: int):
        """(match length n >= 2, [continuation tuples, most recent first], support: {path tuple: count}) of the
        context's suffix; (0, [], {}) without a match."""
        L = len(ctx)
        if L < 2:
            return 0, [], {}
        hits = self.index.get((ctx[-2], ctx[-1]))
        if not hits:
            return 0, [], {}
        buf, base, max_n = self.buf, self.base, min(self.max_n, L)
        matched = []  # (match length, buffer index of the continuation), most recent first
        for e in reversed(hits[-scan:]):
            i = e - base
            if i < 0:  # a dropped sequence's entry (and every one before it)
                break
            n = 2
            while n < max_n and i - n - 1 >= 0 and buf[i - n - 1] == ctx[L - n - 1]:
                n += 1
            matched.append((n, i))
        if not matched:
            return 0, [], {}
        n = max(m for m, _ in matched)

        def upto_end(i):  # the continuation at buf[i], within its sequence
            cont = buf[i:i + depth]
            return tuple(cont[:cont.index(self.SEP)] if self.SEP in cont else cont)

        seqs, support = _distinct((upto_end(i) for m, i in matched if m == n), width)
        return (n, seqs, support) if seqs else (0, [], {})


# Acceptance priors: P(node accepted | parent accepted), keyed by (match length n, depth bucket, support bucket);
# measured offline on SmolLM2-135M-Instruct greedy outputs of 39 Spec-Bench questions (3 per category, 96 new
# tokens), replaying NGramDrafter's proposals. Used as Beta(PRIOR_WEIGHT * p, PRIOR_WEIGHT * (1 - p)) priors of
# the running estimates.
_DEPTH_BUCKETS = 4          # depth 1, 2, 3, >= 4
_PRIOR_WEIGHT = 8.0


def _support_bucket(count, parent_count):
    """0: the only continuation seen once; 1: seen >= 2 times and never contradicted; 2: the majority
    (> half of the matches through its parent); 3: a minority."""
    if count == parent_count:
        return 0 if count == 1 else 1
    return 2 if 2 * count > parent_count else 3


class NGramDrafter(Drafter):
    """Cost-aware prompt/output lookup drafter proposing a tree of continuations.

    Candidates. The suffix n-gram of the context (longest n in [min_n, max_n] that occurred before; longer
    matches are preferred because their continuations are accepted more often) is looked up in an index of
    earlier occurrences; the continuations that followed the most recent ``width`` distinct matches (each
    ``depth`` tokens long, most recent first) become a trie (shared prefixes merged).
    Every trie node also gets its support: how many of the (up to ``scan``) most recent matches continue
    through it. The index is incremental: each step indexes only the newly committed tokens. Depth and width
    adapt per request as before (all rejected: half the depth, narrower; whole path accepted: double the
    depth; partial: just past what was accepted, wider).

    Cost-aware selection. A forward over 1 + k tokens does not cost the same as a 1-token step. Measured
    through the loop on SmolLM2-135M fp32 with the default skinny linears (a chain of k random draft tokens,
    median over 6 Spec-Bench prompts x 2 generations of 24 tokens, 2-core AMD EPYC (Zen 5) VM, 2 threads), a
    drafted step costs, in plain steps: k = 1: 1.06, 2: 1.07, 4: 1.12, 6: 1.21, 8: 1.19, 12: 1.37, 16: 1.42. Hence
    the cost model ``cost(k) = 1 + fixed_cost + node_cost * k`` (in 1-token steps) for a draft of k > 0 nodes,
    defaults fixed_cost=0.05, node_cost=0.025 (the same fit with skinny_linear's AVX2 tiles only, on an earlier
    host: 0.12 / 0.04; without the skinny linears torch's small-M GEMM makes a 2-token forward ~1.6x a 1-token
    step: fixed_cost=0.55, node_cost=0.065 fit that). On a GPU a drafted row costs the forward next to nothing:
    without an explicit ``node_cost`` the drafter takes ``GPU_NODE_COST`` there (``set_device``, which the loop
    calls with the model's device).
    Each node's acceptance probability (given its parent was accepted) is a running Beta estimate keyed by (match
    length, depth bucket, support bucket: sole continuation seen once / seen >= 2 times uncontradicted / majority /
    minority), with priors measured offline (``_PRIORS``) and updated from the outcome of every candidate node
    (scored against the committed tokens at the next call: accepted, or would have been where a merged cut left it
    out, ``_observe``). A node's path probability is the product along its path;
    nodes are taken in decreasing path probability (a child never precedes its parent; the tree lists the kept
    nodes in that order, ``cut``) and the prefix that maximises
    the expected tokens per unit of cost ``(1 + sum P) / cost(k)`` is kept (in a batch where R requests draft, each
    request owns 1 / R of the shared step, so its cut uses ``node_cost * R``: a node costs the whole batch's step
    what it costs one request's, ``batch_drafting``); if that ratio does not beat plain decoding by ``min_gain``
    (default 1.0 = break even), nothing is proposed and the step costs a plain step. ``fixed_cost=0, node_cost=0``
    turns the selection off (every candidate node is proposed). Replaying the greedy outputs of 39 Spec-Bench
    questions (3 per category, 96 new tokens) under the 0.55 / 0.065 model: selection off 1.43 tokens per forward,
    1.02x plain decoding (writing 0.84x); on 1.29 tokens per forward, 1.15x (every category >= 1.00x). Weak matches
    (a 1-gram seen once: ~21% accepted) are no longer drafted; repeated 3-gram continuations (70-90% per node) are
    drafted deep.

    Memory (opt-in, ``memory=N``): the drafter keeps the token sequences of its earlier generate calls (each
    request's prompt and output), at most N tokens, the oldest dropped first, and drafts from them where they hold a
    longer match of the context's suffix (2 to 8 tokens) than the context itself (vLLM's suffix decoding and
    SGLang's n-gram cache keep such a store across requests): the continuations of that match, scored by their own
    running estimates (stat keys ("memory", n, ...)). A memory is the drafter's, so it lasts while the drafter does
    (``fastverify.patch(model, drafter=NGramDrafter(memory=N))``: every generate of the patched model); ``forget``
    empties it, and ``remember`` adds token sequences as if earlier calls had generated them (a corpus: REST's
    datastore, He et al. 2024). Like every draft, it changes the speed of a call, never its output; but a call's
    speed then depends on what earlier calls generated, as with a cache shared between requests. Measured on
    SmolLM2-135M (benchmarks/RESULTS.md): a prompt asked again drafts its whole earlier answer; on 39 different
    Spec-Bench questions in a row, 2% more tokens per step (5.7% with 103k tokens of the target's own outputs on
    other prompts given first; with the proposal heads, nothing). ~160 bytes a token of memory.

    Calibration (opt-in, ``calibrate=True``, batch of one): the wall time between consecutive ``propose`` calls is one
    whole step of the loop; steps without draft give a running plain-step time, drafted steps of k nodes an
    observed fixed cost ``t / t_plain - 1 - node_cost * k``; the fixed cost used is ``fixed_cost`` (weight 4)
    averaged with the last 32 observations. Why: the drafted step's extra cost grows with the context (on a
    769-token summarization prompt, a drafted step of the loop measured ~2.3x a plain step against 1.6-2.0x
    at 150 tokens), so a fixed constant overdrafts long prompts. The loop does not report per-step forward
    times to drafters; wall time between calls includes verify/commit, which is the cost that matters.
    Off by default: in a side-by-side Spec-Bench run (13 questions, 96 tokens, loaded 2-core machine) it
    helped short prompts a little but, from noisy timings, stopped drafting on an extraction question that
    the fixed model drafts at 4.0 tokens per forward (17.8 vs 30.8 tok/s).

    Args: min_n, max_n: n-gram sizes; depth, max_depth, min_depth: initial / largest / smallest continuation
    length; width, max_width: initial / largest number of continuations; max_nodes: cap on the tree size;
    scan: how many most recent matches are examined (distinct continuations and supports); fixed_cost,
    node_cost: the cost model above (>= 0; node_cost None: 0.025 on a CPU, ``GPU_NODE_COST`` on a GPU);
    min_gain: required ratio of expected tokens per cost (> 0); calibrate: learn the fixed cost from measured step
    times (above); memory: tokens of earlier calls kept to draft from (above; 0, the default: none).
    """

    _PRIORS = {}  # filled below the class
    CPU_NODE_COST = 0.025  # the default node_cost on a CPU (above)

    def __init__(self, min_n: int = 1, max_n: int = 3, depth: int = 4, max_depth: int = 12, min_depth: int = 1,
                 width: int = 2, max_width: int = 4, max_nodes: int = 16, scan: int = 32,
                 fixed_cost: float = 0.05, node_cost: float = None, min_gain: float = 1.0,
                 calibrate: bool = False, memory: int = 0):
        check_ints(min_n=min_n, max_n=max_n, depth=depth, max_depth=max_depth, min_depth=min_depth, width=width,
                   max_width=max_width, max_nodes=max_nodes, scan=scan, memory=memory)
        if memory < 0:
            raise ValueError(f"memory: expected >= 0 (tokens of earlier calls kept; 0: none), got {memory}")
        if not (1 <= min_n <= max_n):
            raise ValueError(f"min_n, max_n: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if not (1 <= min_depth <= depth <= max_depth):
            raise ValueError(f"depth: expected 1 <= min_depth <= depth <= max_depth, got {min_depth}, {depth}, "
                             f"{max_depth}")
        if not (1 <= width <= max_width):
            raise ValueError(f"width: expected 1 <= width <= max_width, got {width}, {max_width}")
        if max_nodes < 1 or scan < 1:
            raise ValueError(f"max_nodes, scan: expected >= 1, got {max_nodes}, {scan}")
        node_cost = self._default_node_cost(node_cost)
        if not (fixed_cost >= 0 and node_cost >= 0):
            raise ValueError(f"fixed_cost, node_cost: expected >= 0, got {fixed_cost}, {node_cost}")
        if not min_gain > 0:
            raise ValueError(f"min_gain: expected > 0, got {min_gain}")
        self.min_n, self.max_n = min_n, max_n
        self.depth0, self.max_depth, self.min_depth = depth, max_depth, min_depth
        self.width0, self.max_width = width, max_width
        self.max_nodes, self.scan = max_nodes, scan
        self.fixed_cost, self.node_cost, self.min_gain = float(fixed_cost), float(node_cost), float(min_gain)
        self.states = []
        self.memory = _NGramMemory(int(memory)) if memory else None
        # running acceptance counts per key: [accepted, rejected] (priors added at lookup); kept across
        # generate calls (the rates describe the model and the text, not one request)
        self.counts = {}
        # cost calibration (batch of one): wall time between consecutive propose calls = one whole step
        self.calibrate, self.clock = calibrate, time.perf_counter
        self._last, self._prompt_gap = None, True  # (clock at the last propose, nodes proposed then); see reset
        self.plain_step = None            # running mean of a step without draft, seconds
        self._fixed_obs = []              # observed fixed costs of drafted steps (in plain steps)

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        if self.memory is not None:  # the calls before this one: each request's prompt and output
            for st in self.states:
                if st.ctx:
                    self.memory.add(st.ctx)
        self.states = [_NGramState(self.depth0, self.width0) for _ in range(batch_size)]
        # the first gap between proposes holds the first step's forward, which also runs the prompt: not timed
        self._last, self._prompt_gap = None, True

    def remember(self, sequences) -> None:
        """Adds token sequences to the memory of earlier calls (``memory``) as if earlier calls had generated them: a
        corpus to draft from (documents the answers will quote, code the model will edit, the target's own outputs on
        other prompts). ``sequences``: an iterable of sequences of token ids of the patched model's vocabulary (lists
        of ints, 1-D integer tensors), or a 2-D integer tensor, a sequence per row (padding is the caller's to
        strip). They are held as a call's tokens are: the oldest dropped first once the memory holds its ``memory``
        tokens. Every sequence is checked before any is added."""
        if self.memory is None:
            raise ValueError("remember: this drafter keeps no memory of earlier calls; make it with "
                             "NGramDrafter(memory=N), N the tokens to keep")
        if isinstance(sequences, torch.Tensor) and sequences.dim() != 2:
            raise ValueError(f"sequences: expected a 2-D tensor of token ids (a sequence per row) or an iterable of "
                             f"sequences, got a {sequences.dim()}-D tensor")
        if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__iter__"):
            raise TypeError(f"sequences: expected an iterable of token id sequences, got {type(sequences).__name__}")
        checked = []
        for i, seq in enumerate(sequences):
            if isinstance(seq, torch.Tensor):
                if seq.dim() != 1 or seq.dtype == torch.bool or seq.is_floating_point() or seq.is_complex():
                    raise ValueError(f"sequences[{i}]: expected a 1-D integer tensor of token ids, got a "
                                     f"{seq.dim()}-D {seq.dtype} tensor")
                seq = seq.tolist()
            elif isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
                raise TypeError(f"sequences[{i}]: expected a sequence of token ids, got {type(seq).__name__}")
            else:
                seq = list(seq)
                for t in seq:
                    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                        raise TypeError(f"sequences[{i}]: expected token ids (ints), got {t!r}")
                seq = [int(t) for t in seq]
            if seq and min(seq) < 0:
                raise ValueError(f"sequences[{i}]: expected token ids >= 0, got {min(seq)}")
            checked.append(seq)
        for seq in checked:
            self.memory.add(seq)

    def forget(self) -> None:
        """Empties the memory of earlier calls (``memory``); the running acceptance estimates stay."""
        if self.memory is not None:
            self.memory = _NGramMemory(self.memory.capacity)
        for st in self.states:
            st.ctx = None

    def step_fixed_cost(self) -> float:
        """The fixed cost of a drafted step in plain steps: ``fixed_cost`` (prior, weight 4) averaged with the
        last 32 observed ``t_drafted / t_plain - 1 - node_cost * k`` (clipped to [0, 4])."""
        obs = self._fixed_obs[-32:]
        return (4 * self.fixed_cost + sum(obs)) / (4 + len(obs))

    def _time_step(self, proposed: int) -> None:
        now = self.clock()
        if self._last is not None and self._prompt_gap:
            self._prompt_gap = False
        elif self.calibrate and self.batch_size == 1 and self._last is not None:
            dt, k = now - self._last[0], self._last[1]
            if k == 0:
                self.plain_step = dt if self.plain_step is None else 0.8 * self.plain_step + 0.2 * dt
            elif self.plain_step:
                self._fixed_obs.append(min(4.0, max(0.0, dt / self.plain_step - 1.0 - self.node_cost * k)))
                del self._fixed_obs[:-32]
        self._last = (now, proposed)

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

    def _continuations(self, st: _NGramState, ctx: list, depth: int, width: int):
        """(match length n, [continuation tuples, most recent first], support: {path tuple: count})."""
        L = len(ctx)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            hits = st.index.get(tuple(ctx[L - n:]))
            if not hits:
                continue
            seqs, support = _distinct((tuple(ctx[e:e + depth]) for e in reversed(hits[-self.scan:])), width)
            return n, seqs, support  # (most recent matches first)
        return 0, [], {}

    def acceptance(self, key) -> float:
        """Estimated P(node accepted | parent accepted) for a stat key (n, depth bucket, support bucket), or
        ("memory", n, depth bucket, support bucket) for a continuation from the memory of earlier calls."""
        # unmeasured keys fall back to the same (n, depth) with the sole-continuation prior, then to 0.3 (the
        # memory's keys have no measured prior: 0.3, about what its depth-1 nodes were accepted at on Spec-Bench)
        p0 = self._PRIORS.get(key, self._PRIORS.get(key[:2] + (0,), 0.3))
        a, r = self.counts.get(key, (0, 0))
        return (a + _PRIOR_WEIGHT * p0) / (a + r + _PRIOR_WEIGHT)

    def _observe(self, st: _NGramState, ctx: list) -> None:
        """Scores the last proposal against the step's committed tokens (its accepted nodes and the target's next
        token): a node's outcome is observed where its parent's path was committed, and it was accepted, or would
        have been, where its own token is the one committed after that path. A candidate the tree did not hold (cut
        by a drafter that merged it with its own, ``scored_nodes``; pruned by the loop) counts as the target's
        tokens say, not as rejected: counted rejected, a merged cut's pruned continuations lowered their own
        estimates, and the cut then pruned them further."""
        if st.pending is None:
            return
        L0, acc, nodes = st.pending
        st.pending = None
        if acc is None:
            return
        new = tuple(ctx[L0:L0 + acc + 1])  # the accepted nodes' tokens, then the next token (where committed)
        for key, path in nodes:
            d = len(path)
            if d > len(new) or new[:d - 1] != path[:-1]:
                continue
            c = self.counts.setdefault(key, [0, 0])
            c[0 if new[d - 1] == path[-1] else 1] += 1

    def _scored(self, match: tuple, seqs: list, support: dict, bud: int):
        """Candidate trie -> ({path tuple: (path probability, stat key)}, the best ``bud`` paths in decreasing
        probability, a parent before its children). match: the stat keys' first part (``_lookups``)."""
        nodes = {}  # path tuple -> (path probability, key)
        total = sum(support[s[:1]] for s in {s[:1]: 0 for s in seqs})  # matches continuing at all
        for s in seqs:
            prob, parent_count = 1.0, total
            for d in range(1, len(s) + 1):
                path = s[:d]
                cnt = support.get(path, 1)
                key = match + (min(d, _DEPTH_BUCKETS), _support_bucket(cnt, max(parent_count, cnt)))
                if path not in nodes:
                    prob *= self.acceptance(key)
                    nodes[path] = (prob, key)
                else:
                    prob = nodes[path][0]
                parent_count = cnt
        # decreasing probability; ties by depth so that a parent always precedes its child
        return nodes, sorted(nodes, key=lambda p: (-nodes[p][0], len(p)))[:bud]

    def cut(self, nodes, drafting: int = 1):
        """Its cost cut of scored ``nodes`` [(path, estimate)], best first, a parent before its children (its own,
        or a trie merged with another drafter's): ``cut_scored`` under its cost model (the fixed cost calibrated,
        ``step_fixed_cost``); every node where ``fixed_cost`` and ``node_cost`` are both 0. (Tree, kept paths).
        drafting: ``batch_drafting`` of the step's budgets."""
        if self.fixed_cost == 0 and self.node_cost == 0:
            kept = [path for path, _ in nodes]
            return tree_of_paths(kept), kept
        return cut_scored(nodes, self.step_fixed_cost(), self.node_cost, self.min_gain, drafting)

    def _lookups(self, contexts, budget):
        """Per request, what ``propose`` and ``scored_nodes`` share: score the last proposal, index the newly
        committed tokens, look up the continuations (in the memory of earlier calls where its match is longer
        than the context's). Yields (state, context, budget, match, seqs, support): match, the stat keys' first
        part ((n,) for a match of n tokens in the context, ("memory", n) in the memory, n capped at 3 and 4); seqs
        is empty without budget or match."""
        if len(self.states) != len(contexts):
            self.reset(len(contexts))
        for st, ctx, bud in zip(self.states, contexts, budget):
            ctx = ctx.tolist() if isinstance(ctx, torch.Tensor) else ctx
            self._observe(st, ctx)
            self._index(st, ctx)
            st.last_depth = 0
            bud = min(int(bud), self.max_nodes)
            st.ctx = ctx
            n, seqs, support = (self._continuations(st, ctx, min(st.depth, bud), st.width) if bud > 0
                                else (0, [], {}))
            match = (min(n, 3),)
            if bud > 0 and self.memory is not None:  # the earlier calls' continuations of a longer match
                found = self.memory.continuations(ctx, min(st.depth, bud), st.width, self.scan)
                if found[0] > n:
                    n, seqs, support = found
                    match = ("memory", min(n, 4))
            yield st, ctx, bud, match, seqs, support

    def propose(self, contexts, budget):
        trees, drafting = [], batch_drafting(budget)
        for st, ctx, bud, match, seqs, support in self._lookups(contexts, budget):
            tree, kept = empty_tree(), []
            if seqs:
                nodes, order = self._scored(match, seqs, support, bud)
                tree, kept = self.cut([(p, nodes[p][0]) for p in order], drafting)
            if kept:
                st.last_depth = tree.max_depth
                st.pending = (len(ctx), None, [(nodes[p][1], p) for p in kept])
            trees.append(tree)
        self._time_step(sum(len(t) for t in trees))
        return trees

    def scored_nodes(self, contexts, budget):
        """Per request, the candidate nodes before the cost cut, for a drafter that merges them with its own and
        cuts the union with one cost model (fastverify.hf.bpd): a list of (path tuple, estimated probability
        that the whole path is accepted), best first, a parent before its children. Keeps the bookkeeping of
        ``propose`` (every candidate's outcome is scored against the committed tokens at the next call)."""
        out = []
        for st, ctx, bud, match, seqs, support in self._lookups(contexts, budget):
            if not seqs:
                out.append([])
                continue
            nodes, order = self._scored(match, seqs, support, bud)
            st.last_depth = max(len(p) for p in order)
            st.pending = (len(ctx), None, [(nodes[p][1], p) for p in order])
            out.append([(p, nodes[p][0]) for p in order])
        self._time_step(sum(len(o) for o in out))
        return out

    def kept_nodes(self, paths) -> None:
        """After ``scored_nodes``, from the drafter that merged and cut them: per request, the paths (token tuples)
        its tree kept. The depth adaptation (``update``) then compares the accepted length with the depth of this
        drafter's candidates that were kept, as it does after ``propose``, not with the depth of all candidates
        (a cut that trims a long copy would otherwise read as a partial acceptance and keep the lookahead short)."""
        for st, kept in zip(self.states, paths):
            if st.pending is None:
                continue
            mine = {path for _, path in st.pending[2]}
            st.last_depth = max((len(p) for p in kept if p in mine), default=0)

    def update(self, accepted) -> None:
        for st, acc in zip(self.states, accepted):
            if acc is None or st.last_depth == 0:
                continue
            if st.pending is not None:
                st.pending = (st.pending[0], int(acc), st.pending[2])
            if acc == 0:
                st.depth = max(self.min_depth, st.depth // 2)
                st.width = max(1, st.width - 1)
            elif acc >= st.last_depth:
                st.depth = min(self.max_depth, st.depth * 2)
            else:
                # Partial acceptance: aim just past what was accepted; a wider tree may catch the divergence.
                st.depth = max(self.min_depth, min(self.max_depth, acc + 2))
                st.width = min(self.max_width, st.width + 1)


NGramDrafter._PRIORS = {  # (n, depth bucket, support bucket) -> P(accepted | parent accepted), see above
    (1, 1, 0): 0.214, (1, 1, 1): 0.322, (1, 1, 2): 0.25, (1, 1, 3): 0.109, (1, 2, 0): 0.519, (1, 2, 1): 0.667,
    (1, 2, 3): 0.083, (1, 3, 0): 0.793, (1, 4, 0): 0.857, (2, 1, 0): 0.39, (2, 1, 1): 0.765, (2, 1, 3): 0.1,
    (2, 2, 0): 0.579, (2, 3, 0): 0.778, (2, 4, 0): 0.714, (3, 1, 0): 0.713, (3, 1, 1): 0.769, (3, 1, 3): 0.421,
    (3, 2, 0): 0.819, (3, 2, 1): 0.879, (3, 2, 3): 0.429, (3, 3, 0): 0.864, (3, 3, 1): 1.0, (3, 3, 3): 0.2,
    (3, 4, 0): 0.88, (3, 4, 1): 0.98, (3, 4, 3): 0.5,
}

class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM sharing the target's tokenizer.

    Each step it feeds the tokens committed since the last step (one forward over them), then decodes k
    tokens greedily (k - 1 more single-token forwards); with tree_topk > 1, the draft's top tree_topk
    tokens at each depth become siblings (the greedy token continues the chain, the others are leaves), so a
    tree costs no extra draft forwards. Its cache is cropped back to the committed context after drafting.
    One DynamicCache per request (requests have ragged contexts); draft models are small. Its float32 CPU
    linear layers run through ``fastverify.skinny_linear`` while it drafts (fastverify.hf.linear).

    Args: draft_model: a transformers causal LM with the target's vocabulary (``patch`` refuses another size:
    ``vocabulary_mismatch``); k: draft depth; tree_topk: candidates per depth (1 = chain).
    """

    K = 4  # the default draft depth

    def __init__(self, draft_model, k: int = K, tree_topk: int = 1):
        if not isinstance(draft_model, torch.nn.Module):
            raise TypeError(f"draft_model: expected a transformers causal LM (a torch.nn.Module), got "
                            f"{type(draft_model).__name__}")
        check_ints(k=k, tree_topk=tree_topk)
        if k < 1:
            raise ValueError(f"k: expected >= 1, got {k}")
        if tree_topk < 1:
            raise ValueError(f"tree_topk: expected >= 1, got {tree_topk}")
        self.model, self.k, self.tree_topk = draft_model, k, tree_topk
        self.caches, self.cached = [], []

    def vocabulary_mismatch(self, target):
        """Why the draft model cannot draft for ``target`` (its vocabulary, as ``model_vocab_size`` reads it, is not
        the target's: it would read the target's token ids out of its embedding's range, or propose ids outside
        the target's vocabulary), or None. transformers' assisted generation likewise takes an assistant of
        another vocabulary size only with both tokenizers."""
        from fastverify.hf.loop import model_vocab_size
        mine, theirs = model_vocab_size(self.model), model_vocab_size(target)
        if mine == theirs:
            return None
        return (f"the draft model's vocabulary has {mine} token ids and the model's {theirs}: a draft model must "
                f"share the model's tokenizer and vocabulary")

    def reset(self, batch_size: int) -> None:
        from fastverify.hf.attention import new_cache
        super().reset(batch_size)
        self.caches = [new_cache() for _ in range(batch_size)]  # appends in place: no copy of the cache per token
        self.cached = [0] * batch_size

    def _forward(self, b: int, tokens: list) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.tensor([tokens], dtype=torch.int64, device=device)
        pos = torch.arange(self.cached[b], self.cached[b] + len(tokens), device=device)[None]
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                         **cache_kwargs(self.model, self.caches[b]))
        self.cached[b] += len(tokens)
        return out.logits[0, -1].float()

    @torch.no_grad()
    def propose(self, contexts, budget):
        from fastverify.hf.linear import model_lock, skinny_linears
        if len(self.caches) != len(contexts):
            self.reset(len(contexts))
        lock = model_lock(self.model)
        if not lock.acquire(blocking=False):  # another thread's loop has the draft model's layers bound: as they are
            return self._propose(contexts, budget)
        try:
            with skinny_linears(self.model):  # the draft's 1-token forwards too: its weights streamed once per token
                return self._propose(contexts, budget)
        finally:
            lock.release()

    def _propose(self, contexts, budget):
        from fastverify.hf.attention import crop_cache
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
            seen = None
            if self.repetition_penalty != 1.0:  # as the target's rows: the sequence's tokens penalised
                seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                seen[torch.tensor([t for t in set(ctx) if t < seen.numel()], dtype=torch.int64)] = True
            tokens, parents, chain, chain_parent = [], [], [], -1
            for d in range(depth):
                if seen is not None:
                    logits = torch.where(seen, penalized(logits, self.repetition_penalty), logits)
                if self.banned is not None:  # the tokens the target's row after this chain cannot pick
                    ban = [t for t in self.banned(b, tuple(chain)) if t < logits.shape[-1]]
                    if ban:
                        logits = logits.index_fill(0, torch.tensor(ban, device=logits.device), float("-inf"))
                cand = torch.topk(logits, topk).indices.tolist() if topk > 1 else [int(logits.argmax())]
                head = len(tokens)
                for t in cand:
                    tokens.append(t)
                    parents.append(chain_parent)
                chain_parent = head
                chain.append(cand[0])
                if d + 1 < depth:
                    logits = self._forward(b, [cand[0]])
                    if seen is not None:
                        seen[cand[0]] = True
            crop_cache(self.caches[b], len(ctx))
            self.cached[b] = len(ctx)
            trees.append(Tree(tokens, parents, validate=False))
        return trees
