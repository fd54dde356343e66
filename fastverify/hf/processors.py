"""generate's logits processors as the decoding loop runs them: on every verify row of a step, each row as generate
would see it (the request's tokens so far followed by the row's path of draft tokens), and the tokens they ban, which
the loop drops from the drafts before the forward (``RowProcessors.drop_banned``) and hands to drafters that follow
the processed target (``Drafter.set_processors``).

The processors generate builds from its options (``DecodeSettings``: repetition penalty, no-repeat n-grams, bad
words, suppressed tokens, minimum lengths, sequence biases, forced eos, prefix constraints, the exponential length
decay, the removal of invalid values) and a call's own ``logits_processor``, in generate's order
(``RowProcessors.process``).
"""

import functools

import torch

from fastverify.hf.attention import upload_lists
from fastverify.hf.drafters import penalized
from fastverify.ops.sampling import _float32
from fastverify.tree import Tree

__all__ = ["RowProcessors"]


def transformers_at_least(release: str) -> bool:
    """Whether the installed transformers is ``release`` or later (for what its processors do otherwise before)."""
    import transformers
    from packaging.version import Version
    return Version(transformers.__version__) >= Version(release)


@functools.cache
def _prefix_rescues() -> bool:
    """Whether transformers' PrefixConstrainedLogitsProcessor gives a row that it and the processors before it leave
    all -inf its allowed tokens at 0 (transformers 5.18 and later), rather than leaving it all -inf for generate's
    argmax to take token 0 (earlier releases): asked of the class itself, once."""
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor
    out = PrefixConstrainedLogitsProcessor(lambda batch_id, sent: [1], num_beams=1)(
        torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 2), float("-inf")))
    return bool(out[0, 1] == 0)


