"""EAGLE drafter: a draft layer over the target's features (fastverify.eagle), in the loop's one-forward step.

Like the proposal heads (fastverify.hf.bpd), the drafter reads the verify forward's own hidden states, so a step
is still one forward of the target. Where the heads see the hidden state at one row, the draft layer attends over
every generated row so far: after verify the loop hands it (``observe_path``) the target's hidden states along the
accepted path, the root's row and each accepted node's, which pair with the tokens they produced (the accepted
tokens and the next token). At the next ``propose`` the drafter runs those rows through the layer (their keys and
values join its cache), and the last one's output proposes the candidates for the first draft position. The tree
then grows level by level as the sequential heads' does (``HeadsDrafter._sequential_nodes``: the ``frontier`` best
nodes of each depth whose estimate beats a node's cost expand, ``width`` children each): a node's row reads its
parent's output and its own token, and attends to the cache, its ancestors' rows and itself. Candidates are scored
with the checkpoint's calibration table per depth (the deepest trained depth's for the levels below it), the tree
is cut by the cost model, and merged with the n-gram trie when one is given ("eagle+ngram"), all as for the heads.

On the CPU the layer's linears and the projection over its vocabulary subset run through ``skinny_linear`` in
float16 where the checkpoint's weights are float16 (read exactly; the drafts are the float32 layer's).
Greedy verification keeps the output the target's whatever is drafted.
"""

import itertools
import math

import torch

from fastverify.eagle import EagleLayer, load_eagle
from fastverify.heads import output_projection
from fastverify.hf.bpd import HeadsDrafter, _lossless
from fastverify.hf.drafters import Drafter

__all__ = ["EagleDrafter", "load_eagle_drafter"]


class _Cache:
    """One request's keys and values [P, heads, hd] (preallocated, doubled when full)."""

    __slots__ = ("k", "v", "n")

    def __init__(self, heads, hd, device):
        self.k = torch.empty(64, heads, hd, dtype=torch.float32, device=device)
        self.v = torch.empty(64, heads, hd, dtype=torch.float32, device=device)
        self.n = 0

    def append(self, k, v):
        m = self.n + k.shape[0]
        if m > self.k.shape[0]:
            cap = max(m, 2 * self.k.shape[0])
            self.k = torch.cat([self.k[:self.n], self.k.new_empty(cap - self.n, *self.k.shape[1:])])
            self.v = torch.cat([self.v[:self.n], self.v.new_empty(cap - self.n, *self.v.shape[1:])])
        self.k[self.n:m] = k
        self.v[self.n:m] = v
        self.n = m


