"""Blockwise parallel decoding drafter: proposal heads on the target's own hidden state (Stern et al. 2018 §4).

Combined scoring and proposal: the forward that verifies step t also proposes step t + 1. After verify the loop
hands the drafter (``observe_hidden``) the target's final hidden state at the row where each request's accepted
path ends, the row whose logits gave ``next_token``; the heads p_2..p_k (fastverify.heads) turn it into
candidates for the k - 1 positions after ``next_token``, which is the root of the next draft. No extra forward
of the target; what it costs is one pass of the heads (H residual blocks and the output projection over the
heads' vocabulary subset, all heads in one ``skinny_linear`` call on the CPU; there the heads' weights and the
projection are streamed in their fewest exact bytes: packed blocks for a Q8_0 checkpoint and SmolLM2's Q8_0
output head, else float16, half the bytes of float32, which took drafting from 2.96 to 2.22 ms per step on
SmolLM2 with as many steps).

Tree. Head p_{d+1}'s top ``width`` candidates are the options at depth d. A node's estimated probability of
being accepted is the product, along its path, of a per-depth acceptance estimate (Medusa's independence
assumption):

  score="calibrated"  (default when the checkpoint has a calibration table) the head's softmax probability of
                the candidate mapped through the table measured on held-out prompts at training time: the
                frequency with which candidates of that probability were the target's token (dynamic, like
                "prob", but without the heads' over- or under-confidence)
  score="prob"  the head's own softmax probability of the candidate (dynamic: a confident head drafts deeper)
  score="rank"  the measured held-out frequency with which head p_{d+1}'s rank-r candidate is the target's
                token (the checkpoint's ``head_acceptance``; Medusa's static sparse tree)

Sequential heads (fastverify.heads, Hydra): a node's children depend on its path, so the tree grows level by level
from the root (the next token, the last token of the context): at depth d the heads' step p_{d+2} runs on every
node of the frontier (all requests' frontiers in one projection), its top ``width`` candidates become the
node's children, scored by the same per-depth estimate (for sequential heads a conditional one: the calibration
was measured with the path above right); children whose path estimate is below what one node costs (``node_cost``
x drafting requests) can never pay for themselves in the cut and are dropped. Of the rest, the ``frontier`` best
are expanded at the next depth, but only those whose best child is expected to join the cut: the child's estimate
times the checkpoint's measured acceptance of the next head's top candidate (``head_acceptance``) must exceed the
least estimate with which a node raises the request's expected tokens per cost so far (node_cost x drafting x that
ratio). A level costs ~0.04 of a step on SmolLM2 on the CPU; without this rule the last level ran for nothing in
most steps (its children all cut); with it drafting took 1.42 instead of 2.06 ms per step on the tuning questions,
with 1.3% more steps, 1.03x in time (benchmarks/RESULTS.md). A tree of depth k costs k small projections instead
of one; the estimates need no independence assumption.

Nodes are added best first (``Tree.from_topk``), and the tree is cut at the size k that maximises expected
tokens per cost, (1 + sum of the kept nodes' probabilities) / (1 + fixed_cost + node_cost * k), the cost model
of NGramDrafter; no draft when no k beats ``min_gain``. Defaults fixed_cost 0.1, node_cost 0.11 on a CPU
(``GPU_NODE_COST`` where the model runs on a GPU, whose verify forward costs the same for a few rows more): the model
forward of the loop, timed per step on SmolLM2-135M with its packed (GGUF Q4_1 / Q8_0) weights (2-core Intel Xeon,
AVX-512, benchmarks/step_cost.py), costs 1.01 plain steps at k = 1 node, 1.07-1.19 at 2-4, 1.29-1.46 at 5-6,
1.53-1.68 at 7-9 and 2.06-2.29 at 12-16, and the heads' own pass ~0.1 of a step; on the tuning questions
(Spec-Bench question 1 of each category) node_cost 0.06 / 0.085 / 0.11 / 0.14 / 0.18 gave 1.11 / 1.13 / 1.15 /
1.14 / 1.12x n-gram fastverify. (On the float32 weights of the Zen 5 host the curve was flatter, 1.25-1.29 at 6-11
nodes, and 0.05 / 0.06 measured best: benchmarks/RESULTS.md.) The first step of a generate has no hidden state
yet: it drafts nothing (or the n-gram drafter's tree, when combined).

Combined with an n-gram drafter (``ngram=NGramDrafter()``, "bpd+ngram"): both propose scored candidate nodes
(the n-gram drafter's ``scored_nodes``: its candidates with their estimated path probabilities, before its own cost
cut), the two sets become one trie, and one cost-aware cut, the one above, keeps the best prefix of the union, at most
``max_nodes``. A node both propose is scored as two independent pieces of evidence (``agree="noisy_or"``): its
estimate given its parent is 1 - (1 - c_heads)(1 - c_ngram), and the nodes below it rise with it. On the tuning
questions such nodes were accepted at 0.595 at depth 1 where the larger of the two estimates said 0.505 and the
noisy-or 0.603 (``agree="max"`` keeps the larger one; benchmarks/RESULTS.md). In a batch of R drafting requests
the cut uses ``node_cost * R`` (they share one forward: fastverify.hf.drafters.batch_drafting). So a strong
n-gram match (a copy) is not crowded out by weak head candidates, and neither source's nodes are paid for twice.

A step whose n-gram candidates already expect ``ngram_confident`` (1.5) accepted tokens or more (a copy) skips the
heads' pass (~0.09 of a step on SmolLM2 on the CPU): there the heads rarely add an accepted token. Measured on
the held-out Spec-Bench questions: 40 of 53 steps skipped in extraction, 12 of 195 in writing, with the same
number of steps (benchmarks/RESULTS.md).

Rules. Greedy verification (the default) keeps the output exactly the target's. BPD's approximate rules
(``rule="topk"``, Stern §5.1; ``rule="distance"``, §5.2; ``min_accept``, §5.3) run with these drafts as with
any other; they change the output (lossy) and are opt-in.
"""

