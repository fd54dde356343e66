"""Blockwise parallel decoding drafter: proposal heads on the target's own hidden state (Stern et al. 2018 §4).

Combined scoring and proposal: the forward that verifies step t also proposes step t + 1. After verify the loop
hands the drafter (``observe_hidden``) the target's final hidden state at the row where each request's accepted
path ends, the row whose logits gave ``next_token``; the heads p_2..p_k (fastverify.heads) turn it into
candidates for the k - 1 positions after ``next_token``, which is the root of the next draft. No extra forward
of the target; what it costs is one pass of the heads (H residual blocks and the output projection over the
heads' vocabulary subset, all heads in one ``skinny_linear`` call on the CPU).

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

Nodes are added best first (``Tree.from_topk``), and the tree is cut at the size k that maximises expected
tokens per cost, (1 + sum of the kept nodes' probabilities) / (1 + fixed_cost + node_cost * k), the cost model
of NGramDrafter (a drafted step of k nodes costs about 1 + 0.05 + 0.025 k plain steps on a 2-core CPU); no draft
when no k beats ``min_gain``. The first step of a generate has no hidden state yet: it drafts nothing (or the
n-gram drafter's tree, when combined).

Combined with an n-gram drafter (``ngram=NGramDrafter()``, "bpd+ngram"): both propose scored candidate nodes
(the n-gram drafter's ``scored_nodes``: its candidates with their estimated path probabilities, before its own cost
cut), the two sets become one trie (a path proposed by both once, with the larger estimate), and one cost-aware
cut, the one above, keeps the best prefix of the union, at most ``max_nodes``. In a batch of R drafting requests
the cut uses ``node_cost * R`` (they share one forward: fastverify.hf.drafters.batch_drafting). So a strong
n-gram match (a copy) is not crowded out by weak head candidates, and neither source's nodes are paid for twice.

Rules. Greedy verification (the default) keeps the output exactly the target's. BPD's approximate rules
(``rule="topk"``, Stern §5.1; ``rule="distance"``, §5.2; ``min_accept``, §5.3) run with these drafts as with
any other; they change the output (lossy) and are opt-in.
"""

import math

import torch
import torch.nn.functional as F

from fastverify.heads import ProposalHeads, load_heads, output_projection
from fastverify.hf.drafters import Drafter, batch_drafting, empty_tree
from fastverify.tree import Tree

__all__ = ["HeadsDrafter", "load_drafter"]


