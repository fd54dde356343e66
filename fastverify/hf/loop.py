"""The draft-and-verify decoding loop on a Hugging Face causal LM.

One call of ``decode`` = one ``generate``: the prompt's last token is the first root, and the rest of the prompt
(its prefix) goes into the first step's forward, ahead of that root and its draft (one forward, as transformers'
prefill is; the first step's drafts are verified in it too; on the CPU a prefix longer than the skinny kernels take
runs its first part in forwards of their size ahead of it: ``Decoder._prefill_chunks``). Then ``Decoder.step``
repeats until every request has hit eos or max_new_tokens:

  1. draft      the drafter proposes a Tree per request (possibly empty), pruned to the tokens still allowed;
  2. forward    ONE forward over [root, draft nodes...] per request, padded across the batch, with
                position_ids = committed length + depth and a 4D mask (prefix + ancestors + self);
  3. verify     fastverify.verify on the logits in the batch layout (rule greedy / coupled / any other);
  4. commit     accepted nodes + the next token, cut at eos, stop strings and max_new_tokens;
  5. cache      fastverify.compact_cache moves the root and the accepted nodes behind the request's prefix
                and crops the cache to the longest request.

Sampling rules get their uniforms from (seed, absolute position) (``fastverify.uniform``), so the emitted
tokens do not depend on the drafter: with the ``coupled`` rule they are exactly those of plain
autoregressive sampling with the same seed (a drafter that proposes nothing).
"""

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from fastverify.hf.attention import (cache_kwargs, cache_pairs, crop_cache, eager_attention, forward_takes,
                                     gqa_attention, new_cache, own_attention, prefill_inputs, step_inputs,
                                     upload_lists)
from fastverify.hf.drafters import empty_tree
from fastverify.hf.experts import skinny_experts
from fastverify.hf.layers import LiveRows, lean_layers, scatter_rows
from fastverify.hf.linear import MAX_ROWS, model_lock, row_gelu, skinny_linears, walked
from fastverify.hf.processors import RowProcessors
from fastverify.ops.cache import compact_cache
from fastverify.ops.verify import verify
from fastverify.tree import Tree

__all__ = ["LoopStats", "DecodeSettings", "StopStrings", "decode"]

SAMPLING_RULES = ("speculative", "coupled")
# Rules whose tokens do not depend on the drafts (greedy: the argmax path; coupled: plain sampling's stream), the only
# ones under which Decoder._paced may withhold drafts: a lossy rule's (or speculative's) output would then depend on
# the other requests of the batch.
DRAFT_FREE_RULES = ("greedy", "coupled")
# Decoder._paced: a request that would end within this share of the steps the slowest request needs gets no draft.
# At batch 4 on Spec-Bench (three mixed batches, 128 new tokens, 2-core Intel Xeon): n-gram fastverify 9-14% faster.
PACE_MARGIN = 0.8

@dataclass
class LoopStats:
    """What the last ``generate`` of a patched model did (``fastverify.hf.stats(model)``).

    steps: decoding steps (= target forwards: the first one also runs the prompt); drafted / depth / accepted:
    per step, per request, draft nodes scored, the draft tree's depth and draft nodes accepted (None for finished
    requests); new_tokens: tokens emitted per request; time_*: seconds spent in prefill (the first step's forward,
    which runs the prompt), drafting, building masks/positions, the other steps' forwards, verify, committing
    tokens (Python bookkeeping) and cache compaction; time_total: the whole loop."""

    steps: int = 0
    drafted: list = field(default_factory=list)
    depth: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    new_tokens: list = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_inputs: float = 0.0
    time_forward: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_cache: float = 0.0
    time_total: float = 0.0

    @property
    def accepted_tokens(self) -> int:
        """Draft nodes accepted over the whole generation (all requests)."""
        return sum(a for step in self.accepted for a in step if a is not None)

    @property
    def drafted_tokens(self) -> int:
        return sum(d for step in self.drafted for d in step if d is not None)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per request-step (1 = plain decoding)."""
        n = sum(1 for step in self.accepted for a in step if a is not None)
        return (self.accepted_tokens + n) / n if n else 0.0

    def __str__(self) -> str:
        """One line for people: tokens, steps, drafts and where the time went (repr keeps every per-step list)."""
        n = sum(self.new_tokens)
        ms = {"prefill": self.time_prefill, "forwards": self.time_forward, "drafting": self.time_draft,
              "inputs": self.time_inputs, "verify": self.time_verify, "commit": self.time_commit,
              "cache": self.time_cache}
        return (f"{n} new tokens in {self.steps} steps ({self.tokens_per_step:.2f} tokens per request-step; "
                f"{self.drafted_tokens} draft nodes scored, {self.accepted_tokens} accepted); "
                f"{self.time_total * 1e3:.1f} ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ms.items()))

    def summary(self) -> dict:
        steps_time = self.time_total - self.time_prefill
        other = steps_time - self.time_forward
        return {
            "steps": self.steps, "new_tokens": self.new_tokens, "drafted": self.drafted_tokens,
            "accepted": self.accepted_tokens, "tokens_per_step": round(self.tokens_per_step, 3),
            "prefill_s": self.time_prefill, "forward_s": self.time_forward, "draft_s": self.time_draft,
            "inputs_s": self.time_inputs, "verify_s": self.time_verify, "commit_s": self.time_commit,
            "cache_s": self.time_cache, "total_s": self.time_total,
            "non_forward_fraction": other / steps_time if steps_time > 0 else 0.0,
        }


@dataclass
class DecodeSettings:
    """Resolved generation settings. eos_token_ids: list (may be empty); pad_token_id: int; rule and
    rule_params: passed to verify; warp: temperature/top_k/top_p/min_p for sampling rules; seed int64 [B]
    or None; max_draft: most draft nodes per request and step."""

    max_new_tokens: int
    eos_token_ids: list
    pad_token_id: int
    rule: str = "greedy"
    rule_params: dict = field(default_factory=dict)
    warp: dict = field(default_factory=dict)
    seed: torch.Tensor = None
    max_draft: int = 32
    backend: str = "auto"
    sync: bool = False  # synchronise the device around phases (exact CUDA timings; costs a little)
    skinny_linear: bool = True  # few-row float32 CPU nn.Linear layers through fastverify.skinny_linear
    pack_weights: bool = True  # with skinny_linear: weights that are exactly block-quantised values stream packed
    lean_layers: bool = True  # Llama-style decoder layers run fastverify.hf.layers' forward (same ops, fewer calls)
    live_rows: bool = True  # a batch on the CPU: padding rows skip the output projection and the lean layers' work
    pace_batch: bool = True  # a batch on the CPU: no drafts for a request well ahead of the one that ends last
    # a position-dependent RoPE's bound, or a table of position embeddings' size: a forward's rows stay below it
    # minus one (model_limits.position_limit)
    max_positions: int = None
    # the model's sliding-window layers, masked by the loop (fastverify.hf.model_limits.loop_window): (window, the
    # layer types its forward takes a dict of masks by, or None: one mask for every layer), or None
    window: tuple = None
    stop: object = None  # stop strings: a StopStrings, asked after every committed token (eos-like end)
    # whether generate pads a row that a stop string or a stopping criterion ended: where it holds an eos criterion,
    # for any eos_token_id that is not None (an empty list too); None: where eos_token_ids holds an id
    pads_ended: bool = None
    min_tokens: int = 0  # min_new_tokens / min_length: eos is not a candidate before a request has this many tokens
    repetition_penalty: float = 1.0  # generate's RepetitionPenaltyLogitsProcessor on every verify row
    no_repeat_ngram_size: int = 0  # generate's NoRepeatNGramLogitsProcessor on every verify row
    bad_words: tuple = ()  # bad_words_ids as (the tokens before the last, the last); a single token: ((), token)
    suppress: frozenset = frozenset()  # suppress_tokens: never picked
    begin_suppress: frozenset = frozenset()  # begin_suppress_tokens: not picked as a request's first token
    # sequence_bias: ((the tokens before the last, the last, the bias as a float32 value), ...) in the order
    # generate's processor sums them (the single tokens first, then by prefix length as first given)
    sequence_bias: tuple = ()
    forced_eos: tuple = ()  # forced_eos_token_id: the tokens the row that picks the last new token keeps (at 0)
    # generate's logits_processor argument (a LogitsProcessorList): on every verify row, one row at a time, after the
    # above (batch size 1, or processors that compute each row from that row alone)
    logits_processor: object = None
    # generate's stopping_criteria argument and max_time (a StoppingCriteriaList): asked about the whole batch after
    # every token, as generate asks (``Decoder._ask_criteria``)
    stopping_criteria: object = None
    # return_dict_in_generate with output_scores / output_logits: each new token's scores (its row after the
    # processors, then ``warpers``: generate's sampling warpers, a LogitsProcessorList) / raw logits
    # (``Decoder.scored``)
    output_scores: bool = False
    output_logits: bool = False
    warpers: object = None
    renormalize: bool = False  # renormalize_logits: the scores log-softmaxed last (LogitNormalization)
    # sampling with a warper the verify op does not have (typical_p, epsilon / eta cutoff, top_h): generate's whole
    # warper chain (a LogitsProcessorList) on the verify rows after the processors; ``warp`` is then the identity
    warp_rows: object = None
    # generate's prefix_allowed_tokens_fn(batch id, sequence) -> allowed token ids, on every verify row
    # (``RowProcessors._constrain``)
    prefix_allowed: object = None
    # exponential_decay_length_penalty: generate's ExponentialDecayLengthPenalty (an instance), on every verify row
    length_decay: object = None
    remove_invalid: bool = False  # remove_invalid_values: NaN -> 0, +-inf -> the dtype's largest / smallest value

    @property
    def bans(self) -> bool:
        """Whether a processor sets tokens to -inf on some rows (``RowProcessors.banned``); min_tokens needs an eos
        too."""
        return bool(self.no_repeat_ngram_size or self.bad_words or self.suppress or self.begin_suppress
                    or (self.min_tokens > 0 and self.eos_token_ids))

    @property
    def processes(self) -> bool:
        """Whether generate's logits processors change the verify rows' logits (``RowProcessors.process``)."""
        return bool(self.repetition_penalty != 1.0 or self.bans or self.sequence_bias or self.forced_eos
                    or self.logits_processor is not None or self.prefix_allowed is not None
                    or self.length_decay is not None or self.remove_invalid)

    @property
    def bans_apart(self) -> bool:
        """Whether the bans before PrefixConstrained / InfNanRemove in generate's list are applied where those come
        (``RowProcessors._early_bans``): the constraint may allow again what they banned, and the removal turns their
        -inf into the dtype's smallest value; ``RowProcessors.banned`` then names only the suppressed tokens."""
        return self.prefix_allowed is not None or self.remove_invalid