import math
import warnings

import torch
import torch.nn.functional as F

from fastverify.heads import ProposalHeads, load_heads, output_projection, unit_rms
from fastverify.hf.drafters import (MERGE_RULES, Drafter, batch_drafting, check_ints, cut_scored, empty_tree,
                                    merge_scored)
from fastverify.hf.linear import skinny_available
from fastverify.ops.linear import PackedWeight, pack_blocks, skinny_linear, skinny_linear_packed
from fastverify.tree import Tree

__all__ = ["HeadsDrafter", "load_drafter"]


def _stream_dtype(w: torch.Tensor) -> torch.dtype:
    """float16 for a weight that skinny_linear streams on the CPU, float32 elsewhere (F.linear)."""
    return torch.float16 if w.device.type == "cpu" and skinny_available() else torch.float32


def _lossless(w: torch.Tensor):
    """w (float32) in the fewest bytes that stream its exact values: packed blocks where they hold it on the CPU
    (checkpoints saved in q8_0; ``_linear`` streams them with skinny_linear_packed), else its streaming dtype where
    that holds it (checkpoints saved in float16), else float32; contiguous."""
    if _stream_dtype(w) == torch.float16:
        packed = pack_blocks(w.contiguous())
        if packed is not None:
            return packed
    h = w.to(_stream_dtype(w))
    return (h if torch.equal(h.float(), w) else w).contiguous()