class EagleDrafter(HeadsDrafter):
    """Drafter from an EAGLE draft layer. Args: model (the target), layer: EagleLayer; the tree options are
    HeadsDrafter's (width, frontier, max_nodes, score, calibration, temperature, fixed_cost, node_cost, min_gain,
    max_depth (default 5), ngram, ngram_confident)."""

    wants_hidden = True
    wants_path_hidden = True  # the loop calls observe_path (every accepted row's hidden state) instead
    CPU_NODE_COST = 0.06  # the default node_cost on a CPU; on a GPU, GPU_NODE_COST (Drafter.set_device)

    @property
    def _grows(self) -> bool:
        return True

    def __init__(self, model, layer: EagleLayer, *, width: int = 4, max_nodes: int = 16, score: str = "auto",
                 calibration=None, temperature: float = 1.0, fixed_cost: float = 0.05, node_cost: float = None,
                 min_gain: float = 1.0, max_depth: int = 5, ngram: Drafter = None, frontier: int = 4,
                 ngram_confident: float = 1.5):
        weight = output_projection(model)[0]
        if layer.hidden_size != weight.shape[1]:
            raise ValueError(f"layer: hidden size {layer.hidden_size}, the model's output projection takes "
                             f"{weight.shape[1]}")
        if max_depth is None or int(max_depth) < 1:
            raise ValueError(f"max_depth: expected >= 1, got {max_depth}")
        depth = int(max_depth)
        if calibration is not None:  # one row per depth: the deepest trained depth's for the levels below it
            acc = list(calibration["acceptance"])
            calibration = dict(calibration, acceptance=(acc + [acc[-1]] * depth)[:depth])
        self.layer = layer.to(weight.device)
        self.hidden_size = layer.hidden_size
        self._setup(model, layer.vocab_subset, depth, width=width, max_nodes=max_nodes, score=score,
                    head_acceptance=None, calibration=calibration, temperature=temperature, fixed_cost=fixed_cost,
                    node_cost=node_cost, min_gain=min_gain, max_depth=depth, ngram=ngram, frontier=frontier,
                    ngram_confident=ngram_confident)
        self.embed = model.get_input_embeddings().weight.detach()
        self.w = {n: _lossless(getattr(layer, n).detach().float()) for n in ("fc", "qkv", "o", "gate_up", "down")}
        self.caches, self.pending = [], []
        self._cos, self._sin = self.layer.rope_table(torch.arange(1024, device=weight.device))

    # -- the layer's pieces on the CPU's skinny path ------------------------------------------------------------

    def _lin(self, x, name):
        return self._linear(x, self.w[name])

    def _rows_in(self, feature, token_ids, positions):
        """Rows (feature [n, D], token ids [n]) at positions [n] -> z, q, k, v (q, k rotated)."""
        e = self.embed[token_ids.to(self.embed.device)].to(feature.device)
        z = self.layer.inputs(feature, e, self._lin)
        return (z,) + self.layer.qkv_of(z, self._rope(positions), self._lin)

    def _rope(self, positions):
        """EagleLayer.rope_table of positions [n], from a table of every position so far (grown by doubling)."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            self._cos, self._sin = self.layer.rope_table(torch.arange(max(need, 2 * self._cos.shape[0]),
                                                                      device=positions.device))
        return self._cos[positions], self._sin[positions]

    # -- Drafter interface -------------------------------------------------------------------------------------

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        dev = self.device
        self.caches = [_Cache(self.layer.num_heads, self.layer.head_dim, dev) for _ in range(batch_size)]
        self.pending = [[] for _ in range(batch_size)]

    def observe_hidden(self, hidden, active=None) -> None:
        raise RuntimeError("EagleDrafter reads every accepted row's hidden state: the loop calls observe_path")

    @torch.no_grad()
    def observe_path(self, hidden_rows, active=None) -> None:
        """hidden_rows: per request a [n, D] tensor, the target's final hidden states along the accepted path (the
        root's row, then each accepted node's), which produced the n tokens just committed; active: list of bools
        (False: finished, ignored)."""
        if len(self.caches) != len(hidden_rows):
            self.reset(len(hidden_rows))
        for b, rows in enumerate(hidden_rows):
            if (active is None or active[b]) and rows is not None and rows.shape[0]:
                self.pending[b].append(rows.float())

    def _ingest(self, contexts, reqs):
        """The pending rows of ``reqs`` into their caches; returns the root state: u of each request's last row
        [m, D] (the first draft position's candidates come from it), or None for a request with nothing new."""
        feats, toks, pos, owner = [], [], [], []
        for b in reqs:
            f = torch.cat(self.pending[b]) if self.pending[b] else None
            self.pending[b] = []
            if f is None:
                continue
            n, c = f.shape[0], self.caches[b].n
            feats.append(f)
            toks.extend(contexts[b][len(contexts[b]) - n:])
            pos.extend(range(c, c + n))
            owner.append((b, n))
        if not feats:
            return {}
        dev = self.device
        z, q, k, v = self._rows_in(torch.cat(feats), torch.tensor(toks, dtype=torch.int64),
                                   torch.tensor(pos, device=dev))
        roots, zs, outs, r0 = [], [], [], 0
        scale = 1.0 / math.sqrt(self.layer.head_dim)
        for b, n in owner:
            cache = self.caches[b]
            cache.append(k[r0:r0 + n], v[r0:r0 + n])
            last = r0 + n - 1  # only the last row's output is needed; the others leave their keys and values
            s = torch.einsum("hd,phd->hp", q[last], cache.k[:cache.n]) * scale
            outs.append(torch.einsum("hp,phd->hd", s.softmax(-1), cache.v[:cache.n]))
            zs.append(z[last])
            roots.append(b)
            r0 += n
        u = self.layer.finish(torch.stack(zs), torch.stack(outs), self._lin)
        return {b: u[i] for i, b in enumerate(roots)}

    # -- the tree's growth hooks (HeadsDrafter._sequential_nodes) ------------------------------------------------

    def _grow_start(self, reqs):
        # (u [m, D], ancestors' keys and values [m, d, heads, hd] of the draft rows above, positions of the next
        # row [m]); u of the root rows was made at propose (_ingest)
        u = torch.stack([self.candidates[b] for b in reqs])
        h, hd = self.layer.num_heads, self.layer.head_dim
        empty = u.new_zeros(len(reqs), 0, h, hd)
        return u, empty, empty, torch.tensor([self.caches[b].n for b in reqs], device=u.device)

    def _grow_level(self, d: int, state, tokens, owner):
        u, ak, av, pos = state
        if d == 0:  # the root row (the last committed token) already ran at ingest
            return state, self._project(u)
        z, q, k, v = self._rows_in(u, torch.as_tensor(tokens, dtype=torch.int64), pos)
        ak, av = torch.cat([ak, k[:, None]], 1), torch.cat([av, v[:, None]], 1)  # ancestors, then the row itself
        scale = 1.0 / math.sqrt(self.layer.head_dim)
        s_anc = torch.einsum("rhd,rmhd->rhm", q, ak) * scale
        outs, i = [], 0
        for b, run in itertools.groupby(owner):  # a request's rows are contiguous: they share its cache
            j = i + len(list(run))
            c = self.caches[b]
            s = torch.cat([torch.einsum("rhd,phd->rhp", q[i:j], c.k[:c.n]) * scale, s_anc[i:j]], -1).softmax(-1)
            outs.append(torch.einsum("rhp,phd->rhd", s[..., :c.n], c.v[:c.n])
                        + torch.einsum("rhm,rmhd->rhd", s[..., c.n:], av[i:j]))
            i = j
        u = self.layer.finish(z, torch.cat(outs), self._lin)
        return (u, ak, av, pos + 1), self._project(u)

    def _grow_select(self, state, rows):
        u, ak, av, pos = state
        idx = torch.as_tensor(rows, dtype=torch.int64, device=u.device)
        return u[idx], ak[idx], av[idx], pos[idx]

    def scored_nodes(self, contexts, budget):
        B = len(contexts)
        if len(self.caches) != B:
            self.reset(B)
        with torch.no_grad():
            roots = self._ingest(contexts, range(B))
        self.candidates = [roots.get(b) for b in range(B)]
        return super().scored_nodes(contexts, budget)


def load_eagle_drafter(name_or_path: str, model, *, ngram=None, **options) -> EagleDrafter:
    """An EagleDrafter from a checkpoint folder written by ``python -m fastverify.train eagle`` (checked against
    ``model``: fastverify.heads.BaseModelMismatch when it was trained on another base). ngram: an NGramDrafter to
    merge with, or None. options: EagleDrafter's."""
    layer, cfg = load_eagle(name_or_path, model)
    options.setdefault("calibration", cfg.get("calibration"))
    return EagleDrafter(model, layer, ngram=ngram, **options)