class StopStrings:
    """``generate(stop_strings=..., tokenizer=...)`` for the loop: transformers' own ``StopStringCriteria``, asked
    about one request's row after each token the loop commits, as generate asks about every row after each token
    it appends. The criteria read only a row's last tokens and decide per row, so one request's row (its left
    padding, prompt and tokens so far) gives what generate's whole batch gives for that row."""

    def __init__(self, stop_strings, tokenizer):
        from transformers.generation.stopping_criteria import StopStringCriteria
        self.criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
        # the tail the criteria read (all of the row where the attribute is missing)
        self.tail = getattr(self.criteria, "maximum_token_len", None)

    def first_stop(self, row: list, new: list):
        """The index of the first token of ``new`` (tokens about to follow ``row``: the row of generate's input_ids,
        left padding included, and the tokens so far) after which a stop string ends the row, or None."""
        seq = list(row if self.tail is None else row[-self.tail:])
        for i, tok in enumerate(new):
            seq.append(tok)
            tail = seq if self.tail is None else seq[-self.tail:]
            if bool(self.criteria(torch.tensor([tail], dtype=torch.int64), None)[0]):
                return i
        return None


class InvalidLogitsError(ValueError):
    """The model's logits are invalid (NaN, +inf, -inf everywhere) on a row the output depends on."""


def _banned_rows_to_zero(logits, raw):
    """Greedy rows that the processors left -inf everywhere while the model's own row is finite (a custom processor or
    a prefix constraint banning every token that forced eos or a length penalty leaves): generate's argmax takes
    token 0 there, so these rows get 0 at token 0 (a copy; ``logits`` itself, no copy, when there are none). NaN
    rows and the model's own invalid rows stay invalid."""
    blocked = (logits == float("-inf")).all(-1) & torch.isfinite(raw).all(-1)
    if not bool(blocked.any()):
        return logits
    judged = logits.clone()
    judged[blocked.nonzero()[:, 0], 0] = 0
    return judged


def _to_host(res):
    """(accept_len, next_token, accepted) of a VerifyOutput as Python lists, in one device-to-host copy (int32:
    token ids are below the vocabulary's size; one cast and one concatenation on a GPU)."""
    B, D = res.accepted.shape
    flat = torch.cat([res.accept_len, res.next_token.int(), res.accepted.reshape(-1)]).tolist()
    return flat[:B], flat[B:2 * B], [flat[2 * B + b * D:2 * B + (b + 1) * D] for b in range(B)]


def _blocks_below(blocks, trees, cache_len, pad_len, m, limit):
    """The slot attachments whose m slot rows all sit at positions below ``limit`` - 1. Slot rows stand after the
    draft (up to m positions past the sequence's end), and a dynamic / longrope RoPE computes its frequencies for
    the whole forward from its largest position, which would change the verified rows' logits too. Plain decoding
    of a sequence of at most ``limit`` tokens never feeds its last token, so its forwards span at most limit - 1
    positions (below the bound, where a dynamic RoPE also drops frequencies grown by an earlier, longer call): the
    loop's tree rows stay there (drafts are cut to the tokens still allowed), and so do the kept slot rows. A
    dropped block only means no block draft for the next step."""
    out = []
    for b, (attach, tree) in enumerate(zip(blocks, trees)):
        base = cache_len[b] - pad_len[b]  # the root's position
        depth = tree.depth.tolist() if len(tree) else []
        out.append([a for a in attach if base + (depth[a] if a >= 0 else 0) + m < limit - 1])
    return out


def _prune(tree: Tree, max_depth: int) -> Tree:
    """Drop nodes deeper than max_depth (their ancestors are shallower, so they stay)."""
    if len(tree) == 0 or tree.max_depth <= max_depth:
        return tree
    if max_depth <= 0:
        return empty_tree()
    keep = tree.depth <= max_depth
    new_index = torch.cumsum(keep.to(torch.int32), 0) - 1
    par = tree.parents[keep]
    par = torch.where(par < 0, par, new_index[par.clamp(min=0).long()])
    return Tree(tree.tokens[keep], par, validate=False)