class HeadsDrafter(Drafter):
    """Drafter from proposal heads on the target's hidden state.

    Args: model: the target (its output projection is used, restricted to the heads' vocabulary subset);
    heads: ProposalHeads; width: candidates per head (per depth, per expanded node for sequential heads);
    frontier: sequential heads: nodes expanded per depth and request; max_nodes: cap on the tree size; score: "prob"
    or "rank" (above); head_acceptance: [H][ranks] measured acceptance by rank (for score="rank"); temperature:
    applied to the heads' logits before the softmax (score="prob"); fixed_cost, node_cost, min_gain: the cost
    model; ngram: an NGramDrafter to merge with (anything with its ``scored_nodes`` and its cost cut, ``cut``), or
    None; ngram_confident: with ngram, a request whose n-gram candidates already expect at least this many accepted
    tokens (the sum of their estimates) skips the heads' pass for the step (None: never); agree: with ngram, the
    estimate of a node both propose (``merge_scored``: "noisy_or", the default, or "max"); graphs: sequential heads:
    their tree levels over fixed buffers, each depth's level a CUDA graph on a GPU (``_LevelGraphs``: three host
    calls a level instead of ~17 kernel launches; True on a CPU runs the same buffers eagerly), None (default): on a
    CUDA device.

    With ngram, a request the heads propose nothing for (the first step, whose hidden state the prompt's forward
    has not handed yet; a confident copy) takes the n-gram drafter's own step: its candidates cut by its own cost
    model, the tree ``NGramDrafter.propose`` would make. Cut by the heads' cost model, a first step's copy was
    trimmed to its likeliest node and, rejected, halved the n-gram drafter's lookahead for the steps after it.
    """

    wants_hidden = True
    agree = "noisy_or"  # how a node both the heads and the n-gram drafter propose is scored (merge_scored)
    level_graphs = False  # the tree levels over fixed buffers, CUDA graphs on a GPU (option graphs; _LevelGraphs)
    _levels = None  # their buffers (_level_buffers)
    CPU_NODE_COST = 0.11  # the default node_cost on a CPU (above); on a GPU, GPU_NODE_COST (set_device)

    @property
    def _grows(self) -> bool:
        """Whether the tree grows level by level (``_sequential_nodes``) rather than from per-head candidates."""
        return self.heads.sequential

    def __init__(self, model, heads: ProposalHeads, *, width: int = 4, max_nodes: int = 16, score: str = "auto",
                 head_acceptance=None, calibration=None, temperature: float = 1.0, fixed_cost: float = 0.1,
                 node_cost: float = None, min_gain: float = 1.0, max_depth: int = None, ngram: Drafter = None,
                 frontier: int = 4, ngram_confident: float = 1.5, agree: str = "noisy_or", graphs: bool = None):
        weight = output_projection(model)[0]
        if heads.hidden_size != weight.shape[1]:
            raise ValueError(f"heads: hidden size {heads.hidden_size}, the model's output projection takes "
                             f"{weight.shape[1]}")
        self.heads = heads.to(weight.device)
        self.hidden_size = heads.hidden_size
        if agree not in MERGE_RULES:
            raise ValueError(f"agree: expected one of {MERGE_RULES}, got {agree!r}")
        self.agree = agree
        self._setup(model, heads.vocab_subset, heads.num_heads, width=width, max_nodes=max_nodes, score=score,
                    head_acceptance=head_acceptance, calibration=calibration, temperature=temperature,
                    fixed_cost=fixed_cost, node_cost=node_cost, min_gain=min_gain, max_depth=max_depth, ngram=ngram,
                    frontier=frontier, ngram_confident=ngram_confident)
        # sequential heads read draft tokens through the target's input embedding
        self.embed = model.get_input_embeddings().weight.detach() if heads.sequential else None
        # a sequential head's two products in one: [W_i | U_i] [F, 2D] against [state | n(e)] (one skinny_linear),
        # and a feed-forward head's output projection O_i [D, F]
        self.step_weight = ([_lossless(torch.cat([heads.weight[i], heads.token_weight[i]], 1).detach().float())
                             for i in range(heads.num_heads)] if heads.sequential else None)
        self.out_weight = ([_lossless(heads.out_weight[i].detach().float()) for i in range(heads.num_heads)]
                           if heads.sequential and heads.out_weight is not None else None)
        if graphs not in (None, True, False):
            raise ValueError(f"graphs: expected None, True or False, got {graphs!r}")
        self.level_graphs = heads.sequential and (self.device.type == "cuda" if graphs is None else bool(graphs))

    def _setup(self, model, subset, levels: int, *, width, max_nodes, score, head_acceptance, calibration,
               temperature, fixed_cost, node_cost, min_gain, max_depth, ngram, frontier, ngram_confident):
        """What every drafter of this family shares: the output projection over the vocabulary subset, the
        candidates' scoring (``levels`` rows of acceptance / calibration tables), the cost model and the n-gram
        drafter to merge with."""
        if score == "auto":
            score = "calibrated" if calibration is not None else "prob"
        if score not in ("prob", "rank", "calibrated"):
            raise ValueError(f"score: expected 'auto', 'calibrated', 'prob' or 'rank', got {score!r}")
        if score == "rank" and head_acceptance is None:
            raise ValueError("score='rank' needs head_acceptance (the checkpoint's measured acceptance by rank)")
        if score == "calibrated" and calibration is None:
            raise ValueError("score='calibrated' needs calibration (the checkpoint's calibration table)")
        check_ints(width=width, max_nodes=max_nodes, frontier=frontier)
        if max_depth is not None:
            check_ints(max_depth=max_depth)
            if max_depth < 1:
                raise ValueError(f"max_depth: expected >= 1 (the most tree levels the heads grow) or None, got "
                                 f"{max_depth}")
        if width < 1 or max_nodes < 1 or frontier < 1:
            raise ValueError(f"width, max_nodes, frontier: expected >= 1, got {width}, {max_nodes}, {frontier}")
        if not temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {temperature}")
        weight, bias = output_projection(model)
        self.subset = None if subset is None else subset.cpu()  # the columns' token ids, read on the host (_to_host)
        # the output projection over the drafter's vocabulary: a contiguous copy of the subset's rows (on the CPU
        # this is what skinny_linear streams once per tree level, in float16: half the bytes of float32, which it
        # reads as their exact float32 values; rounding the model's weights to float16 moves drafts only, never
        # the verified output), or the model's own weight
        w = weight.detach() if subset is None else weight.detach()[self.subset.to(weight.device)]
        self.device = w.device
        # a projection of exactly block-quantised values (a GGUF model's output head) streams packed on the CPU:
        # its exact float32 values in fewer bytes than float16 (SmolLM2's Q8_0 head: 1.25 bytes per weight); then
        # no other copy is kept
        self.packed = pack_blocks(w.float()) if w.device.type == "cpu" and skinny_available() else None
        self.weight = w.to(_stream_dtype(w)).contiguous() if self.packed is None else None
        if bias is not None:
            bias = (bias.detach() if subset is None else bias.detach()[self.subset.to(bias.device)]).float()
        self.bias = bias
        self.width = min(int(width), w.shape[0])
        self.max_nodes, self.score, self.temperature = int(max_nodes), score, float(temperature)
        self.frontier = int(frontier)
        self.depth = levels if max_depth is None else max(1, min(int(max_depth), levels))
        if head_acceptance is not None:
            acc = torch.as_tensor(head_acceptance, dtype=torch.float64)
            if acc.dim() != 2 or acc.shape[0] != levels:
                raise ValueError(f"head_acceptance: expected [{levels}, ranks], got {tuple(acc.shape)}")
            self.rank_logp = torch.log(acc.clamp(min=1e-6))
        else:
            self.rank_logp = None
        # per depth, the log of the expected acceptance of a head's top candidate given its path (the measured rank-0
        # acceptance; 0 without a table: a child is expanded when it could join the cut itself; _sequential_nodes)
        self.ahead_logp = [0.0 if self.rank_logp is None else float(self.rank_logp[d, 0]) for d in range(self.depth)]
        if calibration is not None:
            edges = torch.as_tensor(calibration["bins"], dtype=torch.float32)
            acc = torch.as_tensor(calibration["acceptance"], dtype=torch.float64)
            if acc.dim() != 2 or acc.shape != (levels, edges.numel() - 1):
                raise ValueError(f"calibration: expected acceptance [{levels}, {edges.numel() - 1}], got "
                                 f"{tuple(acc.shape)}")
            self.calib_edges, self.calib_logp = edges[1:-1], torch.log(acc.clamp(min=1e-6))
        self._tables = None  # _tables_on
        node_cost = self._default_node_cost(node_cost)
        if not (fixed_cost >= 0 and node_cost >= 0):
            raise ValueError(f"fixed_cost, node_cost: expected >= 0, got {fixed_cost}, {node_cost}")
        self.fixed_cost, self.node_cost, self.min_gain = float(fixed_cost), float(node_cost), float(min_gain)
        if ngram is not None and not all(callable(getattr(ngram, f, None))
                                         for f in ("scored_nodes", "cut")):
            raise TypeError(f"ngram: expected an NGramDrafter (a drafter with scored_nodes and its cost cut), got "
                            f"{type(ngram).__name__}")
        self.ngram = ngram
        if ngram_confident is not None and not ngram_confident > 0:
            raise ValueError(f"ngram_confident: expected > 0 or None, got {ngram_confident}")
        self.ngram_confident = None if ngram_confident is None else float(ngram_confident)
        self.candidates = []

    # -- Drafter interface ----------------------------------------------------------------------------------

    def set_device(self, device) -> None:
        super().set_device(device)
        if self.ngram is not None and callable(getattr(self.ngram, "set_device", None)):
            self.ngram.set_device(device)

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        # per request: (tokens [H, width] list, log-scores [H, width] list); sequential heads: the hidden row [D]
        self.candidates = [None] * batch_size
        if self.ngram is not None:
            self.ngram.reset(batch_size)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] fp32 -> logits [N, V'] over the heads' vocabulary (skinny_linear on the CPU)."""
        if x.device.type == "cpu":
            if self.packed is not None:
                return skinny_linear_packed(x.contiguous(), self.packed, self.bias)
            return skinny_linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] -> logits [H, B, V'] fp32 over the heads' vocabulary (all heads in one projection).
        Parallel heads only (sequential heads depend on the path: ``_sequential_nodes``)."""
        if self.heads.sequential:
            raise ValueError("head_logits: sequential heads read the draft's tokens; they run level by level")
        r = self.heads(hidden)  # [H, B, D]
        H, B, D = r.shape
        return self._project(r.reshape(H * B, D)).reshape(H, B, -1)

    def _top(self, logits: torch.Tensor, depth):
        """The top ``width`` candidates of head rows logits [..., V'] (depth: the tree depth of their head, p_{d+2}:
        an int, or an int64 tensor that broadcasts against [..., width], one depth per row) -> (their columns
        [..., k] int64, their estimated log-probability of acceptance [..., k] float64), both on the logits' device,
        k = width (score="rank": at most the table's ranks). One log_softmax of the rows, the candidates' bins looked
        up in log space: a handful of kernels per level on a GPU, where logsumexp alone launched several."""
        if self.score == "rank":
            cols = logits.topk(min(self.width, self.rank_logp.shape[1]), dim=-1).indices
            table = self._tables_on(logits.device)
            return cols, table[depth, torch.arange(cols.shape[-1], device=cols.device)].expand(cols.shape)
        t = self.temperature if self.score == "prob" else 1.0  # the calibration was measured at temperature 1
        top = (logits if t == 1.0 else logits / t).log_softmax(-1).topk(self.width, dim=-1)
        if self.score == "prob":
            return top.indices, top.values.double()
        log_edges, table = self._tables_on(logits.device)
        return top.indices, table[depth, torch.bucketize(top.values, log_edges, right=True)]

    def _tables_on(self, device):
        """The scoring tables on ``device``, copied there once: score="calibrated": (the bins' inner edges as log
        probabilities, log acceptance [levels, bins]); score="rank": log acceptance [levels, ranks]."""
        if self._tables is None or self._tables[0].device != device:
            if self.score == "calibrated":
                self._tables = (self.calib_edges.log().to(device), self.calib_logp.to(device))
            else:
                self._tables = (self.rank_logp.to(device),)
        return self._tables if self.score == "calibrated" else self._tables[0]

    @torch.no_grad()
    def observe_hidden(self, hidden: torch.Tensor, active=None) -> None:
        """hidden [B, D]: the target's final hidden state (input of its output projection) at the row whose
        logits gave each request's next token. active: list of B bools (False: finished, ignored)."""
        B = hidden.shape[0]
        if len(self.candidates) != B:
            self.candidates = [None] * B
        rows = [b for b in range(B) if active is None or active[b]]
        if not rows:
            return
        if self.heads.sequential:  # the tree is grown at propose, once the root (next token) is in the context
            for b in rows:
                self.candidates[b] = hidden[b].float().clone()
            return
        logits = self.head_logits(hidden[rows])[:self.depth]  # [H', b, V']
        cols, scores = self._top(logits, torch.arange(logits.shape[0], device=logits.device)[:, None, None])
        scores, tokens = self._to_host(cols, scores)
        for i, b in enumerate(rows):
            self.candidates[b] = ([tokens[d][i] for d in range(len(tokens))], scores[:, i])

    def _to_host(self, cols: torch.Tensor, scores: torch.Tensor):
        """``_top``'s candidates on the host in one copy (float64 holds every column): (scores, float64 tensor;
        their token ids, nested lists)."""
        return self._from_host(_packed(cols, scores).cpu())

    def _from_host(self, both: torch.Tensor):
        """``_packed`` candidates on the host [..., 2k] -> (scores [..., k] float64; token ids, nested lists)."""
        k = both.shape[-1] // 2
        ids = both[..., k:].long()
        return both[..., :k], (ids if self.subset is None else self.subset[ids]).tolist()

    def _heads_nodes(self, b: int, budget: int):
        """The heads' candidate nodes for request b: [(path tuple, estimated probability that the path is
        accepted)], best first (a parent before its children), at most ``budget``."""
        cand = self.candidates[b]
        if cand is None or budget <= 0:
            return []
        tokens, scores = cand
        tree = Tree.from_topk(tokens, scores, budget=min(budget, self.max_nodes))
        par, dep, tok = tree.parents.tolist(), tree.depth.tolist(), tree.tokens.tolist()
        paths, logp = [], []
        for j, p in enumerate(par):
            d = dep[j] - 1
            logp.append((logp[p] if p >= 0 else 0.0) + float(scores[d][tokens[d].index(tok[j])]))
            paths.append((paths[p] if p >= 0 else ()) + (tok[j],))
        return [(path, math.exp(lp)) for path, lp in zip(paths, logp)]

    # The tree grows level by level (``_sequential_nodes``) through three hooks, which a drafter of this family
    # with another model overrides (fastverify.hf.eagle): the frontier's state at the root, one level (the
    # frontier's state and its nodes' tokens -> the children's state and the logits their candidates come from),
    # and the state of the expanded nodes.

    def _grow_start(self, reqs):
        """The drafting requests' root state: the hidden rows handed by ``observe_hidden`` [m, D]."""
        return torch.stack([self.candidates[b] for b in reqs])

    def _grow_level(self, d: int, state, tokens, owner):
        """Sequential head p_{d+2} on the frontier: state [m, D], tokens (the frontier nodes' tokens: a list, or a
        tensor on the drafter's device) -> (the heads' states [m, D], logits [m, V'])."""
        dev = state.device
        e = self.embed[torch.as_tensor(tokens, dtype=torch.int64, device=self.embed.device)].to(dev).float()
        e = unit_rms(e)  # as ProposalHeads.step
        x = torch.cat([state, e], 1)
        a = F.silu(self._linear(x, self.step_weight[d], self.heads.bias[d]))
        state = state + (a if self.out_weight is None else self._linear(a, self.out_weight[d]))
        return state, self._project(state)

    @staticmethod
    def _linear(x: torch.Tensor, weight, bias: torch.Tensor = None) -> torch.Tensor:
        """x @ weight.T + bias for the drafter's own weights (``_lossless``): skinny_linear on the CPU (a float16
        weight streamed as its values; packed blocks by skinny_linear_packed), F.linear in x's dtype elsewhere."""
        if isinstance(weight, PackedWeight):
            return skinny_linear_packed(x.contiguous(), weight, bias)
        if x.device.type == "cpu":
            return skinny_linear(x.contiguous(), weight, bias)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def _grow_select(self, state, rows):
        """The state of the frontier's nodes ``rows`` (indices into the last level's rows: a list, or an int64 tensor
        on the drafter's device), which expand next."""
        return state[torch.as_tensor(rows, dtype=torch.int64, device=state.device)]

    @torch.no_grad()
    def _sequential_nodes(self, contexts, buds, drafting: int):
        """Sequential heads: per request, [(path tuple, estimated probability that the path is accepted)], best
        first (a parent before its children), at most its budget. Level by level from each request's root
        (``contexts[b][-1]``); one projection per depth for every request's frontier."""
        B = len(contexts)
        out = [[] for _ in range(B)]
        reqs = [b for b in range(B) if buds[b] > 0 and self.candidates[b] is not None]
        if not reqs:
            return out
        floor = math.log(self.node_cost * drafting) if self.node_cost > 0 else -math.inf
        levels = self._level_buffers(B) if self.level_graphs else None
        state = self._grow_start(reqs) if levels is None else None
        owner, paths, logp = reqs, [()] * len(reqs), [0.0] * len(reqs)
        rows, tokens = list(range(len(reqs))), [contexts[b][-1] for b in reqs]
        for d in range(self.depth):
            if levels is None:
                state, logits = self._grow_level(d, state, tokens, owner)
                score, cand = self._to_host(*self._top(logits, d))
            else:
                score, cand = self._from_host(levels.run(d, rows, tokens, reqs if d == 0 else None))
            score = score.tolist()
            children = {}  # request -> [(log-estimate, path, row)]
            for j, b in enumerate(owner):
                for c, s in zip(cand[j], score[j]):
                    lp = logp[j] + s
                    if lp > floor:
                        children.setdefault(b, []).append((lp, paths[j] + (c,), j))
            rows, owner, paths, logp = [], [], [], []
            last = d + 1 >= self.depth
            for b, ch in children.items():
                ch.sort(key=lambda x: -x[0])
                out[b].extend((path, math.exp(lp)) for lp, path, _ in ch)
                if last:
                    continue
                # a child is expanded when its best child is expected to join the cut: its estimate times the mean
                # acceptance of the next head's top candidate above what a node must bring (``_join_logp``)
                bar = self._join_logp(out[b], drafting) - self.ahead_logp[d + 1]
                for lp, path, j in ch[:self.frontier]:
                    if lp <= bar:
                        break
                    rows.append(j)
                    owner.append(b)
                    paths.append(path)
                    logp.append(lp)
            if not rows:
                break
            tokens = [path[-1] for path in paths]  # the expanded nodes' tokens
            if levels is None:  # their rows and tokens in one copy to the device (the buffers take them as lists)
                sel = torch.tensor([rows, tokens], dtype=torch.int64).to(self.device)
                tokens, state = sel[1], self._grow_select(state, sel[0])
        for b in reqs:
            out[b] = sorted(out[b], key=lambda item: (-item[1], len(item[0])))[:min(buds[b], self.max_nodes)]
        return out

    def _level_buffers(self, batch_size: int) -> "_LevelGraphs":
        """The tree levels over fixed buffers for a batch of ``batch_size`` (``level_graphs``): at most ``frontier``
        expanded nodes per request, so frontier x batch_size rows (level 0's roots fit too). Kept while the batch size
        is."""
        rows = self.frontier * batch_size
        if self._levels is None or self._levels.rows != rows:
            self._levels = _LevelGraphs(self, rows, capture=self.device.type == "cuda")
        return self._levels

    def _join_logp(self, nodes, drafting: int) -> float:
        """The log of the least estimate with which a node joins the cut of ``nodes`` [(path, estimate)]: ``cut_scored``
        keeps a node when it raises the expected tokens per cost, i.e. when its estimate exceeds node_cost x drafting
        x the best ratio the nodes above it reach (here: ``nodes`` best first)."""
        if self.node_cost <= 0:
            return -math.inf
        best, gain = self.min_gain, 1.0
        for k, p in enumerate(sorted((p for _, p in nodes), reverse=True), 1):
            gain += p
            best = max(best, gain / (1.0 + self.fixed_cost + self.node_cost * drafting * k))
        return math.log(self.node_cost * drafting * best)

    def cut(self, nodes, drafting: int = 1):
        """Its cost cut of scored ``nodes`` [(path, estimate)], best first, a parent before its children (its own, or
        a trie merged with the n-gram drafter's): ``cut_scored`` under fixed_cost, node_cost and min_gain. (Tree, kept
        paths). drafting: ``batch_drafting`` of the step's budgets."""
        return cut_scored(nodes, self.fixed_cost, self.node_cost, self.min_gain, drafting)

    def scored_nodes(self, contexts, budget):
        """Per request, the heads' candidate nodes [(path tuple, estimated probability that the path is accepted)],
        best first, a parent before its children, at most min(budget, max_nodes); each request's hidden state is
        used once (the next step's comes from the next verify). What ``propose`` cuts, and what other drafters
        merge into their trie (fastverify.hf.slots)."""
        B = len(contexts)
        if len(self.candidates) != B:
            self.reset(B)
        buds = [min(int(bud), self.max_nodes) for bud in budget]
        seq = self._sequential_nodes(contexts, buds, batch_drafting(buds)) if self._grows else None
        out = [seq[b] if seq is not None else self._heads_nodes(b, buds[b]) for b in range(B)]
        self.candidates = [None] * B
        return out

    def propose(self, contexts, budget):
        B = len(contexts)
        if len(self.candidates) != B:
            self.reset(B)
        buds = [min(int(bud), self.max_nodes) for bud in budget]
        drafting = batch_drafting(buds)
        ngram = self.ngram.scored_nodes(contexts, buds) if self.ngram is not None else [[]] * B
        heads_buds = buds  # a confident copy (ngram_confident): the heads' pass would cost more than it adds
        if self.ngram is not None and self.ngram_confident is not None:
            heads_buds = [0 if sum(p for _, p in nodes) >= self.ngram_confident else bud
                          for nodes, bud in zip(ngram, buds)]
        heads = self.scored_nodes(contexts, heads_buds)
        trees, kept = [], []
        for b in range(B):
            if buds[b] <= 0:
                tree, paths = empty_tree(), []
            elif heads[b]:  # one trie of both proposals, cut by one cost model
                nodes = merge_scored(heads[b], ngram[b], buds[b], self.agree) if ngram[b] else heads[b]
                tree, paths = self.cut(nodes, drafting)
            else:  # the heads propose nothing (the first step, a confident copy): the n-gram drafter's own step
                tree, paths = self.ngram.cut(ngram[b], drafting) if ngram[b] else (empty_tree(), [])
            trees.append(tree)
            kept.append(paths)
        if callable(getattr(self.ngram, "kept_nodes", None)):  # its lookahead adapts to what the cut kept of it
            self.ngram.kept_nodes(kept)
        return trees

    def update(self, accepted) -> None:
        if self.ngram is not None:
            self.ngram.update(accepted)


def _packed(cols: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``_top``'s candidates as one float64 tensor [..., 2k] (scores, then columns: float64 holds every column), for
    one copy to the host (``HeadsDrafter._from_host``)."""
    return torch.cat([scores, cols.double()], -1)


class _LevelGraphs:
    """A HeadsDrafter's tree levels (``_grow_level`` and ``_top`` of its sequential heads) over fixed buffers of
    ``rows`` rows; capture=True (a CUDA device): each depth's level captured in a CUDA graph at its third use and
    replayed after (the first ``EAGER_USES`` run eagerly on the buffers: a generate whose heads run a level once or
    twice, a prompt the n-gram drafter copies, pays no capture).

    Eagerly a level is ~17 small ops, each a kernel launch the host pays for: on an H200 (benchmarks/RESULTS.md) the
    heads' drafting took 2.5 ms of a 25 ms step, almost all of it the host issuing them. Replayed, a level is three
    calls: the expanded rows and their tokens copied in (one [2, rows] upload), the replay, and the candidates copied
    out (``_to_host``'s one copy). Level d takes its rows from level d - 1's output state (graph d reads graph
    d - 1's buffer, so within a step the levels run in order), level 0 from the roots' hidden rows, copied in. Rows
    past a level's m real ones repeat row 0's input; nothing reads them. capture=False runs the same levels eagerly
    on the same buffers, as does a drafter whose capture failed (it warns once)."""

    EAGER_USES = 2

    def __init__(self, drafter: "HeadsDrafter", rows: int, capture: bool):
        self.drafter, self.rows, self.capture = drafter, rows, capture
        dev = drafter.device
        self.root = torch.zeros(rows, drafter.heads.hidden_size, dtype=torch.float32, device=dev)
        self.sel = torch.zeros(drafter.depth, 2, rows, dtype=torch.int64, device=dev)
        # per depth: the level's last outputs (a graph's: its static outputs), its runs; the graphs of depths 0, 1, ...
        self.state, self.out, self.uses = [None] * drafter.depth, [None] * drafter.depth, [0] * drafter.depth
        self.graphs = []
        self.pool = None

    def _level(self, d: int):
        """Level d on the buffers -> (its output state [rows, D], its candidates, ``_packed`` [rows, 2 width])."""
        x = self.root if d == 0 else self.state[d - 1]
        state, logits = self.drafter._grow_level(d, x[self.sel[d, 0]], self.sel[d, 1], None)
        return state, _packed(*self.drafter._top(logits, d))

    def _capture(self, d: int) -> None:
        """Graph d, captured on a side stream after one run there outside the capture (lazy initialisation: cuBLAS,
        the scoring tables). Through capture_begin / capture_end: ``torch.cuda.graph`` would also synchronise the
        device, collect Python's garbage and empty the allocator's cache at every capture (a fresh drafter captures
        within a generate)."""
        dev = self.drafter.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._level(d)
            graph.capture_begin(self.pool)
            try:
                state, out = self._level(d)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graphs.append(graph)
        self.state[d], self.out[d] = state, out

    def run(self, d: int, rows, tokens, roots=None) -> torch.Tensor:
        """Level d on m = len(tokens) rows: rows (indices into level d - 1's rows; level 0: into the roots), tokens
        (each row's token: its node's), roots (level 0: the requests whose hidden rows, ``candidates``, are its
        rows) -> the rows' candidates on the host, ``_packed`` [m, 2 width]."""
        m, pad = len(tokens), self.rows - len(tokens)
        if roots is not None:
            torch.stack([self.drafter.candidates[b] for b in roots], out=self.root[:m])
        self.sel[d].copy_(torch.tensor([list(rows) + [0] * pad, list(tokens) + [0] * pad], dtype=torch.int64))
        self.uses[d] += 1
        if self.capture and d == len(self.graphs) and self.uses[d] > self.EAGER_USES:  # (depths in order)
            try:
                self._capture(d)
            except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager levels, which always run
                warnings.warn(f"HeadsDrafter: the tree levels' CUDA graph failed to capture ({type(e).__name__}: "
                              f"{e}); the levels run eagerly")
                self.capture = False
        if self.capture and d < len(self.graphs):
            self.graphs[d].replay()
        else:
            self.state[d], self.out[d] = self._level(d)
        return self.out[d][:m].cpu()


def load_drafter(name_or_path: str, model, *, ngram=False, heads=None, **options) -> Drafter:
    """A HeadsDrafter from a shipped checkpoint (``"smollm2-bpd"``) or a checkpoint folder, checked against
    ``model`` (fastverify.heads.BaseModelMismatch when it was trained on another base). ngram: True (a default
    NGramDrafter) or an NGramDrafter instance to merge with ("bpd+ngram"). options: HeadsDrafter's.

    A checkpoint of an EAGLE draft layer (config "method" "eagle": ``"smollm2-eagle"`` or a folder written by
    ``python -m fastverify.train eagle``) gives a fastverify.hf.eagle.EagleDrafter (options: its own).

    A checkpoint of a slot drafter (config "method" "gad" / "lud" / "ptp": ``"smollm2-gad"``, ``"smollm2-lud"``,
    or a folder written by ``python -m fastverify.train slots``) gives a fastverify.hf.slots.BlockSlotDrafter
    instead (a PTPSlotDrafter for ptp; options: attach / tree_topk; ngram as for heads; ``heads``: a heads
    checkpoint name or folder, or a HeadsDrafter, whose proposals join the slot drafter's trie: "ptp+bpd+ngram")."""
    import json
    import os
    from fastverify.heads import resolve_checkpoint
    path = resolve_checkpoint(name_or_path)
    try:
        with open(os.path.join(path, "config.json")) as f:
            method = json.load(f).get("method")
    except (OSError, ValueError, AttributeError):
        method = None  # load_heads reports what is wrong with the folder
    if ngram is True:
        from fastverify.hf.drafters import NGramDrafter
        ngram = NGramDrafter()
    if method == "eagle":
        from fastverify.hf.eagle import load_eagle_drafter
        if heads is not None:
            raise ValueError(f"heads: only slot drafters merge a heads drafter's proposals; {name_or_path!r} is an "
                             f"EAGLE draft layer")
        return load_eagle_drafter(path, model, ngram=ngram or None, **options)
    if method in ("gad", "lud", "ptp"):
        from fastverify.hf.slots import load_slot_drafter
        if isinstance(heads, str):
            heads = load_drafter(heads, model)
        return load_slot_drafter(path, model, ngram=ngram or None, heads=heads, **options)
    if heads is not None:
        raise ValueError(f"heads: only slot drafters merge a heads drafter's proposals; {name_or_path!r} is not one")
    heads, cfg = load_heads(name_or_path, model)
    options.setdefault("head_acceptance", cfg.get("head_acceptance"))
    options.setdefault("calibration", cfg.get("calibration"))
    return HeadsDrafter(model, heads, ngram=ngram or None, **options)
