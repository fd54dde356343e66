"""Slot drafting inside the verify forward: the target fills placeholder rows that propose the next step's draft.

GAD's block drafter (Xia et al.: [MASK] positions filled non-autoregressively, attending bidirectionally within
the block) and Lexical Unit Decoding (Sun et al.: [PAD] positions after the last token, causal) become, on a
decoder-only target, the target itself plus a small adapter active on the placeholder rows only (BiTA; "Your
LLM Knows the Future"). Parallel Token Prediction feeds auxiliary variables to the same kind of rows. One
mechanism serves all three:

- the loop appends, per request, blocks of ``block_size`` slot rows to its verify forward, each attached to a
  draft node or the root (``slot_attachments``); a slot at offset i sits at its node's position + i and sees
  the prefix, that node and its ancestors, and the slots of its block (all of them for GAD, the earlier ones
  for LUD / PTP) (fastverify.hf.attention.step_inputs);
- the slot rows' input embeddings come from the drafter (``slot_embeddings``); their input ids are ignored;
- the drafter's gated LoRA adapters (fastverify.lora) act on the slot rows only, so the verify rows compute the
  base model exactly and the exact rules stay exact; the adapters are installed on the target only while the
  patched ``generate`` runs (``installed``), so outside it the model is untouched;
- after verification the loop hands the drafter the logits of the block attached where each request's accepted
  path ends (``observe_slots``); slot i of that block scored the token i positions after the step's next token,
  so the block proposes the next step's draft, a chain under the new root;
- slot rows never enter the committed cache (their cache slots are past every kept one).

Lexical Unit Decoding's acceptance: LUD (Sun et al.) commits the lookahead tokens of its [PAD] positions while
each one's confidence (the probability the lookahead row gives it) is >= beta and it does not repeat the token
before it, with no second pass over them. Under rule "confidence" the loop does the same with the chain a block
drafted (``confident_prefix``): those leading nodes are accepted unchecked (lossy, as the paper), and below them
only the target's argmax is accepted (LUD's normal-position token: the target verifies the rest greedily), so
every token of the output is either a confident lookahead token or the target's own choice. Under "greedy"
nothing is asserted and the output stays exact. (With a drafter that has no confidence of its own, rule
"confidence" is the verify op's: the target's p(x) >= beta.)

Where blocks attach (``attach``): "path" puts a block after the root and after every node of the draft's first
path, so the next step has a draft however much of the path is accepted, at the cost of (depth + 1) x block_size
more rows; "last" puts one block after the deepest node of that path (block_size rows), which drafts again only
when the whole path was accepted (otherwise the next step runs a block after its root alone).
"""

import contextlib

import torch
from torch import nn

from fastverify.hf.drafters import Drafter, batch_drafting, merge_scored, tree_of_paths
from fastverify.lora import GatedLoRALinear, gated_lora_layers
from fastverify.tree import Tree

__all__ = ["SlotDrafter", "BlockSlotDrafter", "PTPSlotDrafter", "first_path", "save_slot_drafter",
           "load_slot_drafter"]


def first_path(tree: Tree) -> list:
    """Local indices of the tree's first path: the root's first child, its first child, and so on."""
    path, parent = [], -1
    for j, p in enumerate(tree.parents.tolist()):
        if p == parent:
            path.append(j)
            parent = j
    return path


class SlotDrafter(Drafter):
    """Opt-in interface of drafters that fill slot rows of the verify forward (module docstring).

    Attributes: ``wants_slots = True``; ``block_size`` (m >= 1); ``bidirectional`` (slots of a block see each
    other); ``attach`` ("path" or "last"). Methods the loop calls, besides reset / propose / update:

      installed(model)               context manager around one generate call (adapters on the target)
      slot_attachments(trees, active) per request, the nodes (-1 = root) that get a block
      slot_embeddings(request, slot, position, seed) -> [R, D]: input embeddings of R slot rows (request index,
                                     slot offset 0..m-1 in its block, absolute position: int64 [R] each; seed:
                                     int64 [R], the request's sampling seed, or None when not sampling)
      observe_slots(logits)          per request, [m, V] logits of the block at the accepted path's end, or None
    """

    wants_slots = True
    block_size = 1
    bidirectional = False
    attach = "path"

    def installed(self, model):
        return contextlib.nullcontext()

    def slot_attachments(self, trees, active):
        out = []
        for tree, on in zip(trees, active):
            if not on:
                out.append([])
                continue
            path = first_path(tree) if len(tree) else []
            out.append([-1] + path if self.attach == "path" else [path[-1] if path else -1])
        return out

    def slot_embeddings(self, request, slot, position, seed):
        raise NotImplementedError

    def observe_slots(self, logits) -> None:
        pass