class Decoder:
    """State of one generate call: the cache, the per-request contexts and what has been emitted."""

    def __init__(self, model, input_ids, attention_mask, drafter, settings: DecodeSettings, streamer=None,
                 live: LiveRows = None):
        self.model, self.drafter, self.s, self.streamer, self.live = model, drafter, settings, streamer, live
        self.device = input_ids.device
        self.dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
        self.input_ids = input_ids
        B, L = input_ids.shape
        self.B = B
        mask = attention_mask.bool()
        self.contexts = [input_ids[b][mask[b]].tolist() for b in range(B)]
        self.generated = [[] for _ in range(B)]
        self.finished = [False] * B
        # stop strings without eos (StopStrings): each request's length where one first ended it, and the length
        # every request ends at once all have (generate stops when every row has, its rows all as long)
        self.stop_at, self.limit = [None] * B, settings.max_new_tokens
        # no_repeat_ngram_size, bad_words_ids, stop strings, processors and criteria that read generate's rows: each
        # request's generate row (padded prompt, tokens so far)
        self.full = None
        if (settings.no_repeat_ngram_size or settings.bad_words or settings.sequence_bias or settings.stop is not None
                or settings.logits_processor is not None or settings.stopping_criteria is not None
                or settings.prefix_allowed is not None):
            self.full = [row.tolist() for row in input_ids]
        # output_scores / output_logits: per request and step, (processed rows, raw rows) of its new tokens
        self.rows = [[] for _ in range(B)] if settings.output_scores or settings.output_logits else None
        # stopping_criteria: the tokens after which generate's criteria have been asked (every request has them)
        self.asked = 0
        self.streamed = 0  # a streamer (batch 1): the tokens it has received
        self.plain = False  # a step run again without drafts (``step``: invalid logits with drafts)
        # Where the loop's layers run the skinny kernels (the CPU, skinny_linear or lean_layers on), a request has
        # MAX_ROWS // B rows of a step's forward: its root and at most row_cap draft nodes, then the slot blocks that
        # fit beside them (the first ones: the root's, then along the path). So the forward keeps to MAX_ROWS rows and
        # every row of it goes through the kernels, whose rows are row-invariant: a row's logits do not depend on the
        # rows beside it (masked_attention, csrc/attention.h; the skinny linears), so drafts and batch-mates change no
        # bit of any request's logits (tests/test_hf_generate.py). Past it, torch's GEMM would take the forward.
        self.row_cap = (max(MAX_ROWS // B - 1, 0) if self.device.type == "cpu"
                        and (settings.skinny_linear or settings.lean_layers) else None)
        self.proc = RowProcessors(settings, input_ids, self.contexts, self.generated, self.full)
        self.pad_len = (L - mask.sum(-1)).tolist()
        self.cache = new_cache()
        self.cache_len = [L - 1] * B  # committed slots per request (left padding included)
        self.root = input_ids[:, -1].tolist()
        self.stats = LoopStats(new_tokens=[0] * B)
        self.eos = set(settings.eos_token_ids)
        self.pads_ended = bool(self.eos) if settings.pads_ended is None else settings.pads_ended
        self.hidden = _HiddenCapture(model, drafter) if getattr(drafter, "wants_hidden", False) else None
        self.vocab_size = model_vocab_size(model)
        self.slots = drafter if getattr(drafter, "wants_slots", False) else None
        # the prompt's prefix (all but its last token): input ids, mask and positions of the first forward's rows
        self.prefix = None
        if L > 1:
            prefix_mask, prefix_pos = prefill_inputs(attention_mask[:, :-1], self.dtype)
            self.prefix = (input_ids[:, :-1], prefix_mask, prefix_pos, mask[:, :-1])
        if callable(getattr(drafter, "set_device", None)):  # a cost model that depends on the device
            drafter.set_device(self.device)
        if callable(getattr(drafter, "set_processors", None)):  # drafts that follow the processed target
            drafter.set_processors(repetition_penalty=settings.repetition_penalty,
                                   banned=self.proc.banned if settings.bans else None)
        drafter.reset(B)

    def _sync(self):
        if self.s.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, **kw):
        return self.model(**cache_kwargs(self.model, self.cache), use_cache=True, return_dict=True, **kw)

    def _step_forward(self, inp):
        """The step's forward over [root, draft nodes, slot rows] per request, preceded in the first step by the
        prompt's prefix (cache slots 0 .. L-2, causal among themselves); logits of the step's q rows only (the
        output projection's input, read by drafters with wants_hidden, likewise). In a decoding step whose
        requests' rows are padded to the largest tree's, ``self.live`` holds the verify rows for the forward
        (fastverify.hf.layers.LiveRows, ``_LiveHead``): the padding rows' logits are zeros; in the first step the
        prompts' real tokens and the verify rows (a batch's shorter prompts are left padded). Not with slot rows."""
        ids, pos, mask, gate = inp.input_ids, inp.position_ids, inp.mask, inp.slot_rows
        B, q = ids.shape
        kw = {}
        live = self.live if self.slots is None else None
        live_index = None
        if self.prefix is not None:
            start = self._prefill_chunks(q)  # the prefix's columns now in the cache
            p_ids, p_mask, p_pos, p_real = self.prefix
            self.prefix = None
            p_ids, p_mask, p_pos, p_real = p_ids[:, start:], p_mask[:, :, start:], p_pos[:, start:], p_real[:, start:]
            P = p_ids.shape[1]
            if live is not None:  # the prompts' real tokens and the step's verify rows of [B, P + q]
                T = P + q
                live_index = torch.cat([_real_rows(p_real, T), inp.row_batch * T + P + inp.row_local])
                live_index = live_index if live_index.shape[0] < B * T else None
            unseen = torch.full((B, 1, P, q), torch.finfo(p_mask.dtype).min, dtype=p_mask.dtype, device=self.device)
            ids, pos = torch.cat([p_ids, ids], 1), torch.cat([p_pos, pos], 1)
            mask = torch.cat([torch.cat([p_mask, unseen], 3), mask], 2)  # the prefix rows do not see the step's
            if gate is not None:
                gate = torch.cat([torch.zeros(B, P, dtype=torch.bool, device=self.device), gate], 1)
            if forward_takes(self.model, "logits_to_keep"):
                kw["logits_to_keep"] = q
        elif live is not None and inp.row_batch.shape[0] < B * q:
            live_index = inp.row_batch * q + inp.row_local
        if live_index is not None:
            live.index, live.total = live_index, ids.shape[0] * ids.shape[1]
        mask = self._attention_masks(mask, pos)
        try:
            if self.slots is None:
                out = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
            else:
                out = self._forward_with_slots(inp, ids, pos, mask, gate, **kw)
        finally:
            if live is not None:
                live.index = None
        logits = out.logits[:, -q:]
        if self.hidden is not None and self.hidden.value is not None:
            self.hidden.value = self.hidden.value[:, -q:]
        return logits

    def _prefill_chunks(self, q: int) -> int:
        """Before the first step's forward (``q`` rows per request after the prompt's prefix): where the loop's
        layers run the skinny kernels (the CPU, skinny_linear or lean_layers on) and the prefix and the step's rows
        would make a forward of more than ``MAX_ROWS`` rows, which the kernels leave to torch's GEMM, the prefix's
        first columns run in forwards of at most ``MAX_ROWS`` rows each, every one through the kernels, their keys
        and values into the cache, their logits unused; the rest of the prefix goes into the step's forward as
        before. Each chunk's rows see what they would see in one forward (the prefix mask's rows, its keys up to the
        chunk's end). On SmolLM2-135M (packed weights, 2 threads) a 769-token prompt's first forward took 0.73 s
        instead of 1.16 s (benchmarks/RESULTS.md). Chunks go down to one token per request (a batch of 128): every
        forward then runs the kernels, whose rows are row-invariant (``row_cap``). Returns the number of prefix
        columns run (0: none)."""
        s = self.s
        p_ids, p_mask, p_pos, p_real = self.prefix
        B, P = p_ids.shape
        chunk = MAX_ROWS // B
        if (self.device.type != "cpu" or not (s.skinny_linear or s.lean_layers) or chunk == 0
                or B * (P + q) <= MAX_ROWS):
            return 0
        end = max(P - max(chunk - q, 0), 0)  # the prefix's last chunk - q columns stay with the step's rows
        kw = {"logits_to_keep": 1} if forward_takes(self.model, "logits_to_keep") else {}
        live = self.live if self.slots is None else None  # as in the step's forward
        for a in range(0, end, chunk):
            b = min(a + chunk, end)
            if live is not None:  # the prompts' real tokens of [B, b - a]
                index = _real_rows(p_real[:, a:b], b - a)
                if index.shape[0] < B * (b - a):
                    live.index, live.total = index, B * (b - a)
            try:
                self._forward(input_ids=p_ids[:, a:b], attention_mask=self._attention_masks(p_mask[:, :, a:b, :b],
                              p_pos[:, a:b]), position_ids=p_pos[:, a:b], **kw)
            finally:
                if live is not None:
                    live.index = None
        return end

    def _attention_masks(self, mask, pos):
        """The forward's attention_mask: ``mask`` [B, 1, Q, K] (its last Q columns the forward's own rows, the K - Q
        before them cache slots), and where the model has sliding-window layers that this forward reaches past, the
        same with every key ``window`` or more positions behind its query masked too: transformers' sliding mask
        (key k kept for query q iff q - k < window), on the tokens' positions (a draft row's ancestors are the
        tokens before it, so a row sees what one-row decoding of its path sees). One mask for a model whose every
        layer is a sliding one, else a dict of masks by layer type."""
        if self.s.window is None:
            return mask
        window, kinds = self.s.window
        Q = pos.shape[1]
        S = mask.shape[-1] - Q
        if max(c - p for c, p in zip(self.cache_len, self.pad_len)) + Q < window:  # every distance below it
            return mask
        slots = torch.arange(S, device=self.device)[None] - torch.tensor(self.pad_len, device=self.device)[:, None]
        behind = pos[:, :, None] - torch.cat([slots, pos], 1)[:, None, :] >= window  # [B, Q, K]
        windowed = mask.masked_fill(behind[:, None], torch.finfo(mask.dtype).min)
        if kinds is None:
            return windowed
        return {kind: windowed if kind == "sliding_attention" else mask for kind in kinds}

    def _paced(self, budget, remaining):
        """Static batching: the batch steps until its last request ends, so a draft only pays where it brings that
        end closer. Each running request's pace so far, (new tokens + 1) / (steps + 1), gives the steps it still
        needs; a request whose remaining tokens are at most ``PACE_MARGIN`` of the most any request needs would end
        in time at one token a step: it gets no draft this step (its rows would cost the shared forward and save no
        step). Measured at every step, so a request resumes drafting when the one ahead of it ends (eos)."""
        active = [b for b in range(self.B) if remaining[b] > 0]
        if len(active) < 2:
            return budget
        steps = self.stats.steps + 1
        need = max(remaining[b] * steps / (len(self.generated[b]) + 1) for b in active)
        return [0 if 0 < remaining[b] <= PACE_MARGIN * need else bud for b, bud in enumerate(budget)]

    def remaining(self, b: int) -> int:
        return 0 if self.finished[b] else max(self.limit - len(self.generated[b]), 0)

    def done(self) -> bool:
        return all(self.remaining(b) <= 0 for b in range(self.B))

    def step(self) -> None:
        s, st, B = self.s, self.stats, self.B
        t0 = time.perf_counter()
        # 1. draft: a step commits accept_len + 1 tokens, so drafting deeper than remaining - 1 is wasted.
        remaining = [self.remaining(b) for b in range(B)]
        trees, rule, forced = self._draft(remaining)
        t1 = time.perf_counter()

        # 2. inputs: 4D mask over [cache | root + drafts], positions = committed length + depth.
        cache_len = self.cache_len
        inp, blocks = self._inputs(trees, remaining)
        draft_tokens, cu_nodes, parents = inp.draft_tokens, inp.cu_nodes, inp.parents
        S = max(cache_len)
        t2 = time.perf_counter()

        # 3. one forward over every request's root and draft nodes (in the first step, after the prompt's prefix).
        first, prefix = self.prefix is not None, self.prefix
        step_logits = self._step_forward(inp)  # [B, q, V]
        if inp.row_batch.shape[0] == step_logits.shape[0] * step_logits.shape[1]:  # every row a verify row, in order
            logits = step_logits.reshape(-1, step_logits.shape[-1])  # (batch 1 without slot rows): a view, no copy
        else:
            logits = step_logits[inp.row_batch, inp.row_local]  # [N + B, V], verify's batch layout
        raw = logits
        if s.processes:
            logits = self.proc.process(logits.clone(), trees, inp.cu_host, remaining)
        if s.warp_rows is not None:  # (row-wise warpers: they read no input_ids)
            logits = s.warp_rows(self.input_ids, logits.float())
        self._sync()
        t3 = time.perf_counter()

        # 4. verify.
        kw = {k: v for k, v in s.rule_params.items() if rule == s.rule or k == "min_accept"}
        if s.rule in SAMPLING_RULES:
            kw.update(s.warp)
            kw["seed"] = s.seed
            # absolute position of the token sampled at the root row: the root's own position + 1
            kw["position"] = torch.tensor([c - p + 1 for c, p in zip(cache_len, self.pad_len)], device=self.device)
        if rule == "confidence":
            kw["root_tokens"] = torch.tensor(self.root, device=self.device)
        deepest = max((t.max_depth for t in trees), default=0)  # known here: verify then reads nothing back
        res = verify(logits, draft_tokens, cu_nodes, parents, rule=rule, backend=s.backend, validate=False,
                     max_depth=deepest, **kw)
        accept_len, next_token, accepted = _to_host(res)
        judged = logits  # the rows verify judges: the processed ones, but for rows the processors banned entirely
        greedy = rule == "greedy" or s.warp.get("temperature") == 0.0  # (a sampling rule without do_sample: greedy)
        if any(a < 0 and r > 0 for a, r in zip(accept_len, remaining)) and greedy and s.processes:
            judged = _banned_rows_to_zero(logits, raw)
            if judged is not logits:
                res = verify(judged, draft_tokens, cu_nodes, parents, rule=rule, backend=s.backend, validate=False,
                             max_depth=deepest, **kw)
                accept_len, next_token, accepted = _to_host(res)
        if any(a < 0 and r > 0 for a, r in zip(accept_len, remaining)):  # NaN / inf logits somewhere
            try:
                res = self._verify_around_invalid_rows(res, judged, trees, rule, kw, remaining, raw)
            except InvalidLogitsError:
                if self.plain or not (any(len(t) for t in trees) or any(blocks or [])):
                    raise
                # a row the output needs is invalid with drafts: a draft row's non-finite keys or values may reach
                # the other rows' attention (0 x NaN), which one-row decoding never computes (in the first step the
                # prompt's rows too). The step again, without drafts; it raises if that row is invalid still.
                crop_cache(self.cache, 0 if first else S)
                self.prefix, self.plain = prefix, True
                try:
                    return self.step()
                finally:
                    self.plain = False
            accept_len, next_token, accepted = _to_host(res)
        if forced is not None and any(0 <= a < f for a, f in zip(accept_len, forced)):
            res = self._verify_below_forced(res, judged, trees, forced, rule, kw, deepest)
            accept_len, next_token, accepted = _to_host(res)
        t4 = time.perf_counter()

        # 5. commit: the accepted path + next token, cut at eos, stop strings and max_new_tokens.
        keep = self._commit(trees, remaining, accept_len, next_token, accepted, inp, logits, raw, step_logits,
                            blocks)
        t5 = time.perf_counter()

        # 6. cache: slot S + (0, 1 + accepted...) -> cache_len[b] + (0, 1, ...); then crop to the longest.
        self._keep_accepted(cache_len, accepted, keep)
        self._sync()
        t6 = time.perf_counter()

        st.steps += 1
        st.time_draft += t1 - t0
        st.time_inputs += t2 - t1
        if first:
            st.time_prefill += t3 - t2
        else:
            st.time_forward += t3 - t2
        st.time_verify += t4 - t3
        st.time_commit += t5 - t4
        st.time_cache += t6 - t5

    def _draft(self, remaining):
        """A step's drafts: the drafter's trees within each running request's budget (``remaining``: the tokens
        each may still make), without the nodes a processor bans. Returns (trees, the rule verify runs, per request
        the leading tokens accepted unchecked or None): with rule "confidence" and a drafter that knows its
        confidence (Lexical Unit Decoding), the lookahead tokens it is sure of are accepted unchecked and every
        other token is the target's argmax, LUD's normal-position token (fastverify.hf.slots), under the greedy
        rule; other drafters get the verify op's confidence rule on the target's p."""
        s, B = self.s, self.B
        budget = [min(s.max_draft, max(r - 1, 0)) if not self.plain else 0 for r in remaining]
        if self.row_cap is not None:
            budget = [min(bud, self.row_cap) for bud in budget]
        if s.pace_batch and B > 1 and self.device.type == "cpu" and s.rule in DRAFT_FREE_RULES:
            budget = self._paced(budget, remaining)
        trees = self.drafter.propose(self.contexts, budget)
        check_drafts(self.drafter, trees, B, self.vocab_size)
        trees = [_prune(t, r - 1) if r > 0 else empty_tree() for t, r in zip(trees, remaining)]
        trees = [t if len(t) <= bud else _prune_nodes(t, bud) for t, bud in zip(trees, budget)]
        if s.bans:  # nodes a processor bans cannot be accepted
            trees = [self.proc.drop_banned(b, t) if remaining[b] > 0 and len(t) else t for b, t in enumerate(trees)]
        rule, forced = s.rule, None
        if s.rule == "confidence" and callable(getattr(self.drafter, "confident_prefix", None)):
            asserted = self.drafter.confident_prefix(trees, self.root, s.rule_params.get("beta", 1.0))
            if not isinstance(asserted, (list, tuple)) or len(asserted) != B:
                raise ValueError(f"drafter {type(self.drafter).__name__}: confident_prefix() must return {B} ints")
            trees, forced = map(list, zip(*[_forced_first(t, int(f)) for t, f in zip(trees, asserted)]))
            rule = "greedy"
        return trees, rule, forced

    def _inputs(self, trees, remaining):
        """A step's model inputs (``step_inputs``): the 4D mask over [cache | root + drafts], positions = committed
        length + depth, and a slot drafter's blocks of slot rows (within the positions and each request's row
        share). Returns (inputs, blocks or None)."""
        s, slots, cache_len = self.s, self.slots, self.cache_len
        blocks = None
        if slots is not None:
            blocks = slots.slot_attachments(trees, [r > 0 and not self.plain for r in remaining])
        if blocks is not None and s.max_positions is not None:
            blocks = _blocks_below(blocks, trees, cache_len, self.pad_len, slots.block_size, s.max_positions)
        if blocks is not None and self.row_cap is not None:  # a request's rows within its share (row_cap)
            blocks = [attach[:max(self.row_cap - len(tree), 0) // slots.block_size]
                      for attach, tree in zip(blocks, trees)]
        inp = step_inputs(trees, self.root, cache_len, self.pad_len, self.dtype, self.device, blocks=blocks,
                          block_size=slots.block_size if slots is not None else 0,
                          bidirectional=slots is not None and slots.bidirectional)
        return inp, blocks

    def _commit(self, trees, remaining, accept_len, next_token, accepted, inp, logits, raw, step_logits,
                blocks) -> list:
        """A step's commit: per running request its accepted path and next token, cut at eos, stop strings and
        max_new_tokens, into the request's tokens; the stopping criteria, the streamer, the drafter's update and
        what the slot / hidden-state drafters read from this step. Returns, per request, how many of the step's
        cache slots to keep (the root and the accepted nodes; 0 for a request that has ended)."""
        s, st, B, slots = self.s, self.stats, self.B, self.slots
        cu, flat = inp.cu_host, inp.tokens_host
        keep = [0] * B  # cache slots of the step to keep per request: root + accepted nodes
        st.drafted.append([len(t) if remaining[b] > 0 else None for b, t in enumerate(trees)])
        st.depth.append([t.max_depth if remaining[b] > 0 else None for b, t in enumerate(trees)])
        st.accepted.append([accept_len[b] if remaining[b] > 0 else None for b in range(B)])
        for b in range(B):
            if remaining[b] <= 0:
                continue
            new = [flat[cu[b] + j] for j in accepted[b][:accept_len[b]]] + [next_token[b]]
            new = new[:remaining[b]]
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[:i + 1]
                    self.finished[b] = True
                    break
            if s.stop is not None and self.stop_at[b] is None:  # (new ends at an eos, if it holds one)
                i = s.stop.first_stop(self.full[b], new)
                if i is not None and self.pads_ended:  # generate pads a row a stop string ended, as one eos ended
                    new = new[:i + 1]
                    self.finished[b] = True
                elif i is not None:  # without an eos criterion it does not: the row runs on until every row stops
                    self._stop_at(b, len(self.generated[b]) + i + 1)
                new = new[:max(self.limit - len(self.generated[b]), 0)]
            if self.rows is not None:  # the rows that gave the new tokens: the root's, then the accepted nodes'
                at = [cu[b] + b] + [cu[b] + b + 1 + j for j in accepted[b][:len(new) - 1]]
                self.rows[b].append((logits[at] if s.output_scores else None, raw[at] if s.output_logits else None))
            self.generated[b].extend(new)
            self.contexts[b].extend(new)
            if self.full is not None:
                self.full[b].extend(new)
            self.proc.committed(b, new)
            st.new_tokens[b] += len(new)
            keep[b] = accept_len[b] + 1 if self.remaining(b) > 0 else 0
        if s.stopping_criteria is not None:
            self._ask_criteria()
            keep = [k if self.remaining(b) > 0 else 0 for b, k in enumerate(keep)]
        if self.streamer is not None:  # (batch 1) the tokens no criterion can still take back
            g = self.generated[0]
            upto = min(len(g), self.limit, self.asked if s.stopping_criteria is not None else len(g))
            if upto > self.streamed:
                self.streamer.put(torch.tensor(g[self.streamed:upto], dtype=torch.int64))
                self.streamed = upto
        self.drafter.update([accept_len[b] if remaining[b] > 0 else None for b in range(B)])
        if slots is not None:  # the block attached where each accepted path ends drafts the next step
            ends = [accepted[b][accept_len[b] - 1] if accept_len[b] > 0 else -1 for b in range(B)]
            slots.observe_slots([step_logits[b, inp.slot_local[b][blocks[b].index(ends[b])]]
                                 if self.remaining(b) > 0 and ends[b] in blocks[b] else None for b in range(B)])
        if self.hidden is not None:  # drafters that read the target: the row that gave each next token
            self._hand_hidden(inp, accepted, accept_len)
        # (an ended request's rows still run, never read: its last token, a valid id where pad_token_id may not be)
        self.root = [self.contexts[b][-1] for b in range(B)]
        return keep

    def _keep_accepted(self, cache_len, accepted, keep) -> None:
        """A step's cache: each request's kept slots (``keep[b]``: its root, then its accepted nodes) moved from
        slot S + (0, 1 + accepted...) (S = max(cache_len), where the step's rows start) to cache_len[b] + (0, 1, ...),
        then the cache cropped to the longest."""
        B, S = self.B, max(cache_len)
        in_place = all(cache_len[b] == S and accepted[b][:keep[b] - 1] == list(range(keep[b] - 1))
                       for b in range(B) if keep[b])
        if in_place:  # every kept slot already sits where it belongs (B = 1 chains, the common case)
            crop_cache(self.cache, S + max(keep))
        else:
            # per request the step's slots to keep: 0 (the root), then 1 + each accepted node (0 past the path),
            # with the kept counts and the cache lengths, in one copy to the device
            acc = [[0] + [max(a, -1) + 1 for a in accepted[b]] for b in range(B)]
            lens_t, acc_t, keep_t = upload_lists([cache_len, acc, keep], torch.int32, self.device)
            # the layers' buffers in one call, unchecked: the loop made these arguments itself (the kernels still
            # bound every move by the slots), and the crop below sets the lengths from the host's own figures
            compact_cache(cache_pairs(self.cache), lens_t, S, acc_t.view(B, -1), keep_t, backend=self.s.backend,
                          validate=False)
        self.cache_len = [c + k for c, k in zip(cache_len, keep)]
        crop_cache(self.cache, max(self.cache_len))

    def _ask_criteria(self) -> None:
        """generate's stopping criteria (``stopping_criteria``, max_time) asked as generate asks them: after its t-th
        token, about its whole batch [B, L + t] (a row that has ended holds pad_token_id past its end), once every
        request still running has t tokens; in order of t, each t once. A request a criterion ends after token t
        ends there as generate's row does: with an eos criterion (``pads_ended``) it is padded from there on (the
        tokens the loop has past t are dropped); without, it runs on, and the call ends when every request has ended
        (``_stop_at``)."""
        s, L = self.s, self.input_ids.shape[1]
        while self.asked < self.limit:
            t = self.asked + 1
            if any(not self.finished[b] and len(self.generated[b]) < t for b in range(self.B)):
                return  # a running request does not have its t-th token yet
            if all(self.finished[b] and len(self.generated[b]) < t for b in range(self.B)):
                return  # every row has ended: generate has stopped
            rows = [row[:L + t] + [s.pad_token_id] * (L + t - len(row)) for row in self.full]
            ended = s.stopping_criteria(torch.tensor(rows, dtype=torch.int64, device=self.device), None).tolist()
            self.asked = t
            for b, end in enumerate(ended):
                ended_before = len(self.generated[b]) < t or (self.stop_at[b] is not None and self.stop_at[b] <= t)
                if not end or ended_before:
                    continue
                if self.pads_ended:
                    drop = len(self.generated[b]) - t
                    for seq in (self.generated[b], self.contexts[b], self.full[b]):
                        del seq[len(seq) - drop:]
                    self.stats.new_tokens[b] -= drop
                    self.finished[b] = True
                else:
                    self._stop_at(b, t)

    def _stop_at(self, b: int, t: int) -> None:
        """Without an eos criterion, a stop string or a stopping criterion ended request b after its t-th token:
        generate's row runs on (it does not pad it) until every row has ended, and the call ends there."""
        self.stop_at[b] = t
        if all(n is not None for n in self.stop_at):
            self.limit = min(self.limit, max(self.stop_at))

    def _forward_with_slots(self, inp, ids, pos, mask, gate, **kw):
        """The verify forward with slot rows (ids, pos, mask, gate: the step's, after the prompt's prefix in the
        first step): their input embeddings from the drafter, its adapters gated on."""
        from fastverify.lora import slot_gate
        embeds = self.model.get_input_embeddings()(ids)
        request, slot = [], []
        for b, blocks in enumerate(inp.slot_local):
            for rows in blocks:
                request += [b] * len(rows)
                slot += range(len(rows))
        if request:
            t = torch.tensor
            request = t(request, device=self.device)
            seed = self.s.seed[request] if self.s.seed is not None else None
            embeds = embeds.index_put((gate,), self.slots.slot_embeddings(
                request, t(slot, device=self.device), inp.position_ids[inp.slot_rows], seed).to(embeds.dtype))
        with slot_gate(gate):
            return self._forward(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, **kw)

    def _verify_around_invalid_rows(self, res, logits, trees, rule, kw, remaining, raw):
        """verify reports accept_len = -1 for a request any of whose rows is invalid (NaN, +inf, all -inf). Plain
        decoding would only have read the rows along the committed path, so an invalid row elsewhere (the row of a
        rejected draft node, which the target never scores when decoding one token at a time) must not stop it.
        Each such request is verified again with the children of its invalid rows dropped (they cannot be judged)
        and those rows zeroed; if the accepted path then needs an invalid row (the root row, or the row after
        its last node, which gives the next token), a ValueError names the request, the step and the cause (the
        model's own row, ``raw``, invalid, or the processors leaving no token). Rare path: never taken while the
        logits are finite."""
        s, B = self.s, self.B
        accept_len = res.accept_len.tolist()
        accepted = res.accepted.tolist()
        next_token = res.next_token.tolist()
        row0 = 0
        for b, tree in enumerate(trees):
            n = len(tree)
            rows = logits[row0:row0 + n + 1]
            row0 += n + 1
            if accept_len[b] >= 0 or remaining[b] <= 0:
                continue
            raw_rows = raw[row0 - n - 1:row0]
            kw_b = _request_kwargs(kw, b, B)
            # which rows are invalid under this rule and warping: each row verified as a request with no draft
            probe = verify(rows, torch.zeros(0, dtype=torch.int64, device=self.device),
                           torch.zeros(n + 2, dtype=torch.int32, device=self.device), rule=rule, backend=s.backend,
                           validate=False, **_request_kwargs(kw, b, B, repeat=n + 1))
            bad = [a < 0 for a in probe.accept_len.tolist()]
            if bad[0]:
                self._invalid_logits_error(b, "its root row", raw_rows[0], rows[0])
            par = tree.parents.tolist()
            kept, new_index = [], {}
            for j, p in enumerate(par):  # a node is judged at its parent's row: keep it while that row is valid
                if not bad[p + 1] and (p < 0 or p in new_index):
                    new_index[j] = len(kept)
                    kept.append(j)
            sub_rows = rows[[0] + [j + 1 for j in kept]].clone()
            sub_rows[[i + 1 for i, j in enumerate(kept) if bad[j + 1]]] = 0  # leaves: read only if the path ends there
            sub = verify(sub_rows, tree.tokens[kept].to(self.device),
                         torch.tensor([0, len(kept)], dtype=torch.int32, device=self.device),
                         torch.tensor([-1 if par[j] < 0 else new_index[par[j]] for j in kept], dtype=torch.int32,
                                      device=self.device),
                         rule=rule, backend=s.backend, validate=False, **kw_b)
            a = int(sub.accept_len[0])
            if a < 0:  # (every row handed over is valid: not reached while verify judges rows as its probe did)
                self._invalid_logits_error(b, "a row")
            path = [kept[i] for i in sub.accepted[0, :a].tolist()]
            if path and bad[path[-1] + 1]:  # the path ends at a node whose row gives the next token
                row = path[-1] + 1
                self._invalid_logits_error(b, f"the row of accepted draft node {path[-1]}", raw_rows[row], rows[row])
            accept_len[b] = a
            accepted[b] = path + [-1] * (len(accepted[b]) - a)
            next_token[b] = int(sub.next_token[0])
        return _replaced(res, accept_len, accepted, next_token)

    def _verify_below_forced(self, res, logits, trees, forced, rule, kw, deepest):
        """Requests whose verify stopped inside their forced prefix (``_forced_first``: nodes 0..f-1, a chain, with
        every other node below node f-1) accept the whole prefix; ``rule`` then judges the subtree below it, as a
        request of its own whose root row is node f-1's row (its root token: node f-1's, for the repetition stop).
        Equal to verifying with the prefix forced (accept(j) = accept(parent) and (cond(j) or forced(j))): every
        path of such a tree runs through the prefix."""
        accept_len = res.accept_len.tolist()
        accepted = res.accepted.tolist()
        next_token = res.next_token.tolist()
        row0 = 0
        for b, (tree, f) in enumerate(zip(trees, forced)):
            n = len(tree)
            if 0 <= accept_len[b] < f:
                par = tree.parents[f:].to(torch.int32) - f
                kw_b = _request_kwargs(kw, b, self.B)
                if "root_tokens" in kw_b:
                    kw_b["root_tokens"] = tree.tokens[f - 1:f].to(self.device)
                sub = verify(logits[row0 + f:row0 + n + 1], tree.tokens[f:].to(self.device),
                             torch.tensor([0, n - f], dtype=torch.int32, device=self.device),
                             par.to(self.device), rule=rule,
                             backend=self.s.backend, validate=False, max_depth=deepest, **kw_b)
                a = int(sub.accept_len[0])
                if a < 0:
                    self._invalid_logits_error(b, "a row below the drafter's asserted tokens")
                accept_len[b] = f + a
                accepted[b] = (list(range(f)) + [f + j for j in sub.accepted[0, :a].tolist()]
                               + [-1] * len(accepted[b]))[:len(accepted[b])]
                next_token[b] = int(sub.next_token[0])
            row0 += n + 1
        return _replaced(res, accept_len, accepted, next_token)

    def _invalid_logits_error(self, b, where, raw_row=None, row=None):
        """Raise InvalidLogitsError for request b's row ``where``; raw_row / row: the model's own logits of that row
        and the processed ones, when known: where the model's are finite, the processors made the row invalid."""
        at = f"for request {b} at decoding step {self.stats.steps + 1} (after {len(self.generated[b])} new tokens)"
        if raw_row is not None and bool(torch.isfinite(raw_row).all()):
            what = ("leave no token there (every one -inf), so there is none to sample, as in generate (bans, a "
                    "prefix constraint, n-gram and length rules together excluding every token)"
                    if row is not None and bool((row == float("-inf")).all()) else "make it NaN or +inf")
            raise InvalidLogitsError(
                f"fastverify: the logits {at} are invalid on {where}, which the next token depends on: the model's "
                f"own logits are finite, and generate's logits processors {what}.")
        raise InvalidLogitsError(
            f"fastverify: the model's logits {at} are invalid (NaN, +inf, or -inf everywhere) on {where}, which "
            f"the next token depends on. Plain greedy generate would emit an arbitrary token there (argmax of a "
            f"NaN row). Check the model's weights and dtype (float16 overflow is the usual cause).")

    def _hand_hidden(self, inp, accepted, accept_len):
        """drafter.observe_hidden(hidden [B, D], active): the output projection's input at the row where each
        request's accepted path ends (its root row when nothing was accepted), from this step's forward. A drafter
        with ``wants_path_hidden`` gets observe_path(rows, active) instead: per request the rows of the whole
        accepted path [accept_len + 1, D] (root, then each accepted node), which produced the committed tokens."""
        active = [self.remaining(b) > 0 for b in range(self.B)]
        path = getattr(self.drafter, "wants_path_hidden", False)
        # per request its output rows (0: the root, 1 + j: draft node j): the whole accepted path, or its end
        local = [[0] + [1 + j for j in accepted[b][:max(accept_len[b], 0)]] for b in range(self.B)]
        value, self.hidden.value = self.hidden.value, None
        if not path:  # each path's end: views of the forward's rows (batch 1: no op; the drafter copies what it keeps)
            ends = [value[b, rows[-1]] for b, rows in enumerate(local)]
            self.drafter.observe_hidden(ends[0][None] if self.B == 1 else torch.stack(ends), active)
            return
        where = torch.tensor([[b for b, rows in enumerate(local) for _ in rows], [r for rows in local for r in rows]],
                             dtype=torch.int64).to(inp.row_batch.device)
        hidden = value[where[0], where[1]]  # one copy of the (request, row) pairs to the device
        self.drafter.observe_path(list(hidden.split([len(rows) for rows in local])), active)

    def close(self):
        if self.hidden is not None:
            self.hidden.close()
        if callable(getattr(self.drafter, "set_processors", None)):  # not holding this decoder past its generate
            self.drafter.set_processors()

    def scored(self):
        """(scores, logits) as generate returns them with output_scores / output_logits: a tuple with a [B, V] tensor
        per new token (None for what was not asked): the row that gave each request's token, after the processors
        and the sampling warpers / raw. Every request has as many tokens (one request, or rows that never end before
        the others: generate scores the padding of an ended row, which the loop does not run)."""
        T = max(len(g[:self.limit]) for g in self.generated)
        out = []
        for k in range(2):
            per = [torch.cat([r[k] for r in rows])[:T] if rows and rows[0][k] is not None else None
                   for rows in self.rows]
            if per[0] is None:
                out.append(None)
                continue
            if any(p.shape[0] != T for p in per):
                raise RuntimeError("fastverify: scores of requests that ended at different lengths")
            rows = torch.stack(per, 1).float()  # [T, B, V]
            if k == 0 and self.s.warpers is not None:
                rows = torch.stack([self.s.warpers(self.input_ids, r) for r in rows])  # (they read no input_ids)
            if k == 0 and self.s.renormalize:
                rows = rows.log_softmax(dim=-1)
            out.append(tuple(rows.unbind(0)))
        return tuple(out)

    def output(self) -> torch.Tensor:
        """[B, L + T]: the prompt (with its padding) and the emitted tokens, pad_token_id after a request ends."""
        rows = [g[:self.limit] for g in self.generated]  # a request that ran past the stop strings' end
        T = max(len(g) for g in rows)
        out = torch.full((self.B, T), self.s.pad_token_id, dtype=torch.int64, device=self.device)
        for b, g in enumerate(rows):
            if g:
                out[b, :len(g)] = torch.tensor(g, dtype=torch.int64)
        return torch.cat([self.input_ids, out], dim=1)


def model_vocab_size(model) -> int:
    """The token ids a draft may hold: rows of the input embedding (and of the output projection, if smaller)."""
    sizes = [getattr(model.config, "vocab_size", None)]
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    sizes.append(getattr(emb, "num_embeddings", None))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sizes.append(getattr(head, "out_features", None))
    return min(v for v in sizes if isinstance(v, int))


def embedding_rows(model):
    """The rows of the model's input embedding (the token ids its forward takes), or None where it does not say."""
    emb = model.get_input_embeddings()
    return getattr(emb, "num_embeddings", None) or getattr(getattr(emb, "weight", None), "shape", (None,))[0]


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 where it has none)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