class RowProcessors:
    """One generate call's processors over its requests' rows. settings: the call's DecodeSettings; input_ids [B, L]
    (generate's rows, left padded); contexts, generated, full: the loop's per-request lists (the prompt without its
    padding and the tokens so far; the tokens so far; generate's row, or None where nothing reads it), read here as
    the loop extends them (``committed`` after each extension)."""

    def __init__(self, settings, input_ids, contexts, generated, full):
        self.s, self.input_ids, self.generated, self.full = settings, input_ids, generated, full
        self.eos = set(settings.eos_token_ids)
        # repetition_penalty: the tokens of each request's sequence, tokens so far included: its prompt without the
        # left padding (transformers 5.23 and later leave it out), or with it (earlier releases count it)
        self.seen = None
        if settings.repetition_penalty != 1.0:
            self.seen = ([set(c) for c in contexts] if transformers_at_least("5.23")
                         else [set(row.tolist()) for row in input_ids])
        # sequence_bias: a sequence counts where its tokens before the last fit in the row (transformers 5.18 and
        # later), or only where all of its tokens do (earlier releases leave out a sequence longer than the row)
        self.whole_bias_fits = not transformers_at_least("5.18")
        # no_repeat_ngram_size: each request's n-grams of its generate row, first n - 1 tokens -> the last tokens that
        # followed them
        self.follow = None
        if settings.no_repeat_ngram_size:
            self.follow = [{} for _ in contexts]
            for b in range(len(contexts)):
                self._add_ngrams(b, 0)

    def committed(self, b: int, new: list) -> None:
        """Request b's tokens ``new`` were just committed (the loop's lists already extended by them)."""
        if self.seen is not None:
            self.seen[b].update(new)
        if self.follow is not None:
            self._add_ngrams(b, len(self.full[b]) - len(new))

    def process(self, logits, trees, cu, remaining):
        """generate's logits processors that the loop runs, on the verify rows (logits [N + B, V] in verify's layout,
        in place; request b's rows are cu[b] + b, its root's, then its nodes' in order), each row as generate would
        see it: the request's tokens so far followed by the row's path of draft tokens. In generate's order:
        SequenceBiasLogitsProcessor (``_bias``); RepetitionPenaltyLogitsProcessor: a token of the row's sequence (the
        prompt without its left padding, the tokens so far, the path) scores s < 0 ? s * penalty : s / penalty; the
        bans of NoRepeatNGram, NoBadWords and the minimum lengths at -inf (``_early_bans``);
        PrefixConstrainedLogitsProcessor (``_constrain``); ForcedEOSTokenLogitsProcessor: the row that picks the last
        new token keeps only forced_eos, at 0 (none of the bans before it); InfNanRemoveLogitsProcessor;
        ExponentialDecayLengthPenalty (both generate's own, the decay called with each row's length); the suppressed
        tokens at -inf (``_late_bans``); then the call's own ``logits_processor``, each row a batch of one, its
        sequence as input_ids, as transformers' assisted decoding calls it on each candidate position."""
        s, V = self.s, logits.shape[-1]
        p = s.repetition_penalty
        rows, early, constrained, forced, decay, late, custom = [], [], [], [], [], [], []
        for b, tree in enumerate(trees):
            if remaining[b] <= 0:
                continue
            first, n = cu[b] + b, len(tree)
            paths = [()] + _node_paths(tree)  # the root's row, then the nodes'
            if s.sequence_bias:
                bias = [(first + j, t, v) for j, path in enumerate(paths) for t, v in self._bias(b, path).items()]
                if bias:
                    r, c = upload_lists([[x[0] for x in bias], [x[1] for x in bias]], torch.int64, logits.device)
                    logits[r, c] += torch.tensor([x[2] for x in bias], dtype=torch.float32).to(logits)
            if p != 1.0:
                seen = self.seen[b]
                sub = logits[first:first + n + 1]  # the request's rows (a view)
                base = torch.tensor(sorted(t for t in seen if t < V), dtype=torch.int64, device=logits.device)
                sub[:, base] = penalized(sub[:, base], p)
                for j, path in enumerate(paths[1:]):  # the path's tokens the sequence does not hold yet
                    rows += [(first + 1 + j, c) for c in set(path) if c < V and c not in seen]
            if s.bans:  # (the row ForcedEOS replaces gets only the bans after it)
                early += [(first + j, t) for j, path in enumerate(paths) if not self._forced(b, path)
                          for t in self._early_bans(b, path) if t < V]
                late += [(first + j, t) for j, path in enumerate(paths) for t in self._late_bans(b, path) if t < V]
            if s.prefix_allowed is not None:
                constrained.append((b, first, paths))
            if s.forced_eos:
                forced += [first + j for j, path in enumerate(paths) if self._forced(b, path)]
            if s.length_decay is not None:  # each row's length as generate's input_ids
                done = self.input_ids.shape[1] + len(self.generated[b])
                decay += [(first + j, done + len(path)) for j, path in enumerate(paths)]
            if s.logits_processor is not None:
                custom += [(first + j, self.full[b] + list(path)) for j, path in enumerate(paths)]
        if rows:
            r, c = upload_lists([[r for r, _ in rows], [c for _, c in rows]], torch.int64, logits.device)
            logits[r, c] = penalized(logits[r, c], p)
        _ban(logits, early)
        for b, first, paths in constrained:
            self._constrain(logits, b, first, paths)
        if forced:
            r = torch.tensor(forced, dtype=torch.int64).to(logits.device)
            logits[r] = float("-inf")
            logits[r[:, None], torch.tensor(s.forced_eos, dtype=torch.int64).to(logits.device)] = 0.0
        if s.remove_invalid:  # generate's InfNanRemoveLogitsProcessor, on every row
            from transformers.generation.logits_process import InfNanRemoveLogitsProcessor
            logits = InfNanRemoveLogitsProcessor()(None, logits)
        for length in sorted({n for _, n in decay}):  # one call per sequence length (the processor reads it)
            at = [r for r, n in decay if n == length]
            ids = torch.zeros((len(at), length), dtype=torch.int64, device=logits.device)  # (only its length read)
            logits[at] = s.length_decay(ids, logits[at]).to(logits.dtype)
        _ban(logits, late)
        for r, seq in custom:  # each row a batch of one
            ids = torch.tensor([seq], dtype=torch.int64, device=logits.device)
            logits[r] = s.logits_processor(ids, logits[r:r + 1].float())[0]
        return logits

    def _constrain(self, logits, b, first, paths) -> None:
        """PrefixConstrainedLogitsProcessor on request b's rows (logits[first + j] after ``paths[j]``; the bans
        before it in generate's list applied), in place: -inf on every token ``prefix_allowed_tokens_fn(b,
        sequence)`` does not allow; a row left all -inf gets the allowed tokens at 0 instead where generate's does
        (``_prefix_rescues``). The row ForcedEOS replaces is left to it."""
        fn, V = self.s.prefix_allowed, logits.shape[-1]
        for j, path in enumerate(paths):
            sent = torch.tensor(self.full[b] + list(path), dtype=torch.int64, device=logits.device)
            allowed = fn(b, sent)
            allowed = allowed.tolist() if isinstance(allowed, torch.Tensor) else list(allowed)
            if len(allowed) == 0:  # generate's own error, its message as it is
                raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {b}.This means "
                                 f"that the constraint is unsatisfiable. Please check your implementationof "
                                 f"`prefix_allowed_tokens_fn` ")
            if not all(isinstance(t, int) and 0 <= t < V for t in allowed):
                raise ValueError(f"prefix_allowed_tokens_fn: expected token ids in [0, {V}) for batch ID {b}, got "
                                 f"{sorted(set(allowed))[:8]}...")
            if self._forced(b, path):
                continue
            row = logits[first + j]
            mask = torch.full_like(row, float("-inf"))
            mask[allowed] = 0.0
            row = row + mask
            logits[first + j] = mask if _prefix_rescues() and bool(row.amax().isneginf()) else row

    def drop_banned(self, b, tree):
        """Request b's tree without the nodes whose token ``banned`` sets to -inf on their parent's row (and their
        subtrees): no rule accepts them, so their rows would be verified for nothing."""
        banned = [self.banned(b, path) for path in [()] + _node_paths(tree)]  # per row: the root's, the nodes'
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        index = {}  # kept node -> its index in the new tree
        for j, (t, q) in enumerate(zip(toks, par)):
            if (q < 0 or q in index) and t not in banned[0 if q < 0 else 1 + q]:
                index[j] = len(index)
        if len(index) == len(toks):
            return tree
        kept = list(index)
        return Tree(tree.tokens[kept], torch.tensor([index[par[j]] if par[j] >= 0 else -1 for j in kept],
                                                    dtype=tree.parents.dtype), validate=False)

    def _add_ngrams(self, b, start):
        """Record request b's n-grams that end at positions >= start of its generate row."""
        k, seq, follow = self.s.no_repeat_ngram_size, self.full[b], self.follow[b]
        for i in range(max(start, k - 1), len(seq)):
            follow.setdefault(tuple(seq[i - k + 1:i]), set()).add(seq[i])

    def banned(self, b: int, path=()) -> set:
        """The tokens generate's processors set to -inf on request b's row whose sequence is generate's row (left
        padding, prompt, tokens so far: ``self.full``) followed by the draft tokens ``path``:

        - NoRepeatNGramLogitsProcessor: where the sequence ends in the first n - 1 tokens of one of its n-grams, that
          n-gram's last token (the n-grams of the tokens so far kept in ``self.follow``, those ending in the path
          found here);
        - NoBadWordsLogitsProcessor: a bad word's last token where the sequence ends in the tokens before it;
        - SuppressTokens / SuppressTokensAtBegin: its tokens everywhere / on the row that picks the first token;
        - MinNewTokensLength / MinLength: eos on a row that picks a token numbered below min_tokens (the row picks
          token len(generated) + len(path)).

        On the row ForcedEOSTokenLogitsProcessor replaces (``_forced``), only those of the processors after it:
        SuppressTokens and SuppressTokensAtBegin; likewise on every row under a ``prefix_allowed_tokens_fn`` or
        ``remove_invalid_values``, which come between them (``DecodeSettings.bans_apart``). Handed
        to the drafter (``set_processors``): a draft model's chain avoids what the target's rows ban."""
        late = self._late_bans(b, path)
        if self._forced(b, path) or self.s.bans_apart:
            return late
        return late | self._early_bans(b, path)

    def _late_bans(self, b: int, path) -> set:
        """``banned``'s tokens of the processors after ForcedEOS in generate's list: SuppressTokens everywhere,
        SuppressTokensAtBegin on the row that picks the first token."""
        s = self.s
        return set(s.suppress) | (s.begin_suppress if len(self.generated[b]) + len(path) == 0 else set())

    def _early_bans(self, b: int, path) -> set:
        """``banned``'s tokens of the processors before PrefixConstrainedLogitsProcessor in generate's list: the
        minimum length's eos, no-repeat n-grams, bad words."""
        s, ban = self.s, set()
        k, done = s.no_repeat_ngram_size, len(self.generated[b])
        seq = self.full[b] if self.full is not None else []
        if done + len(path) < s.min_tokens:
            ban |= self.eos
        if k and len(seq) + len(path) >= k:
            x = seq[max(len(seq) - k + 1, 0):] + list(path)  # the tail holding the n-grams ending in the path
            prefix = tuple(x[len(x) - k + 1:])
            ban |= self.follow[b].get(prefix, set())
            for i in range(max(len(x) - len(path), k - 1), len(x)):  # the n-grams ending in the path
                if tuple(x[i - k + 1:i]) == prefix:
                    ban.add(x[i])
        ban.update(last for before, last in s.bad_words if _ends_in(seq, path, before))
        return ban

    def _forced(self, b: int, path) -> bool:
        """Whether request b's row after the draft path picks the last new token (generate's max_length - 1), the
        row ForcedEOSTokenLogitsProcessor keeps only the forced eos tokens on."""
        return bool(self.s.forced_eos) and len(self.generated[b]) + len(path) == self.s.max_new_tokens - 1

    def _bias(self, b: int, path) -> dict:
        """SequenceBiasLogitsProcessor on request b's row after the draft path: {token: the sum of the biases of the
        sequences ending in it whose tokens before it end the row's sequence (generate's row, then the path; before
        transformers 5.18 only sequences no longer than it)}, summed in float32 in generate's order."""
        out, length = {}, len(self.full[b]) + len(path)
        for before, last, value in self.s.sequence_bias:
            if _ends_in(self.full[b], path, before) and not (self.whole_bias_fits and len(before) >= length):
                out[last] = _float32(out.get(last, 0.0) + value)  # (two float32 values: their float32 sum)
        return out


def _ban(logits, pairs) -> None:
    """-inf at the (row, token) pairs, in one copy of the indices to the device."""
    if pairs:
        r, c = upload_lists([[r for r, _ in pairs], [c for _, c in pairs]], torch.int64, logits.device)
        logits[r, c] = float("-inf")


def _ends_in(seq: list, path, before: tuple) -> bool:
    """Whether the sequence ``seq`` followed by ``path`` ends in the tokens ``before`` (always, when it is empty)."""
    n = len(before)
    return n == 0 or (n <= len(seq) + len(path) and tuple((seq[max(len(seq) - n, 0):] + list(path))[-n:]) == before)


def _node_paths(tree: Tree) -> list:
    """Per draft node, the tokens from the root's child down to it (a tuple), in node order."""
    paths = []
    for t, q in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[q] if q >= 0 else ()) + (t,))
    return paths