class HeadsDrafter(Drafter):
    """Drafter from proposal heads on the target's hidden state.

    Args: model: the target (its output projection is used, restricted to the heads' vocabulary subset);
    heads: ProposalHeads; width: candidates per head (per depth); max_nodes: cap on the tree size; score: "prob"
    or "rank" (above); head_acceptance: [H][ranks] measured acceptance by rank (for score="rank"); temperature:
    applied to the heads' logits before the softmax (score="prob"); fixed_cost, node_cost, min_gain: the cost
    model; ngram: an NGramDrafter to merge with (anything with its ``scored_nodes``), or None.
    """

    wants_hidden = True

    def __init__(self, model, heads: ProposalHeads, *, width: int = 4, max_nodes: int = 16, score: str = "auto",
                 head_acceptance=None, calibration=None, temperature: float = 1.0, fixed_cost: float = 0.05,
                 node_cost: float = 0.025, min_gain: float = 1.0, max_depth: int = None, ngram: Drafter = None):
        if score == "auto":
            score = "calibrated" if calibration is not None else "prob"
        if score not in ("prob", "rank", "calibrated"):
            raise ValueError(f"score: expected 'auto', 'calibrated', 'prob' or 'rank', got {score!r}")
        if score == "rank" and head_acceptance is None:
            raise ValueError("score='rank' needs head_acceptance (the checkpoint's measured acceptance by rank)")
        if score == "calibrated" and calibration is None:
            raise ValueError("score='calibrated' needs calibration (the checkpoint's calibration table)")
        if width < 1 or max_nodes < 1:
            raise ValueError(f"width, max_nodes: expected >= 1, got {width}, {max_nodes}")
        if not temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {temperature}")
        weight, bias = output_projection(model)
        D = weight.shape[1]
        if heads.hidden_size != D:
            raise ValueError(f"heads: hidden size {heads.hidden_size}, the model's output projection takes {D}")
        self.heads = heads.to(weight.device)
        subset = heads.vocab_subset
        self.subset = None if subset is None else subset.to(weight.device)
        # the output projection over the heads' vocabulary: a contiguous fp32 copy of the subset's rows (on the
        # CPU this is what skinny_linear streams once per step for all heads), or the model's own weight
        w = weight.detach() if subset is None else weight.detach()[self.subset]
        self.weight = w.float().contiguous()
        self.bias = None if bias is None else (bias.detach() if subset is None else bias.detach()[self.subset]).float()
        self.width = min(int(width), self.weight.shape[0])
        self.max_nodes, self.score, self.temperature = int(max_nodes), score, float(temperature)
        self.depth = heads.num_heads if max_depth is None else max(1, min(int(max_depth), heads.num_heads))
        if head_acceptance is not None:
            acc = torch.as_tensor(head_acceptance, dtype=torch.float64)
            if acc.dim() != 2 or acc.shape[0] != heads.num_heads:
                raise ValueError(f"head_acceptance: expected [{heads.num_heads}, ranks], got {tuple(acc.shape)}")
            self.rank_logp = torch.log(acc.clamp(min=1e-6))
        else:
            self.rank_logp = None
        if calibration is not None:
            edges = torch.as_tensor(calibration["bins"], dtype=torch.float32)
            acc = torch.as_tensor(calibration["acceptance"], dtype=torch.float64)
            if acc.dim() != 2 or acc.shape != (heads.num_heads, edges.numel() - 1):
                raise ValueError(f"calibration: expected acceptance [{heads.num_heads}, {edges.numel() - 1}], got "
                                 f"{tuple(acc.shape)}")
            self.calib_edges, self.calib_logp = edges[1:-1], torch.log(acc.clamp(min=1e-6))
        self.fixed_cost, self.node_cost, self.min_gain = float(fixed_cost), float(node_cost), float(min_gain)
        if ngram is not None and not callable(getattr(ngram, "scored_nodes", None)):
            raise TypeError(f"ngram: expected an NGramDrafter (a drafter with scored_nodes), got {type(ngram).__name__}")
        self.ngram = ngram
        self.candidates = []

    # -- Drafter interface ----------------------------------------------------------------------------------

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self.candidates = [None] * batch_size  # per request: (tokens [H, width] list, log-scores [H, width] list)
        if self.ngram is not None:
            self.ngram.reset(batch_size)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] -> logits [H, B, V'] fp32 over the heads' vocabulary (all heads in one projection)."""
        r = self.heads(hidden)  # [H, B, D]
        H, B, D = r.shape
        x = r.reshape(H * B, D)
        if x.device.type == "cpu":
            from fastverify.ops.linear import skinny_linear
            logits = skinny_linear(x, self.weight, self.bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        return logits.reshape(H, B, -1)

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
        logits = self.head_logits(hidden[rows])  # [H, b, V']
        H = logits.shape[0]
        logits = logits[:self.depth]
        top = logits.topk(self.width, dim=-1)
        tokens = top.indices if self.subset is None else self.subset[top.indices]
        if self.score == "prob":
            scores = top.values / self.temperature - torch.logsumexp(logits / self.temperature, dim=-1, keepdim=True)
        elif self.score == "calibrated":
            prob = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().cpu()
            bins = torch.bucketize(prob, self.calib_edges, right=True)  # [H', b, width]
            scores = torch.gather(self.calib_logp[:self.depth, None, :].expand(-1, bins.shape[1], -1), 2, bins)
        else:
            ranks = min(self.width, self.rank_logp.shape[1])
            scores = self.rank_logp[:self.depth, :ranks][:, None, :].expand(-1, len(rows), -1)
            tokens = tokens[..., :ranks]
        tokens, scores = tokens.cpu().tolist(), scores.double().cpu()
        for i, b in enumerate(rows):
            self.candidates[b] = ([tokens[d][i] for d in range(len(tokens))], scores[:, i])
        del H

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

    def _cut(self, nodes, drafting: int = 1):
        """The prefix of ``nodes`` (best first) that maximises expected tokens per cost, as a Tree; drafting: the
        number of requests of the batch that draft (fastverify.hf.drafters.batch_drafting)."""
        best, keep, gain = self.min_gain, 0, 1.0
        for k, (_, prob) in enumerate(nodes, 1):
            gain += prob
            ratio = gain / (1.0 + self.fixed_cost + self.node_cost * drafting * k)
            if ratio > best:
                best, keep = ratio, k
        index, tokens, parents = {(): -1}, [], []
        for path, _ in nodes[:keep]:
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
        return Tree(tokens, parents, validate=False) if tokens else empty_tree()

    def propose(self, contexts, budget):
        B = len(contexts)
        if len(self.candidates) != B:
            self.reset(B)
        buds = [min(int(bud), self.max_nodes) for bud in budget]
        drafting = batch_drafting(buds)
        ngram = self.ngram.scored_nodes(contexts, buds) if self.ngram is not None else [[]] * B
        trees = []
        for b in range(B):
            nodes = self._heads_nodes(b, buds[b])
            self.candidates[b] = None  # used once: the next step's come from the next verify
            if ngram[b]:
                # one trie of both proposals, a path proposed by both with the larger estimate; sorted best first
                # (a parent's estimate is >= its children's in either source, so parents still come first)
                merged = dict(nodes)
                for path, prob in ngram[b]:
                    merged[path] = max(prob, merged.get(path, 0.0))
                nodes = sorted(merged.items(), key=lambda item: (-item[1], len(item[0])))[:buds[b]]
            trees.append(self._cut(nodes, drafting) if buds[b] > 0 else empty_tree())
        return trees

    def update(self, accepted) -> None:
        if self.ngram is not None:
            self.ngram.update(accepted)


def load_drafter(name_or_path: str, model, *, ngram=False, **options) -> HeadsDrafter:
    """A HeadsDrafter from a shipped checkpoint (``"smollm2-bpd"``) or a checkpoint folder, checked against
    ``model`` (fastverify.heads.BaseModelMismatch when it was trained on another base). ngram: True (a default
    NGramDrafter) or an NGramDrafter instance to merge with ("bpd+ngram"). options: HeadsDrafter's.

    A checkpoint of a slot drafter (config "method" "gad" / "lud" / "ptp": ``"smollm2-gad"``, ``"smollm2-lud"``,
    or a folder written by ``python -m fastverify.train slots``) gives a fastverify.hf.slots.BlockSlotDrafter
    instead (a PTPSlotDrafter for ptp; options: attach / tree_topk)."""
    import json
    import os
    from fastverify.heads import resolve_checkpoint
    path = resolve_checkpoint(name_or_path)
    try:
        with open(os.path.join(path, "config.json")) as f:
            method = json.load(f).get("method")
    except (OSError, ValueError, AttributeError):
        method = None  # load_heads reports what is wrong with the folder
    if method in ("gad", "lud", "ptp"):
        from fastverify.hf.slots import load_slot_drafter
        if ngram:
            raise ValueError(f"ngram: merging an n-gram trie is supported for proposal heads, not for the {method} "
                             f"slot drafter of {name_or_path!r}")
        return load_slot_drafter(path, model, **options)
    heads, cfg = load_heads(name_or_path, model)
    if ngram is True:
        from fastverify.hf.drafters import NGramDrafter
        ngram = NGramDrafter()
    options.setdefault("head_acceptance", cfg.get("head_acceptance"))
    options.setdefault("calibration", cfg.get("calibration"))
    return HeadsDrafter(model, heads, ngram=ngram or None, **options)