def check_drafts(drafter, trees, batch_size: int, vocab_size: int) -> None:
    """Check a drafter's proposals at the loop's boundary: B trees of token ids in [0, vocab_size) whose parents
    precede their children. The trees are small and read on the host anyway (step_inputs), so the checks cost
    a few list scans per step. Raises TypeError / ValueError naming the drafter and what it returned."""
    name = type(drafter).__name__
    if not isinstance(trees, (list, tuple)) or len(trees) != batch_size:
        got = f"{len(trees)} items" if isinstance(trees, (list, tuple)) else type(trees).__name__
        raise ValueError(f"drafter {name}: propose() must return {batch_size} fastverify.tree.Tree (one per "
                         f"request), got {got}")
    for b, tree in enumerate(trees):
        if not isinstance(tree, Tree):
            raise TypeError(f"drafter {name}: propose() returned {type(tree).__name__} for request {b}; expected a "
                            f"fastverify.tree.Tree")
        tokens, parents = tree.tokens, tree.parents
        if tokens.dim() != 1 or tokens.shape != parents.shape or tokens.is_floating_point() \
                or parents.is_floating_point():
            raise ValueError(f"drafter {name}: request {b}'s tree must hold integer tokens [n] and parents [n], got "
                             f"{tokens.dtype} {tuple(tokens.shape)} and {parents.dtype} {tuple(parents.shape)}")
        toks = tokens.tolist()
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"drafter {name}: proposed token id(s) {bad[:4]} for request {b}; expected ids in "
                             f"[0, {vocab_size}) (the model's vocabulary)")
        for j, p in enumerate(parents.tolist()):
            if not -1 <= p < j:
                raise ValueError(f"drafter {name}: request {b}'s tree gives node {j} the parent {p}; expected -1 "
                                 f"(the root) or an earlier node (0 <= parent < {j})")