class BlockSlotDrafter(SlotDrafter, nn.Module):
    """GAD / LUD slot drafter: one learned input embedding per slot offset ([MASK] / [PAD] in the papers, one per
    offset here so that each offset may learn its own role) and gated LoRA adapters on the target's projections.

    The draft proposed at a step is the chain of the slots' argmax tokens from the previous step's block (up to
    the budget), with the top ``tree_topk`` tokens of each slot as siblings when tree_topk > 1 (the argmax
    continues the chain, the others are leaves). Without a block from the previous step it proposes nothing.
    With ``ngram`` (an NGramDrafter; ``load_drafter(..., ngram=True)``: "lud+ngram", "ptp+ngram"), its candidates
    join the block's in one trie, cut by its cost model (``propose``): the n-gram drafter drafts where the block
    has nothing (its first step, after a rejected path with ``attach="last"``) and adds the copies the block
    misses.

    method: "gad" (bidirectional blocks) or "lud" (causal blocks); hidden_size, num_slots (m); adapters: a
    ``{qualified layer name: GatedLoRALinear}`` mapping built by ``init_adapters`` or loaded from a checkpoint.
    """

    def __init__(self, hidden_size: int, num_slots: int = 4, method: str = "gad", attach: str = "path",
                 tree_topk: int = 1, ngram: Drafter = None, heads: Drafter = None):
        nn.Module.__init__(self)
        if method not in ("gad", "lud"):
            raise ValueError(f"method: expected 'gad' or 'lud', got {method!r}")
        if attach not in ("path", "last"):
            raise ValueError(f"attach: expected 'path' or 'last', got {attach!r}")
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots: expected an int >= 1, got {num_slots!r}")
        if not (isinstance(tree_topk, int) and tree_topk >= 1):
            raise ValueError(f"tree_topk: expected an int >= 1, got {tree_topk!r}")
        if ngram is not None and not all(callable(getattr(ngram, f, None))
                                         for f in ("scored_nodes", "cut")):
            raise TypeError(f"ngram: expected an NGramDrafter, got {type(ngram).__name__}")
        if heads is not None and not (all(callable(getattr(heads, f, None)) for f in ("scored_nodes", "cut"))
                                      and getattr(heads, "wants_hidden", False)
                                      and not getattr(heads, "wants_path_hidden", False)):
            raise TypeError(f"heads: expected a HeadsDrafter (one that reads the hidden state at one row), got "
                            f"{type(heads).__name__}")
        self.method, self.attach, self.tree_topk = method, attach, tree_topk
        self.ngram, self.heads = ngram, heads
        self.block_size = num_slots
        self.bidirectional = method == "gad"
        self.slot_embed = nn.Parameter(torch.zeros(num_slots, hidden_size, dtype=torch.float32))
        self.adapters = nn.ModuleDict()  # "model.layers.0.self_attn.q_proj" -> GatedLoRALinear ('.' -> '/')
        self._pending, self._chain = [], {}
        self.temperature = None  # [m] softmax temperature per slot offset (fitted on held-out data) or None

    def init_adapters(self, model, rank: int = 16, alpha: float = 32.0, targets=None):
        """Create zero-initialised adapters for ``model``'s projections (fastverify.lora.DEFAULT_TARGETS) and set
        the slot embeddings to the mean token embedding (a neutral start). The model itself is not modified."""
        from fastverify.lora import DEFAULT_TARGETS
        targets = DEFAULT_TARGETS if targets is None else targets
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in targets and type(module) is nn.Linear:
                self.adapters[name.replace(".", "/")] = GatedLoRALinear(module, rank, alpha)
        if not len(self.adapters):
            raise ValueError(f"targets: no nn.Linear named {tuple(targets)} in {type(model).__name__}")
        with torch.no_grad():
            self.slot_embed.copy_(model.get_input_embeddings().weight.float().mean(0).expand_as(self.slot_embed))
        return self

    @contextlib.contextmanager
    def installed(self, model):
        """Swap the adapters in for their base layers for the duration (each adapter's ``base`` is re-pointed at
        the model's own layer, so a drafter loaded from a checkpoint serves the model it is attached to)."""
        if gated_lora_layers(model):
            raise ValueError("model: already holds gated LoRA adapters; a BlockSlotDrafter installs its own")
        swapped = []
        try:
            for key, adapter in self.adapters.items():
                parent_name, _, attr = key.replace("/", ".").rpartition(".")
                parent = model.get_submodule(parent_name)
                base = getattr(parent, attr)
                shape = (adapter.lora_B.shape[0], adapter.lora_A.shape[1])
                if type(base) is not nn.Linear or tuple(base.weight.shape) != shape:
                    raise ValueError(f"adapters: {key.replace('/', '.')} does not match the model's layer "
                                     f"({type(base).__name__})")
                adapter.base = base
                setattr(parent, attr, adapter)
                swapped.append((parent, attr, base))
            yield
        finally:
            for parent, attr, base in swapped:
                setattr(parent, attr, base)

    @property
    def wants_hidden(self) -> bool:
        return self.heads is not None

    @property
    def hidden_size(self):
        return self.heads.hidden_size if self.heads is not None else None

    def observe_hidden(self, hidden, active=None) -> None:
        if self.heads is not None:
            self.heads.observe_hidden(hidden, active)

    def set_device(self, device) -> None:
        for d in (self.ngram, self.heads):
            if d is not None and callable(getattr(d, "set_device", None)):
                d.set_device(device)

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self._pending = [None] * batch_size
        self._chain = {}
        for d in (self.ngram, self.heads):
            if d is not None:
                d.reset(batch_size)

    def confident_prefix(self, trees, roots, beta):
        """Per request, how many leading nodes of the tree's first path are the block's own chain with each
        slot's probability of its token >= beta, stopping before a token that repeats the one before it (LUD's
        repetition stop; the one before the first is the request's root, its last committed token). Lexical
        Unit Decoding accepts such a lookahead span on the drafter's confidence alone, without the target's check
        (lossy, as the paper); the loop does so under rule "confidence" (fastverify.hf.loop)."""
        out = []
        for b, (tree, prev) in enumerate(zip(trees, roots)):
            chain, probs = self._chain.get(b, ((), ()))
            n = 0
            toks = tree.tokens.tolist()
            for j, t, p in zip(first_path(tree), chain, probs):
                if toks[j] != t or p < beta or t == prev:
                    break
                prev, n = t, n + 1
            out.append(n)
        return out

    def slot_embeddings(self, request, slot, position, seed):
        return self.slot_embed[slot]

    def observe_slots(self, logits) -> None:
        t = self.temperature
        if t is not None:  # calibrated probabilities: the ranking (every argmax draft) is unchanged
            logits = [None if x is None else x.float() / t[:x.shape[0], None].to(x.device) for x in logits]
        self._pending = list(logits)

    def _candidates(self, b: int, block: torch.Tensor, k: int):
        """(tokens int64 [rows, k], probabilities [rows, k]) of request b's block: each slot's top k, the token it
        drafts first, with the slot's softmax probabilities (the estimates the n-gram merge ranks by)."""
        logp, tokens = block.float().log_softmax(-1).topk(k, dim=-1)
        return tokens, logp.exp()

    def _block_nodes(self, b: int, bud: int) -> list:
        """Scored nodes of request b's pending block: [(path tuple, estimated probability that the path is
        accepted: the product of the slots' probabilities along it)], the chain of the slots' first candidates
        with the other top ``tree_topk`` tokens of each slot as leaves, a parent before its children."""
        block = self._pending[b]
        if block is None or bud <= 0:
            return []
        topk = min(self.tree_topk, block.shape[-1], bud)
        depth = max(1, min(block.shape[0], bud // topk))
        tokens, probs = self._candidates(b, block[:depth], topk)
        nodes, chain, p_chain = [], (), 1.0
        for toks, ps in zip(tokens.tolist(), probs.tolist()):
            nodes.extend((chain + (t,), p_chain * p) for t, p in zip(toks, ps))
            chain, p_chain = chain + (toks[0],), p_chain * ps[0]
        self._chain[b] = (list(chain), probs[:, 0].tolist())
        return nodes

    @torch.no_grad()
    def propose(self, contexts, budget):
        """Per request, the chain its pending block drafts (``_block_nodes``). With an n-gram drafter: one trie of
        both proposals (a path proposed by both with the larger estimate), cut by the n-gram drafter's cost model
        (``NGramDrafter.cut``; with the heads alone, by theirs); its first path, where the blocks of the next verify
        attach, is then the path of the highest estimates."""
        if len(self._pending) != len(contexts):
            self.reset(len(contexts))
        buds = [max(0, int(bud)) for bud in budget]
        self._chain = {}
        ngram = self.ngram.scored_nodes(contexts, buds) if self.ngram is not None else None
        heads = self.heads.scored_nodes(contexts, buds) if self.heads is not None else None
        drafting = batch_drafting(buds)
        trees, kept = [], []
        for b, bud in enumerate(buds):
            nodes = self._block_nodes(b, bud)
            if ngram is None and heads is None:
                trees.append(tree_of_paths([path for path, _ in nodes]))
                continue
            for other in (heads, ngram):
                if other is not None:
                    nodes = merge_scored(nodes, other[b], bud)
            tree, paths = (self.ngram if ngram is not None else self.heads).cut(nodes, drafting)
            trees.append(tree)
            kept.append(paths)
        if ngram is not None and callable(getattr(self.ngram, "kept_nodes", None)):
            self.ngram.kept_nodes(kept)
        self._pending = [None] * len(contexts)
        return trees

    def update(self, accepted) -> None:
        if self.ngram is not None:
            self.ngram.update(accepted)


class PTPSlotDrafter(BlockSlotDrafter):
    """Parallel Token Prediction (Draxler et al.) on the slot mechanism: causal blocks whose slots carry the
    auxiliary variables of the coupled rule.

    Slot i of a block attached at position P stands at position P + 1 + i (i = 0..m) and drafts the token at that
    position, which the ``coupled`` rule samples with u_(P+1+i) = uniform(seed, P + 1 + i). Its input is its learned
    offset embedding plus the auxiliary embedding (fastverify.ptp.AuxiliaryEmbedding) of
      variant "o" (O-PTP): its own u_(P+1+i); the slot outputs the token t = F^-1(u) of the target's distribution
                 given every earlier token, and drafts its argmax;
      variant "c" (C-PTP): the previous position's u_(P+i) (so its block's earlier tokens are determined); the
                 slot outputs the target's distribution of its token, and drafts its inverse CDF at u_(P+1+i);
      aux_mode "none": no auxiliary input (the independent per-slot baseline PTP compares with); the slot learns
                 the marginal distribution of its token and drafts its inverse CDF at u_(P+1+i).
    Slot 0 therefore re-predicts the step's own next token (which the target samples with the same u) and slots
    1..m draft the m tokens after it. With ``first_gate``, a block whose slot 0 disagrees with the token the
    target committed drafts nothing (its later slots may believe in another token); off by default: on held-out
    data the later slots are often right all the same (smollm2-ptp: 0.47 accepted tokens per block without the
    gate, 0.40 with it). Verified with ``coupled``, the output is exactly
    the target's autoregressive sampling with that seed, whatever the slots propose. Without a seed (greedy
    decoding) every slot gets u = 1/2, drafts are argmaxes, and the greedy rule keeps the output exact.

    num_slots: m draft slots (the block has m + 1 rows); aux_mode: "interp" (the PTP authors' default), "bits"
    (PTP Sec. 3.1) or "none"; variant: "o" or "c"; draft: "auto" (as above), "argmax" or "inverse_cdf" (either
    rule for any variant: e.g. the baseline's argmax, its marginal's mode); first_gate: see above.
    """

    VARIANTS = ("o", "c")
    DRAFTS = ("auto", "argmax", "inverse_cdf")

    def __init__(self, hidden_size: int, num_slots: int = 4, attach: str = "path", aux_mode: str = "interp",
                 tree_topk: int = 1, variant: str = "o", draft: str = "auto", first_gate: bool = False,
                 ngram: Drafter = None, heads: Drafter = None):
        from fastverify.ptp import AuxiliaryEmbedding
        super().__init__(hidden_size, num_slots + 1, "lud", attach, tree_topk, ngram, heads)  # "lud": causal
        if variant not in self.VARIANTS:
            raise ValueError(f"variant: expected one of {self.VARIANTS}, got {variant!r}")
        if aux_mode != "none" and aux_mode not in AuxiliaryEmbedding.MODES:
            raise ValueError(f"aux_mode: expected one of {AuxiliaryEmbedding.MODES + ('none',)}, got {aux_mode!r}")
        if draft not in self.DRAFTS:
            raise ValueError(f"draft: expected one of {self.DRAFTS}, got {draft!r}")
        self.method, self.variant, self.draft, self.first_gate = "ptp", variant, draft, bool(first_gate)
        self.aux = AuxiliaryEmbedding(hidden_size, aux_mode) if aux_mode != "none" else None
        self._seeds, self._drafts = {}, {}

    @property
    def aux_mode(self) -> str:
        return self.aux.mode if self.aux is not None else "none"

    @property
    def samples(self) -> bool:
        """Whether a slot drafts the inverse CDF of its own distribution at its u (C-PTP, no auxiliary input)
        rather than its argmax (O-PTP: the slot was given its u)."""
        if self.draft != "auto":
            return self.draft == "inverse_cdf"
        return self.variant == "c" or self.aux is None

    def slot_u(self, position, seed):
        """The auxiliary input of slots at ``position``: u of the slot's own position (O-PTP) or of the one
        before it (C-PTP); 1/2 without a seed."""
        position = position - 1 if self.variant == "c" else position
        if seed is None:
            return torch.full(position.shape, 0.5, dtype=torch.float32, device=position.device)
        from fastverify.ops.sampling import uniform
        return uniform(seed, position.clamp(min=0))

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self._seeds, self._drafts = {}, {}

    def slot_embeddings(self, request, slot, position, seed):
        if seed is not None and self.samples:
            self._seeds.update(zip(request.tolist(), seed.tolist()))
        embed = self.slot_embed[slot]
        return embed if self.aux is None else embed + self.aux(self.slot_u(position, seed)).to(embed.dtype)

    def propose(self, contexts, budget):
        from fastverify.ops.sampling import cdf_sample, uniform
        self._drafts = {}
        if len(self._pending) == len(contexts):
            for b, block in enumerate(self._pending):
                if block is None:
                    continue
                if self.samples and b in self._seeds:  # slot i drafts F^-1(u) of its own distribution
                    first = len(contexts[b]) - 1  # slot 0's position: the token the step committed last
                    pos = torch.arange(first, first + block.shape[0], device=block.device)
                    draft = cdf_sample(block, uniform(self._seeds[b], pos))
                else:
                    draft = None
                said = int(draft[0]) if draft is not None else int(block[0].argmax())  # slot 0's token
                agree = not self.first_gate or said == int(contexts[b][-1])
                self._pending[b] = block[1:] if agree and block.shape[0] > 1 else None
                if draft is not None and self._pending[b] is not None:
                    self._drafts[b] = draft[1:]
        return super().propose(contexts, budget)

    def _candidates(self, b: int, block: torch.Tensor, k: int):
        draft = self._drafts.get(b)
        if draft is None:
            return super()._candidates(b, block, k)
        # the sampled draft first, then the slot's top tokens other than it
        draft = draft[:block.shape[0], None]
        logp = block.float().log_softmax(-1)
        others_p, others = logp.scatter(1, draft, float("-inf")).topk(k - 1, dim=-1)
        return torch.cat([draft, others], 1), torch.cat([logp.gather(1, draft), others_p], 1).exp()


# ----------------------------------------------------------------------------------------------- checkpoints
# DIR/config.json  {"method": "gad" | "lud" | "ptp" (with "aux_mode", "variant"), "format": 1, "num_slots",
#                   "hidden_size", "rank", "alpha",
#                   "layers": [qualified names], "base_model", "base_fingerprint" (fastverify.heads.fingerprint),
#                   "training": {...}, "eval": {...}}
# DIR/slots.safetensors  "slot_embed" [m, D] and, per adapted layer, "<name>.lora_A" [r, in], "<name>.lora_B"
#                   [out, r] (float16: half the size; the adapters' values are small and well inside its range)

SLOTS_WEIGHTS = "slots.safetensors"
SLOTS_FORMAT = 1


def save_slot_drafter(drafter: BlockSlotDrafter, path: str, config: dict) -> None:
    """Write ``path``/slots.safetensors and ``path``/config.json (config: base_model, base_fingerprint, ...)."""
    import json
    import os
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {"slot_embed": drafter.slot_embed.detach().half().cpu().contiguous()}
    ranks, alphas = set(), set()
    for key, adapter in drafter.adapters.items():
        name = key.replace("/", ".")
        tensors[name + ".lora_A"] = adapter.lora_A.detach().half().cpu().contiguous()
        tensors[name + ".lora_B"] = adapter.lora_B.detach().half().cpu().contiguous()
        ranks.add(adapter.rank)
        alphas.add(adapter.alpha)
    aux = getattr(drafter, "aux", None)
    if aux is not None:
        for key, value in aux.state_dict().items():
            tensors["aux." + key] = value.detach().half().cpu().contiguous()
    cfg = dict(config)
    if isinstance(drafter, PTPSlotDrafter):
        cfg["aux_mode"], cfg["variant"] = drafter.aux_mode, drafter.variant
    cfg.update({"method": drafter.method, "format": SLOTS_FORMAT, "num_slots": drafter.block_size,
                "hidden_size": int(drafter.slot_embed.shape[1]), "rank": max(ranks), "alpha": max(alphas),
                "layers": [k.replace("/", ".") for k in drafter.adapters]})
    save_file(tensors, os.path.join(path, SLOTS_WEIGHTS + ".tmp"))
    os.replace(os.path.join(path, SLOTS_WEIGHTS + ".tmp"), os.path.join(path, SLOTS_WEIGHTS))
    with open(os.path.join(path, "config.json.tmp"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))


def load_slot_drafter(path: str, model, **options) -> BlockSlotDrafter:
    """A BlockSlotDrafter from a checkpoint folder, for ``model`` (its fingerprint is checked:
    fastverify.heads.BaseModelMismatch otherwise). options: BlockSlotDrafter's (attach, tree_topk).
    Raises FileNotFoundError / fastverify.heads.CheckpointError for missing or inconsistent files."""
    from fastverify.heads import CheckpointError, check_fingerprint, read_checkpoint
    from fastverify.ptp import AuxiliaryEmbedding
    cfg, tensors = read_checkpoint(path, SLOTS_WEIGHTS, "slot drafter", ("gad", "lud", "ptp"), SLOTS_FORMAT,
                                   sizes=("hidden_size", "num_slots", "rank"))
    ptp = cfg["method"] == "ptp"
    if ptp and cfg["num_slots"] < 2:  # (a PTP checkpoint counts the slot of the next token)
        raise CheckpointError(f"slot checkpoint {path!r}: num_slots {cfg['num_slots']!r}, expected an int >= 2")
    if not isinstance(cfg.get("layers"), list) or type(cfg.get("alpha")) not in (int, float):
        raise CheckpointError(f"slot checkpoint {path!r}: expected a list of layers and a number alpha, got "
                              f"{cfg.get('layers')!r} and {cfg.get('alpha')!r}")
    for key, allowed in (("aux_mode", AuxiliaryEmbedding.MODES + ("none",)), ("variant", PTPSlotDrafter.VARIANTS)):
        if ptp and key in cfg and cfg[key] not in allowed:
            raise CheckpointError(f"slot checkpoint {path!r}: {key} {cfg[key]!r}, expected one of {allowed}")
    if "base_fingerprint" not in cfg:
        raise CheckpointError(f"slot checkpoint {path!r}: config has no base_fingerprint")
    check_fingerprint(cfg["base_fingerprint"], model, where=f"slot checkpoint {path!r}")
    if ptp:
        drafter = PTPSlotDrafter(cfg["hidden_size"], cfg["num_slots"] - 1, aux_mode=cfg.get("aux_mode", "interp"),
                                 variant=cfg.get("variant", "o"), **options)
    else:
        drafter = BlockSlotDrafter(cfg["hidden_size"], cfg["num_slots"], cfg["method"], **options)
    device = next(model.parameters()).device
    try:
        if drafter.method == "ptp" and drafter.aux is not None:
            drafter.aux.load_state_dict({k[4:]: v.float() for k, v in tensors.items() if k.startswith("aux.")})
        for name in cfg["layers"]:
            base = model.get_submodule(name)
            adapter = GatedLoRALinear(base, cfg["rank"], float(cfg["alpha"]))
            with torch.no_grad():
                adapter.lora_A.copy_(tensors[name + ".lora_A"])
                adapter.lora_B.copy_(tensors[name + ".lora_B"])
            drafter.adapters[name.replace(".", "/")] = adapter
        with torch.no_grad():
            drafter.slot_embed.copy_(tensors["slot_embed"])
    except (KeyError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"slot checkpoint {path!r}: its tensors do not match its config or this model "
                              f"({type(e).__name__}: {e})") from None
    temps = cfg.get("slot_temperature")
    if temps is not None:
        if not (isinstance(temps, list) and len(temps) == drafter.block_size
                and all(isinstance(t, (int, float)) and t > 0 for t in temps)):
            raise CheckpointError(f"slot checkpoint {path!r}: slot_temperature: expected {drafter.block_size} "
                                  f"positive numbers, got {temps!r}")
        drafter.temperature = torch.tensor(temps, dtype=torch.float32)
    drafter.config = cfg
    return drafter.to(device).requires_grad_(False)