def _request_kwargs(kw, b, batch_size, repeat=1):
    """verify's keyword arguments for request b alone (per-request tensors [B] sliced), repeated ``repeat``
    times."""
    out = {}
    for key, value in kw.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == batch_size:
            value = value[b:b + 1].repeat(repeat)
        out[key] = value
    return out


class _LiveHead:
    """Hooks on the model's output projection: while ``live.index`` is set and its input holds ``live.total`` rows,
    the projection computes those rows only (fastverify.hf.layers.LiveRows), and its output is laid out as the
    input was, zeros in the other rows: the model's logits keep their [B, q, V] layout. Only on the thread that made
    it, as ``_HiddenCapture``: another thread's forward of the model meanwhile runs as it would."""

    def __init__(self, model, live: LiveRows):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.live, self.handles, self.thread = live, [], threading.get_ident()
        if isinstance(head, torch.nn.Module):
            self.handles = [head.register_forward_pre_hook(self._gather), head.register_forward_hook(self._scatter)]
        self.shape = None

    def _gather(self, module, args):
        if threading.get_ident() != self.thread:
            return None
        index, x = self.live.index, args[0] if args else None
        self.shape = None
        if index is None or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[:2].numel() != self.live.total:
            return None
        self.shape = x.shape[:2]
        return (x.reshape(-1, x.shape[-1]).index_select(0, index).unsqueeze(0),) + tuple(args[1:])

    def _scatter(self, module, args, output):
        if threading.get_ident() != self.thread or self.shape is None or not isinstance(output, torch.Tensor):
            return None
        shape, self.shape = self.shape, None
        return scatter_rows(output[0], self.live.index, shape.numel()).view(*shape, -1)

    def close(self):
        for h in self.handles:
            h.remove()


class _HiddenCapture:
    """Forward pre-hook on the model's output projection keeping a reference to its input (the final hidden states,
    [B, S, D]) of the latest forward on the thread that made it: the verify forward's, read by drafters with
    ``wants_hidden`` (another thread's forward of the model meanwhile is not kept). No copy and no extra forward;
    installed only for such drafters and removed when the generate call ends. It runs before every other pre-hook,
    so it sees the input in its [B, S] layout, before ``_LiveHead`` gathers the live rows. A drafter's
    ``hidden_size``, where it has one, must be the projection's input width (a drafter made for another model)."""

    def __init__(self, model, drafter=None):
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None); "
                             f"a drafter that reads the target's hidden state needs one")
        width, takes = getattr(drafter, "hidden_size", None), getattr(head, "in_features", None)
        if width is not None and takes is not None and takes != width:
            raise ValueError(f"drafter: {type(drafter).__name__} reads hidden states of width {width}, and this "
                             f"model's output projection takes {takes}: a drafter made for another model (make one "
                             f"for this model)")
        self.value, self.thread = None, threading.get_ident()
        self.handle = head.register_forward_pre_hook(self._hook, prepend=True)

    def _hook(self, module, args):
        if threading.get_ident() == self.thread:
            self.value = args[0]

    def close(self):
        self.handle.remove()


def _real_rows(real: torch.Tensor, width: int) -> torch.Tensor:
    """The flat indices, in a forward's [B, width] rows, of the True entries of ``real`` [B, n] (its first n
    columns: a prompt's real tokens, not its left padding)."""
    B, n = real.shape
    return (torch.arange(B, device=real.device)[:, None] * width + torch.arange(n, device=real.device))[real]


def _replaced(res, accept_len, accepted, next_token):
    """A VerifyOutput like ``res`` (its devices, dtypes and shapes) holding the given per-request lists."""
    dev = res.accept_len.device
    return type(res)(torch.tensor(accept_len, dtype=torch.int32, device=dev),
                     torch.tensor(accepted, dtype=torch.int32, device=dev).reshape(res.accepted.shape),
                     torch.tensor(next_token, dtype=torch.int64, device=dev))


def _forced_first(tree: Tree, f: int):
    """(tree, f'): the tree's first f' = min(f, first path's length) first-path nodes as nodes 0..f'-1 (a chain),
    then the descendants of the last of them in their order; every other node (siblings of the chain and their
    subtrees) is dropped: a drafter that asserts those tokens does not need alternatives to them. f' = 0: the
    tree unchanged."""
    parents = tree.parents.tolist()
    chain, p = [], -1
    for j, q in enumerate(parents):
        if q == p and len(chain) < f:
            chain.append(j)
            p = j
    if not chain:
        return tree, 0
    below, keep = {chain[-1]}, list(chain)
    for j, q in enumerate(parents):
        if q in below:
            below.add(j)
            keep.append(j)
    new_index = {j: i for i, j in enumerate(keep)}
    par = [-1 if i == 0 else new_index[parents[j]] for i, j in enumerate(keep)]
    return Tree(tree.tokens[keep], torch.tensor(par, dtype=tree.parents.dtype), validate=False), len(chain)


def _prune_nodes(tree: Tree, n: int) -> Tree:
    """Keep the first n nodes (parents precede children, so the prefix of the node list is a tree)."""
    return Tree(tree.tokens[:n], tree.parents[:n], validate=False)


@torch.no_grad()
def decode(model, input_ids, attention_mask, drafter, settings: DecodeSettings, streamer=None, record=None):
    """Run the loop. input_ids int64 [B, L] (left padded), attention_mask [B, L]. Returns (sequences
    [B, L + T], LoopStats). record: a dict that gets "scores" and "logits" (``Decoder.scored``) where the settings
    ask for output_scores / output_logits. One call at a time per model and per drafter (``model_lock``: a drafter
    keeps a call's requests between its steps)."""
    with model_lock(model), model_lock(drafter):
        return _decode(model, input_ids, attention_mask, drafter, settings, streamer, record)


def _decode(model, input_ids, attention_mask, drafter, settings, streamer, record):
    t0 = time.perf_counter()
    if streamer is not None:
        streamer.put(input_ids.cpu())
    installed = drafter.installed(model) if getattr(drafter, "wants_slots", False) else contextlib.nullcontext()
    linears = (skinny_linears(model, pack=settings.pack_weights) if settings.skinny_linear
               else contextlib.nullcontext())
    experts = skinny_experts(model) if settings.skinny_linear else contextlib.nullcontext()
    # a batch on the CPU: padding rows skip the row-wise work (on a GPU a few more rows cost next to nothing)
    live = LiveRows() if settings.live_rows and input_ids.shape[0] > 1 and input_ids.device.type == "cpu" else None
    layers = (lean_layers(model, pack=settings.skinny_linear and settings.pack_weights, live=live)
              if settings.lean_layers else contextlib.nullcontext())
    gelu = row_gelu(model) if input_ids.device.type == "cpu" else contextlib.nullcontext()
    with (installed, walked(model), gqa_attention(model), eager_attention(model), own_attention(model), linears,
          experts, layers, gelu):
        head = _LiveHead(model, live) if live is not None else None
        dec = Decoder(model, input_ids, attention_mask, drafter, settings, streamer, live=live)
        try:
            while not dec.done():
                dec.step()
        finally:
            dec.close()
            if head is not None:
                head.close()
    if streamer is not None:
        streamer.end()
    dec.stats.time_total = time.perf_counter() - t0
    dec.stats.new_tokens = [min(n, dec.limit) for n in dec.stats.new_tokens]
    if record is not None and dec.rows is not None:
        record["scores"], record["logits"] = dec.scored()
    return dec.output(), dec.stats
