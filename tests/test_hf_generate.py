"""End-to-end exactness of fastverify.patch on tiny random models of several architectures.

Greedy: the patched generate emits exactly the tokens of the model's own generate(do_sample=False), batch 1
and batch 3 with left padding, eos in the middle, max_new_tokens exact. Sampling: with a seed, the coupled
rule emits exactly the tokens of fastverify's own autoregressive sampling (a drafter that drafts nothing).
A DraftModelDrafter using the target itself must have every greedy draft accepted: a strong check of the
masks, positions and cache compaction with chains and trees.
"""

import pytest
import torch

import fastverify
from fastverify.hf import DraftModelDrafter, Drafter, NGramDrafter, patch, stats, unpatch
from fastverify.hf.loop import InvalidLogitsError

from conftest import assert_drafts_change_no_bit, decay_keeps_inf, left_padded, letter_tokenizer, logits_equal

transformers = pytest.importorskip("transformers")

V = 1024


def _tiny(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    elif arch == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=16))
    elif arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                                     n_positions=256, initializer_range=0.08))
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model.eval()


ARCHS = ["llama", "qwen2", "mistral", "gpt2", "gemma"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return _tiny(request.param)


def _repetitive(length: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, V, (5,), generator=g).tolist()
    return (motif * (length // 5 + 1))[:length]


PAD = 1


def _batch(lengths, seed=0):
    """Left-padded batch of repetitive prompts: (input_ids [B, L], attention_mask [B, L])."""
    return left_padded([_repetitive(n, seed + b) for b, n in enumerate(lengths)], PAD)


def _reference(model, ids, mask, **kw):
    unpatch(model)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def _patched(model, ids, mask, drafter=None, backend="auto", options=None, **kw):
    patch(model, drafter=drafter, backend=backend, **(options or {}))
    try:
        return model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw), stats(model)
    finally:
        unpatch(model)


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_matches_generate(model, lengths):
    ids, mask = _batch(lengths)
    ref = _reference(model, ids, mask, max_new_tokens=24)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, do_sample=False, max_new_tokens=24)
        assert out.shape == ref.shape
        assert torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())
        assert st.new_tokens == [24] * len(lengths)


@pytest.mark.parametrize("lengths", [[150], [70, 33, 9]], ids=["batch1", "batch3"])
def test_long_prompts_prefill_in_chunks(model, lengths):
    """A prompt longer than the skinny kernels take (``loop.MAX_ROWS`` rows of a forward, shared by the batch) runs
    ahead of the first step in forwards of at most that many rows (``Decoder._prefill_chunks``): the output is
    generate's, and those forwards did run (more forwards than steps)."""
    from fastverify.hf import loop
    ids, mask = _batch(lengths)
    assert ids.shape[0] * ids.shape[1] > loop.MAX_ROWS
    ref = _reference(model, ids, mask, max_new_tokens=24)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
            forwards.clear()
            out, st = _patched(model, ids, mask, drafter=drafter, options={"row_hooks": True}, do_sample=False,
                               max_new_tokens=24)  # (the counting hook: a recorder)
            assert torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())
            assert st.drafted_tokens > 0
            if isinstance(drafter, NGramDrafter):  # (the draft model's forwards count too)
                assert len(forwards) > st.steps
    finally:
        hook.remove()


def test_cache_handed_over_under_the_forwards_own_name(model):
    """The loop and the draft-model drafter pass the cache as the forward names it (``cache`` in newer
    transformers, ``past_key_values`` before), so no deprecation warning is raised on every step."""
    import inspect
    import warnings
    ids, mask = _batch([13])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        _patched(model, ids, mask, drafter=DraftModelDrafter(model, k=2), do_sample=False, max_new_tokens=6)
    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert list(fastverify.hf.attention.cache_kwargs(model, None)) == [expected]


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_eos_in_the_middle(model, lengths):
    ids, mask = _batch(lengths, seed=3)
    free = _reference(model, ids, mask, max_new_tokens=20)
    L = ids.shape[1]
    eos = [int(free[0, L + 4]), 2]  # request 0's 5th token (and an id that never appears): stops mid-way
    ref = _reference(model, ids, mask, max_new_tokens=20, eos_token_id=eos)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=4)):
        out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=20, eos_token_id=eos)
        assert torch.equal(out, ref), (out.tolist(), ref.tolist())
        gen = out[0, L:].tolist()
        assert gen.index(eos[0]) <= 4 and all(t == PAD for t in gen[gen.index(eos[0]) + 1:])
    # a single int eos as well
    ref = _reference(model, ids, mask, max_new_tokens=20, eos_token_id=eos[0])
    out, _ = _patched(model, ids, mask, max_new_tokens=20, eos_token_id=eos[0])
    assert torch.equal(out, ref)


def _tokenizer():
    return letter_tokenizer(V)


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_stop_strings(model, lengths):
    """stop_strings (with the tokenizer) as generate applies them: a string inside a token, one spanning two
    tokens, one that never occurs. With an eos id a row a stop string ended is padded; without one, generate stops
    only once every row has stopped, the rows running on till then. The loop runs (no fallback)."""
    tok = _tokenizer()
    ids, mask = _batch(lengths, seed=5)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    words = tok.convert_ids_to_tokens(free[0, L:].tolist())
    unused = min(set(range(3, V)) - set(free[:, L:].reshape(-1).tolist()))  # an eos that is never generated
    cases = [[words[6][-1:]],  # within a token (maybe earlier too)
             [words[3][-1:] + words[4][:1], "hhhhhhhhhh"],  # across two tokens, and one that cannot occur
             ["hhhhhhhhhh"]]
    changed = 0
    for eos in (None, unused):
        for stops in cases:
            ref = _reference(model, ids, mask, max_new_tokens=20, eos_token_id=eos, stop_strings=stops,
                             tokenizer=tok)
            for drafter in (NGramDrafter(), DraftModelDrafter(model, k=4)):
                out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=20, eos_token_id=eos,
                                   stop_strings=stops, tokenizer=tok)
                assert st is not None  # the loop ran
                assert torch.equal(out, ref), (eos, stops, out.tolist(), ref.tolist())
            changed += ref.shape != free.shape or not torch.equal(ref, free)
    assert changed >= 2  # the strings that occur ended generation early, or padded a row


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_min_new_tokens_and_min_length(model, lengths):
    """min_new_tokens / min_length hold eos back as generate's logits processors do (on every verify row whose token
    comes too early); the loop runs."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    eos = [int(free[0, L + 2]), int(free[-1, L + 1])]  # tokens the requests pick early
    early = _reference(model, ids, mask, max_new_tokens=20, eos_token_id=eos)
    for kw in ({"min_new_tokens": 6}, {"min_length": L + 9}, {"min_new_tokens": 2, "min_length": L + 4},
               {"min_new_tokens": 40}):
        ref = _reference(model, ids, mask, max_new_tokens=20, eos_token_id=eos, **kw)
        assert not torch.equal(ref, early)  # held back: the output changed
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=4, tree_topk=2)):
            out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=20, eos_token_id=eos, **kw)
            assert st is not None  # the loop ran
            assert torch.equal(out, ref), (kw, out.tolist(), ref.tolist())


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_repetition_penalty_and_no_repeat_ngram_size(model, lengths):
    """repetition_penalty and no_repeat_ngram_size as generate's processors apply them, on every verify row with the
    row's own path: the prompts repeat a motif, which the n-gram drafter drafts and the processors turn away from."""
    ids, mask = _batch(lengths, seed=3)
    cases = [{"repetition_penalty": 1.3}, {"repetition_penalty": 0.7}, {"repetition_penalty": 3.0},
             {"repetition_penalty": 1.2, "min_new_tokens": 5, "eos_token_id": 7}, {"no_repeat_ngram_size": 1},
             {"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 3}, {"no_repeat_ngram_size": 20},
             {"no_repeat_ngram_size": 2, "repetition_penalty": 1.1}]
    assert _options_match_generate(model, ids, mask, cases) >= 4  # the processors moved the output


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # (tiny Gemma picks a prompt token first on every prompt)
def test_repetition_penalty_on_left_padding_as_the_release_counts_it(arch, monkeypatch):
    """generate's repetition penalty leaves each row's left padding out from transformers 5.23 (it counted the
    padding's tokens before): the loop follows the installed release. The padding holds the token the most padded
    row picks first (not in its prompt), and a case is kept where the other releases' way gives another output."""
    from fastverify.hf import processors
    model = _tiny(arch)
    at_least = processors.transformers_at_least
    kw = dict(max_new_tokens=8, repetition_penalty=100.0)
    for seed in range(3, 13):
        ids, mask = _batch([14, 6, 2], seed=seed)
        first = int(_reference(model, ids, mask, max_new_tokens=1)[2, ids.shape[1]])
        if first in ids[2][mask[2] == 1].tolist():
            continue
        ids = ids.masked_fill(mask == 0, first)
        ref = _reference(model, ids, mask, **kw)
        out, st = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
        assert st is not None and torch.equal(out, ref), (seed, out.tolist(), ref.tolist())
        with monkeypatch.context() as m:  # the other releases' way
            m.setattr(processors, "transformers_at_least", lambda release: not at_least(release))
            other, _ = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
        if not torch.equal(other, ref):
            return
    pytest.fail("no prompts in ten where counting the padding changes the output")


@pytest.mark.parametrize("lengths", [[2], [3, 2]], ids=["batch1", "batch2"])
def test_sequence_bias_longer_than_the_row_as_the_release_counts_it(lengths, monkeypatch):
    """A sequence_bias sequence one token longer than generate's rows: from transformers 5.18 it counts where its
    tokens before the last end a row; before, generate leaves such a sequence out. The loop follows the installed
    release; the other releases' way gives another output here (the sequence bans the first token generate picks)."""
    from fastverify.hf import processors
    model = _tiny("llama")
    at_least = processors.transformers_at_least
    ids, mask = _batch(lengths, seed=5)
    first = int(_reference(model, ids, mask, max_new_tokens=1)[0, ids.shape[1]])
    kw = dict(max_new_tokens=6, sequence_bias=[[ids[0].tolist() + [first], -100.0]])
    ref = _reference(model, ids, mask, **kw)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
    assert st is not None and torch.equal(out, ref), (out.tolist(), ref.tolist())
    with monkeypatch.context() as m:  # the other releases' way
        m.setattr(processors, "transformers_at_least", lambda release: not at_least(release))
        other, _ = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
    assert not torch.equal(other, ref)
    assert (int(ref[0, ids.shape[1]]) == first) == (not at_least("5.18"))


def _options_match_generate(model, ids, mask, cases):
    """Each generate option set of ``cases``: the patched output (n-gram and draft-model drafters) is generate's and
    the loop ran. Returns how many of them changed generate's output."""
    free = _reference(model, ids, mask, max_new_tokens=20)
    changed = 0
    for kw in cases:
        ref = _reference(model, ids, mask, max_new_tokens=20, **kw)
        changed += not torch.equal(ref, free)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=4, tree_topk=2)):
            out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=20, **kw)
            assert st is not None  # the loop ran
            assert torch.equal(out, ref), (kw, out.tolist(), ref.tolist())
    return changed


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_bad_words_and_suppressed_tokens(model, lengths):
    """bad_words_ids (one token, and sequences whose last token is banned only after the others), suppress_tokens
    and begin_suppress_tokens as generate's processors apply them, on every verify row with its own path."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    g = free[0, L:].tolist()
    cases = [{"bad_words_ids": [[g[3]]]}, {"bad_words_ids": [g[2:4], g[5:8]]}, {"bad_words_ids": [[g[1]], g[6:8]]},
             {"suppress_tokens": [g[4], g[9]]}, {"begin_suppress_tokens": [int(t) for t in free[:, L]]},
             {"bad_words_ids": [g[2:4]], "no_repeat_ngram_size": 3, "suppress_tokens": [g[0]]}]
    assert _options_match_generate(model, ids, mask, cases) >= 4


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_sequence_bias_and_forced_eos(model, lengths):
    """sequence_bias (single tokens and sequences, biases summed where several end in one token, as generate's
    processor sums them) and forced_eos_token_id (the last new token forced), on every verify row with its path."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    g = free[0, L:].tolist()
    o, o2 = [t for t in range(5, 100) if t not in g][:2]  # tokens the greedy output does not hold
    cases = [{"sequence_bias": [[[g[3]], -4.0]]}, {"sequence_bias": {(o,): 6.0, (g[1], o2): 9.0}},
             {"sequence_bias": [[g[2:4], -7.0], [[g[3]], 0.7], [g[1:4], 1.1], [[g[1], g[3]], -0.3]]},
             {"forced_eos_token_id": o}, {"forced_eos_token_id": [o2, g[2]], "eos_token_id": o2},
             {"forced_eos_token_id": [o, o2], "suppress_tokens": [o, g[8]], "repetition_penalty": 1.3,
              "sequence_bias": {(g[0],): -1.5}}]
    assert _options_match_generate(model, ids, mask, cases) >= 4


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_exponential_decay_length_penalty(model, lengths):
    """exponential_decay_length_penalty: generate's own processor on every verify row with the row's length, after
    the processors before it (eos held back by a minimum length stays -inf) and before suppression."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    g = free[0, L:].tolist()
    eos = [g[12], g[15]]  # tokens request 0 emits late: the growing bonus may pull them earlier
    held = {"exponential_decay_length_penalty": (2, 4.0), "eos_token_id": eos, "min_new_tokens": 7}
    cases = [{"exponential_decay_length_penalty": (2, 1.5), "eos_token_id": eos},
             {"exponential_decay_length_penalty": (0, 3.0), "eos_token_id": eos[0]},
             {"exponential_decay_length_penalty": (1, 0.5), "eos_token_id": [g[2], g[4]]},
             {"exponential_decay_length_penalty": (1, 2.0), "eos_token_id": eos, "forced_eos_token_id": eos[0],
              "suppress_tokens": [t for t in (eos[1], g[3], 5) if t != eos[0]][:1], "repetition_penalty": 1.2}]
    if decay_keeps_inf():
        cases.append(held)
    else:  # the release's penalty turns the held-back eos's -inf into NaN: generate's argmax takes the NaN's token,
        # the loop refuses the row
        with pytest.raises(InvalidLogitsError, match="invalid"):
            _patched(model, ids, mask, drafter=NGramDrafter(), max_new_tokens=20, **held)
    assert _options_match_generate(model, ids, mask, cases) >= 3


def test_greedy_remove_invalid_values(model):
    """remove_invalid_values: NaN scores become 0 and -inf ones the dtype's smallest value, after the bans before
    it, as generate's InfNanRemoveLogitsProcessor does: a token whose output row is NaN scores 0 everywhere, and a
    row every bad word bans takes token 0 (without the option the loop refuses such rows: they are invalid)."""
    import copy
    ids, mask = _batch([14, 6, 2], seed=3)
    L = ids.shape[1]
    nan = copy.deepcopy(model)
    with torch.no_grad():
        free = _reference(nan, ids, mask, max_new_tokens=12)
        nan.get_output_embeddings().weight[int(free[0, L + 3])] = float("nan")
    # (an untied output projection: a NaN input embedding would reach the other rows' attention through the draft
    # rows that hold its token, as 0 x NaN)
    tied = nan.get_output_embeddings().weight is nan.get_input_embeddings().weight
    cases = [(nan, {})] * (not tied) + [(model, {"bad_words_ids": [[t] for t in range(V)], "suppress_tokens": [0]}),
             (model, {"bad_words_ids": [[t] for t in range(V)], "no_repeat_ngram_size": 2})]
    for m, kw in cases:
        ref = _reference(m, ids, mask, max_new_tokens=12, remove_invalid_values=True, **kw)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
            out, st = _patched(m, ids, mask, drafter=drafter, max_new_tokens=12, remove_invalid_values=True, **kw)
            assert st is not None and torch.equal(out, ref), (kw, out.tolist(), ref.tolist())
    assert bool((_reference(model, ids, mask, max_new_tokens=4, remove_invalid_values=True,
                            bad_words_ids=[[t] for t in range(V)])[:, L:] == 0).all())


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_a_draft_token_with_non_finite_activations_does_not_stop_decoding(model, lengths):
    """A token whose input embedding is NaN, which greedy decoding never feeds (a second choice, in no prompt):
    generate is unaffected, but a draft row holding it puts NaN keys and values in the verify forward, which reach
    the other rows' attention (0 x NaN; in the first step the prompt's rows too). The loop runs that step again
    without drafts: generate's output."""
    import copy
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        pytest.skip("tied embeddings: the token's output row would be NaN too, and generate would emit it")
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=16)
    with torch.no_grad():
        second = model(free).logits[:, L - 1:-1].topk(2, -1).indices[..., 1].reshape(-1).tolist()
    used = set(free.reshape(-1).tolist())
    token = next(t for t in second if t not in used)
    nan = copy.deepcopy(model)
    with torch.no_grad():
        nan.get_input_embeddings().weight[token] = float("nan")
    assert torch.equal(_reference(nan, ids, mask, max_new_tokens=16), free)
    out, st = _patched(nan, ids, mask, drafter=DraftModelDrafter(model, k=3, tree_topk=2), max_new_tokens=16)
    assert torch.equal(out, free) and st.drafted_tokens > 0


def test_drafts_a_processor_bans_are_not_verified(model):
    """no_repeat_ngram_size=1 bans every token the sequence holds: the n-gram drafter's copies from the context are
    all banned, so the loop verifies none of them (and the output is still generate's)."""
    ids, mask = _batch([13], seed=3)
    ref = _reference(model, ids, mask, max_new_tokens=12, no_repeat_ngram_size=1)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), max_new_tokens=12, no_repeat_ngram_size=1)
    assert torch.equal(out, ref) and st.drafted_tokens == 0
    _, st = _patched(model, ids, mask, drafter=NGramDrafter(), max_new_tokens=12)
    assert st.drafted_tokens > 0  # without the processor the same prompt is drafted


def _every_draft_accepted(st) -> bool:
    """Whether every step accepted its draft to its full depth (each request's greedy path)."""
    return all(a == d for depth, acc in zip(st.depth, st.accepted) for d, a in zip(depth, acc) if d is not None)


def _untold(drafter):
    """``drafter`` drafting as if the generate call had no logits processor."""
    drafter.set_processors = lambda **processors: None
    return drafter


def test_self_drafting_under_a_repetition_penalty_accepts_every_draft(model):
    """A draft model penalises its logits as the target's rows are (the generate call's repetition_penalty, handed
    by the loop through ``set_processors``): the target drafting for itself then has every greedy draft accepted;
    drafting as if there were no penalty, it has some rejected."""
    ids, mask = _batch([9, 4, 12], seed=5)
    kw = {"max_new_tokens": 21, "repetition_penalty": 1.6}
    ref = _reference(model, ids, mask, **kw)
    assert not torch.equal(ref, _reference(model, ids, mask, max_new_tokens=21))  # the penalty changes the output
    out, st = _patched(model, ids, mask, drafter=DraftModelDrafter(model, k=4), **kw)
    assert torch.equal(out, ref) and _every_draft_accepted(st)
    out, st = _patched(model, ids, mask, drafter=_untold(DraftModelDrafter(model, k=4)), **kw)
    assert torch.equal(out, ref) and not _every_draft_accepted(st)


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_self_drafting_under_bans_accepts_every_draft(model, lengths):
    """The tokens generate's processors ban on a row (no_repeat_ngram_size, bad words, suppressed tokens, the
    minimum length), handed to the drafter by the loop (``set_processors(banned=...)``): the target drafting for
    itself avoids them as its rows do, so every greedy draft is accepted, in fewer steps than drafting as if
    nothing were banned (whose banned nodes the loop drops before its forward, ending those drafts early)."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    g = _reference(model, ids, mask, max_new_tokens=20)[0, L:].tolist()
    eos = int(g[2])
    steps = {True: 0, False: 0}
    for kw in ({"no_repeat_ngram_size": 2}, {"bad_words_ids": [[g[1]], g[5:7]], "suppress_tokens": [g[9]]},
               {"min_new_tokens": 12, "eos_token_id": eos}):
        ref = _reference(model, ids, mask, max_new_tokens=20, **kw)
        for told in (True, False):
            drafter = DraftModelDrafter(model, k=4) if told else _untold(DraftModelDrafter(model, k=4))
            out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=20, **kw)
            assert torch.equal(out, ref) and _every_draft_accepted(st), kw
            steps[told] += st.steps
    assert steps[True] < steps[False], steps


def test_max_new_tokens_exact(model):
    ids, mask = _batch([12])
    for n in (1, 2, 7):
        ref = _reference(model, ids, mask, max_new_tokens=n)
        out, st = _patched(model, ids, mask, drafter=DraftModelDrafter(model, k=5), max_new_tokens=n)
        assert out.shape[1] == ids.shape[1] + n
        assert torch.equal(out, ref)


def test_self_drafting_accepts_every_greedy_draft(model):
    """The target drafting for itself: every greedy draft must be accepted (masks, positions, compaction)."""
    ids, mask = _batch([9, 4, 12], seed=5)
    ref = _reference(model, ids, mask, max_new_tokens=21)
    for k, topk in ((4, 1), (3, 3)):
        out, st = _patched(model, ids, mask, drafter=DraftModelDrafter(model, k=k, tree_topk=topk), max_new_tokens=21)
        assert torch.equal(out, ref)
        for depth, accepted in zip(st.depth, st.accepted):
            for d, a in zip(depth, accepted):
                if d is not None:  # the greedy path through the tree is accepted to its full depth
                    assert a == d, (st.depth, st.accepted)
        assert st.accepted_tokens > 0
        assert st.steps < 21  # fewer forwards than tokens


def test_ngram_drafts_accepted_on_repetitive_prompt(model):
    ids, mask = _batch([30])
    _, st = _patched(model, ids, mask, max_new_tokens=30)
    assert st.drafted_tokens > 0
    assert st.accepted_tokens > 0
    assert sum(st.new_tokens) == 30
    assert st.steps == 30 - st.accepted_tokens


def _sampling_backend(name):
    """The verify backend for the sampling tests; "auto" is skipped while its sampling kernel is missing."""
    if name == "auto":
        try:
            fastverify.verify(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.int64), rule="coupled",
                              seed=torch.tensor([1]), position=torch.tensor([1]))
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"verify's default backend cannot run the sampling rules here: {e}")
    return name


SAMPLING_BACKENDS = ["torch", "auto"]


@pytest.mark.parametrize("backend", SAMPLING_BACKENDS)
@pytest.mark.parametrize("lengths", [[11], [10, 3, 7]], ids=["batch1", "batch3"])
def test_seeded_sampling_equals_autoregressive_sampling(model, lengths, backend):
    ids, mask = _batch(lengths, seed=7)
    kw = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.95, max_new_tokens=20, seed=1234,
              backend=_sampling_backend(backend))
    ar, st_ar = _patched(model, ids, mask, drafter=Drafter(), **kw)
    assert st_ar.drafted_tokens == 0
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, **kw)
        assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())
    assert st.accepted_tokens > 0  # the self-drafter's greedy drafts are often the sampled tokens at T = 0.7
    other, _ = _patched(model, ids, mask, drafter=Drafter(), **{**kw, "seed": 99})
    assert not torch.equal(other, ar)


@pytest.mark.parametrize("eos", [None, 3], ids=["no-eos", "eos"])
def test_seeded_sampling_with_stop_strings_equals_autoregressive_sampling(model, eos):
    """Sampled rows end at stop strings exactly where the loop's own autoregressive sampling ends them."""
    tok = _tokenizer()
    ids, mask = _batch([14, 6, 2], seed=7)
    kw = dict(do_sample=True, temperature=1.3, max_new_tokens=20, seed=1234, tokenizer=tok, eos_token_id=eos)
    free, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    stops = [tok.convert_ids_to_tokens(int(free[1, ids.shape[1] + 5]))[-1:]]  # a letter request 1 samples
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), stop_strings=stops, **kw)
    assert ar.shape != free.shape or not torch.equal(ar, free)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, stop_strings=stops, **kw)
        assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())


def test_seeded_sampling_with_min_new_tokens_equals_autoregressive_sampling(model):
    ids, mask = _batch([14, 6, 2], seed=7)
    kw = dict(do_sample=True, temperature=1.3, max_new_tokens=20, seed=1234)
    free, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    eos = sorted({int(t) for t in free[:, ids.shape[1]:ids.shape[1] + 4].reshape(-1)})  # tokens sampled early
    early, _ = _patched(model, ids, mask, drafter=Drafter(), eos_token_id=eos, **kw)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), eos_token_id=eos, min_new_tokens=8, **kw)
    assert not torch.equal(ar, early)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, eos_token_id=eos, min_new_tokens=8, **kw)
        assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())


@pytest.mark.parametrize("processors", [{"repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
                                        {"sequence_bias": {(5,): 3.0, (7, 9): -2.0}, "forced_eos_token_id": [11, 13]},
                                        {"exponential_decay_length_penalty": (1, 3.0), "eos_token_id": [11, 13, 17]}],
                         ids=["repetition", "bias", "decay"])
def test_seeded_sampling_with_processors_equals_autoregressive_sampling(model, processors):
    ids, mask = _batch([14, 6, 2], seed=7)
    kw = dict(do_sample=True, temperature=0.8, max_new_tokens=20, seed=1234, **processors)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    free, _ = _patched(model, ids, mask, drafter=Drafter(), do_sample=True, temperature=0.8, max_new_tokens=20,
                       seed=1234)
    assert not torch.equal(ar, free)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, **kw)
        assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())


class _Ends(transformers.StoppingCriteria):
    """A custom stopping criterion: a row ends when its last token is one of ``tokens``; every call's input_ids
    recorded. ``batch_bool``: one bool for the whole batch, every row having ended at some call (lm-eval's
    ``MultiTokenEOSCriteria`` answers so, and generate ORs it into every row)."""

    def __init__(self, tokens, batch_bool=False):
        self.tokens, self.batch_bool, self.calls, self.done = torch.tensor(tokens), batch_bool, [], None

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        hit = torch.isin(input_ids[:, -1], self.tokens)
        if not self.batch_bool:
            return hit
        self.done = hit if self.done is None else self.done | hit
        return bool(self.done.all())


class _Shift(transformers.LogitsProcessor):
    """A custom logits processor reading the sequence: bans the token after the row's last one and, on every third
    length, forces one chosen by the length; every call's input_ids recorded."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids.clone())
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] + 1) % scores.shape[1]] = float("-inf")
        if input_ids.shape[1] % 3 == 0:
            scores[:, (7 * input_ids.shape[1]) % scores.shape[1]] += 30.0
        return scores


def _ended_by_criteria(model, ids, mask, criteria_of, **kw):
    """generate's output and its criterion's calls, then the patched loop's with each drafter, asserted equal."""
    unpatch(model)
    crit = criteria_of()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD,
                             stopping_criteria=transformers.StoppingCriteriaList([crit]), **kw)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        mine = criteria_of()
        out, st = _patched(model, ids, mask, drafter=drafter,
                           stopping_criteria=transformers.StoppingCriteriaList([mine]), **kw)
        assert st is not None  # the loop ran
        assert torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())
        assert len(mine.calls) == len(crit.calls)  # asked as often, about the same batch each time
        assert all(torch.equal(a, b) for a, b in zip(mine.calls, crit.calls))
    return ref


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("eos", [False, True], ids=["no_eos", "eos"])
def test_greedy_custom_stopping_criteria(model, lengths, eos):
    """generate's stopping_criteria argument: asked about the whole batch after every token, as generate asks it
    (the same input_ids, in the same order: a running request's rows wait for the slowest), a row it ends padded
    from there where eos ids exist and running on where none do; a criterion answering for the whole batch too."""
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    stops = [int(free[b, L + 3 + 4 * b]) for b in range(len(lengths))]  # tokens each row emits early
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=[V - 1] if eos else None)
    ref = _ended_by_criteria(model, ids, mask, lambda: _Ends(stops), **kw)
    assert ref.shape[1] < free.shape[1] or not torch.equal(ref, free)  # the criterion ended the call early
    _ended_by_criteria(model, ids, mask, lambda: _Ends(stops, batch_bool=True), **kw)


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_custom_logits_processor(model, lengths):
    """generate's logits_processor argument (at batch size > 1 with row_processors=True): run on every verify row
    with the row's sequence, after the processors generate builds itself, as transformers' assisted decoding runs
    it; generate's own calls (each of its rows) are among the loop's."""
    ids, mask = _batch(lengths, seed=3)
    free = _reference(model, ids, mask, max_new_tokens=20)
    for extra in ({}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}):
        unpatch(model)
        proc = _Shift()
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, do_sample=False, max_new_tokens=20,
                                 logits_processor=transformers.LogitsProcessorList([proc]), **extra)
        assert not torch.equal(ref, free)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
            mine = _Shift()
            patch(model, drafter=drafter, row_processors=len(lengths) > 1)
            try:
                out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, do_sample=False, max_new_tokens=20,
                                     logits_processor=transformers.LogitsProcessorList([mine]), **extra)
                st = stats(model)
            finally:
                unpatch(model)
            assert st is not None and torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())
            seen = {tuple(row.tolist()) for c in mine.calls for row in c}
            assert all(tuple(row.tolist()) in seen for c in proc.calls for row in c if row[-1] != PAD)


class _BanAll(transformers.LogitsProcessor):
    """Bans every token on every fourth length: generate's argmax takes token 0 on such a row."""

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("-inf")) if input_ids.shape[1] % 4 == 0 else scores


@pytest.mark.parametrize("rule", [None, "speculative", "coupled"])
@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_a_row_the_processors_ban_entirely_takes_token_0_as_generate_does(model, lengths, rule):
    """A processor leaving a row -inf everywhere (the model's own logits finite): greedy generate emits token 0
    there, and so does the loop, whatever the drafts, and whatever the patch's rule (a sampling rule decodes a call
    without do_sample greedily); sampling from such a row raises in both."""
    ids, mask = _batch(lengths, seed=5)
    kw = dict(pad_token_id=PAD, max_new_tokens=20)
    unpatch(model)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False,
                             logits_processor=transformers.LogitsProcessorList([_BanAll()]), **kw)
    assert (ref[:, ids.shape[1]:] == 0).sum() >= 4 * len(lengths)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        patch(model, drafter=drafter, row_processors=len(lengths) > 1, **({"rule": rule} if rule else {}))
        try:
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 logits_processor=transformers.LogitsProcessorList([_BanAll()]), **kw)
            st = stats(model)
            with pytest.raises(ValueError, match="own logits are finite, and generate's logits processors leave no "
                                                 "token there"):
                model.generate(ids, attention_mask=mask, do_sample=True, seed=1,
                               logits_processor=transformers.LogitsProcessorList([_BanAll()]), **kw)
        finally:
            unpatch(model)
        assert st is not None and torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())


def test_seeded_sampling_with_custom_processor_and_criteria_equals_autoregressive_sampling(model):
    """Sampling (coupled rule) with a custom logits processor (batch 1) and stopping criterion (batch 3): the loop's
    own autoregressive sampling, with drafts or without."""
    for lengths, extra in (([13], lambda: {"logits_processor": transformers.LogitsProcessorList([_Shift()])}),
                           ([14, 6, 2], lambda: {"stopping_criteria": transformers.StoppingCriteriaList(
                               [_Ends(list(range(40, 120)))]), "eos_token_id": V - 1})):
        ids, mask = _batch(lengths, seed=7)
        kw = dict(do_sample=True, temperature=0.8, max_new_tokens=20, seed=1234)
        ar, _ = _patched(model, ids, mask, drafter=Drafter(), **kw, **extra())
        free, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
        assert not torch.equal(ar, free)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
            out, st = _patched(model, ids, mask, drafter=drafter, **kw, **extra())
            assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())


def test_max_time(model):
    """max_time: generate's MaxTimeCriteria, asked after every token as generate asks it. 0 seconds ends the call
    after its first token (some time has always passed); an hour does not end it."""
    ids, mask = _batch([14, 6, 2], seed=3)
    full = _reference(model, ids, mask, max_new_tokens=12)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), max_new_tokens=12, max_time=0.0)
    assert st is not None and torch.equal(out, full[:, :ids.shape[1] + 1])
    assert torch.equal(_reference(model, ids, mask, max_new_tokens=12, max_time=0.0), out)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), max_new_tokens=12, max_time=3600.0)
    assert st is not None and torch.equal(out, full)


def test_streamer_gets_no_token_a_criterion_takes_back(model):
    """Batch 1 with a stopping criterion: the streamer receives the output's tokens, none past where it ended."""
    class Collect:
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            pass

    ids, mask = _batch([13], seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=20)
    collect = Collect()
    out, _ = _patched(model, ids, mask, max_new_tokens=20, eos_token_id=V - 1, streamer=collect,
                      stopping_criteria=transformers.StoppingCriteriaList([_Ends([int(free[0, L + 9])])]))
    assert out.shape[1] < free.shape[1]
    assert sum(collect.puts[1:], []) == out[0, L:].tolist()


def _allowed_fn(kind):
    """prefix_allowed_tokens_fn's of three kinds, functions of the batch id and the sequence: ``wide`` (two thirds of
    the vocabulary), ``narrow`` (two tokens), ``seen`` (the sequence's third-last token, which no_repeat_ngram_size=1
    bans: the processor's all -inf fallback); every call recorded."""
    calls = []

    def fn(batch_id, sent):
        calls.append((batch_id, tuple(sent.tolist())))
        last = int(sent[-1])
        if kind == "wide":
            return [t for t in range(V) if (t + last + batch_id) % 3 != 0]
        if kind == "narrow":
            return [(7 * last + batch_id) % V, (3 * last + 1) % V]
        return [int(sent[-3])]
    return fn, calls


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2]], ids=["batch1", "batch3"])
def test_greedy_prefix_allowed_tokens_fn(model, lengths):
    """prefix_allowed_tokens_fn: every verify row constrained with its request's batch id and its own sequence, after
    the processors before it in generate's list and before the ones after it; a row left all -inf gets the allowed
    tokens at 0, as generate's processor does. generate's calls are among the loop's."""
    ids, mask = _batch(lengths, seed=3)
    free = _reference(model, ids, mask, max_new_tokens=16)
    for kind, extra in (("wide", {}), ("narrow", {"repetition_penalty": 1.3}), ("seen", {"no_repeat_ngram_size": 1}),
                        ("wide", {"no_repeat_ngram_size": 2, "suppress_tokens": [5, 6]})):
        fn, calls = _allowed_fn(kind)
        ref = _reference(model, ids, mask, max_new_tokens=16, prefix_allowed_tokens_fn=fn, **extra)
        assert not torch.equal(ref, free)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
            mine, my_calls = _allowed_fn(kind)
            out, st = _patched(model, ids, mask, drafter=drafter, max_new_tokens=16, prefix_allowed_tokens_fn=mine,
                               **extra)
            assert st is not None and torch.equal(out, ref), (kind, type(drafter).__name__, out.tolist(), ref.tolist())
            assert set(calls) <= set(my_calls)


def test_prefix_allowed_tokens_fn_sampling_and_errors(model):
    """Seeded sampling under the constraint is the loop's own autoregressive sampling; an empty list is generate's
    error; ids outside the vocabulary a ValueError naming the function."""
    ids, mask = _batch([14, 6, 2], seed=7)
    fn, _ = _allowed_fn("wide")
    kw = dict(do_sample=True, temperature=0.9, max_new_tokens=16, seed=99, prefix_allowed_tokens_fn=fn)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, **kw)
        assert torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())
    with pytest.raises(ValueError, match="returned an empty list for batch ID 0"):
        _patched(model, ids, mask, max_new_tokens=4, prefix_allowed_tokens_fn=lambda b, s: [])
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn: expected token ids in"):
        _patched(model, ids, mask, max_new_tokens=4, prefix_allowed_tokens_fn=lambda b, s: [V + 3])


def test_num_return_sequences_sample_each_prompt_several_times(model):
    """num_return_sequences: each prompt's copies next to each other, as generate expands them, each drawing from
    a seed of its own (``_request_seeds``): the loop's autoregressive sampling of the expanded batch with those
    seeds, with drafts or without; the copies differ."""
    from fastverify.hf.patch import _request_seeds
    ids, mask = _batch([14, 6, 2], seed=7)
    kw = dict(do_sample=True, temperature=1.2, max_new_tokens=16)
    wide, wide_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    ar, _ = _patched(model, wide, wide_mask, drafter=Drafter(), seed=_request_seeds(1234, 3, 3).tolist(), **kw)
    assert len({tuple(r) for r in ar[:3].tolist()}) == 3  # a prompt's copies differ
    assert torch.equal(ar[0::3], _patched(model, ids, mask, drafter=Drafter(), seed=1234, **kw)[0])  # copy 0
    for drafter in (Drafter(), NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, seed=1234, num_return_sequences=3, **kw)
        assert st is not None and torch.equal(out, ar), (type(drafter).__name__, out.tolist(), ar.tolist())
    torch.manual_seed(9)
    a, _ = _patched(model, ids, mask, num_return_sequences=2, **kw)
    torch.manual_seed(9)
    b, _ = _patched(model, ids, mask, num_return_sequences=2, **kw)
    assert a.shape[0] == 6 and torch.equal(a, b)
    with pytest.raises(ValueError, match="one per returned sequence"):
        _patched(model, ids, mask, num_return_sequences=2, seed=[1, 2], **kw)


def _assert_rows_close(mine, ref):
    """Tuples of [B, V] score / logit rows: as many, the same -inf entries, the rest equal to float32 rounding (the
    verify forward scores several rows at once)."""
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(torch.isneginf(a), torch.isneginf(b))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["batch1_eos", "batch1_processors", "batch3_no_eos", "batch1_renormalized"])
def test_return_dict_with_scores_and_logits(model, case):
    """return_dict_in_generate with output_scores / output_logits: generate's output type, each new token's
    processed scores and raw logits (the rows that gave the tokens), as generate returns them."""
    lengths = [13] if case.startswith("batch1") else [14, 6, 2]
    ids, mask = _batch(lengths, seed=3)
    L = ids.shape[1]
    free = _reference(model, ids, mask, max_new_tokens=16)
    kw = dict(max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True)
    if case == "batch1_eos":
        kw["eos_token_id"] = int(free[0, L + 9])
    elif case == "batch1_processors":
        kw.update(repetition_penalty=1.3, suppress_tokens=[int(free[0, L + 2])], no_repeat_ngram_size=2)
    elif case == "batch1_renormalized":  # the scores log-softmaxed (generate's LogitNormalization, last)
        kw.update(renormalize_logits=True, repetition_penalty=1.3)
    ref = _reference(model, ids, mask, **kw)
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, do_sample=False, **kw)
        assert st is not None and type(out) is type(ref)
        assert torch.equal(out.sequences, ref.sequences)
        _assert_rows_close(out.scores, ref.scores)
        _assert_rows_close(out.logits, ref.logits)
    if case == "batch1_eos":
        assert len(ref.scores) < 16  # eos ended it
    out, _ = _patched(model, ids, mask, do_sample=False, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, free) and out.scores is None and out.logits is None


def test_sampled_scores_are_the_warped_rows(model):
    """Sampling: each step's scores are generate's warpers (temperature, top_k) on the processed row that gave the
    token, and the loop's autoregressive sampling gives the same rows."""
    ids, mask = _batch([13], seed=7)
    kw = dict(do_sample=True, temperature=0.7, top_k=20, max_new_tokens=12, seed=5, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
    assert torch.equal(out.sequences, ar.sequences)
    _assert_rows_close(out.scores, ar.scores)
    for t, (score, logit) in enumerate(zip(out.scores, out.logits)):
        kept = torch.topk(logit / 0.7, 20).indices
        expected = torch.full_like(logit, float("-inf"))
        expected[0, kept[0]] = logit[0, kept[0]] / 0.7
        torch.testing.assert_close(score, expected)
        assert torch.isfinite(score[0, out.sequences[0, ids.shape[1] + t]])  # the sampled token was kept


@pytest.mark.parametrize("warper", [{"typical_p": 0.4}, {"epsilon_cutoff": 0.02}, {"eta_cutoff": 0.5},
                                    {"top_h": 0.5}, {"typical_p": 0.6, "top_k": 30, "temperature": 0.8}],
                         ids=["typical", "epsilon", "eta", "top_h", "typical_top_k"])
def test_sampling_with_generates_own_warpers(model, warper):
    """typical_p / epsilon_cutoff / eta_cutoff / top_h (warpers the verify op does not have): generate's own warper
    chain on the verify rows, sampled as they are. Seeded, the loop's autoregressive sampling with drafts or
    without; every sampled token inside the warped support; each step's scores generate's warpers on its raw
    logits."""
    from fastverify.hf.patch import _generation_config, _warpers
    ids, mask = _batch([13], seed=7)
    L = ids.shape[1]
    kw = dict(do_sample=True, max_new_tokens=16, seed=21, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), **kw, **warper)
    plain, _ = _patched(model, ids, mask, drafter=Drafter(), **kw)
    assert any(torch.isfinite(a).sum() < torch.isfinite(b).sum() for a, b in zip(ar.scores, plain.scores))
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, **kw, **warper)
        assert st is not None and torch.equal(out.sequences, ar.sequences), type(drafter).__name__
    gc, _ = _generation_config(model, None, dict(do_sample=True, **warper))  # generate's defaults too (top_k 50)
    chain = _warpers(gc, "cpu")
    for t, (score, logit) in enumerate(zip(ar.scores, ar.logits)):
        assert torch.equal(score, chain(ids, logit.clone()))
        assert torch.isfinite(score[0, ar.sequences[0, L + t]])


def test_scores_at_batch_size_above_one_with_eos_fall_back(model):
    import warnings
    ids, mask = _batch([14, 6], seed=3)
    patch(model)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, eos_token_id=3,
                           return_dict_in_generate=True, output_scores=True)
    finally:
        unpatch(model)
    assert any("output_scores / output_logits at batch size > 1" in str(w.message) for w in record)


def test_assistant_model_and_prompt_lookup_draft_the_call(model):
    """generate's assisted decoding arguments: ``assistant_model`` drafts the call through a DraftModelDrafter of it
    (num_assistant_tokens deep), ``prompt_lookup_num_tokens`` through the n-gram drafter; the output is generate's
    (its own assisted decoding gives its greedy output). The target as its own assistant has every draft accepted."""
    ids, mask = _batch([13], seed=3)
    kw = dict(max_new_tokens=16, do_sample=False)
    ref = _reference(model, ids, mask, max_new_tokens=16)
    assert torch.equal(_reference(model, ids, mask, max_new_tokens=16, assistant_model=model), ref)
    out, st = _patched(model, ids, mask, drafter=NGramDrafter(), assistant_model=model, num_assistant_tokens=3, **kw)
    assert torch.equal(out, ref) and _every_draft_accepted(st) and max(d[0] for d in st.depth) == 3
    out, st = _patched(model, ids, mask, drafter=Drafter(), prompt_lookup_num_tokens=5, **kw)
    assert torch.equal(out, ref) and st.drafted_tokens > 0  # (the prompt repeats: drafts from the n-gram drafter)
    wide, wide_mask = _batch([14, 6, 2], seed=3)
    out, st = _patched(model, wide, wide_mask, assistant_model=model, **kw)  # (generate's own: batch size 1 only)
    assert torch.equal(out, _reference(model, wide, wide_mask, max_new_tokens=16)) and _every_draft_accepted(st)
    sampled = dict(do_sample=True, temperature=0.9, max_new_tokens=16, seed=3)
    ar, _ = _patched(model, ids, mask, drafter=Drafter(), **sampled)
    out, _ = _patched(model, ids, mask, assistant_model=model, **sampled)
    assert torch.equal(out, ar)


def test_sampling_seed_from_torch_global_generator(model):
    ids, mask = _batch([8])
    torch.manual_seed(5)
    a, _ = _patched(model, ids, mask, do_sample=True, max_new_tokens=12, backend="torch")
    torch.manual_seed(5)
    b, _ = _patched(model, ids, mask, do_sample=True, max_new_tokens=12, backend="torch")
    assert torch.equal(a, b)


def test_speculative_rule_runs_and_stops_exactly(model):
    ids, mask = _batch([10, 4])
    patch(model, drafter=DraftModelDrafter(model, k=3), rule="speculative", backend="torch")
    try:
        out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=15, seed=3, pad_token_id=PAD)
        st = stats(model)
    finally:
        unpatch(model)
    assert out.shape == (2, ids.shape[1] + 15)
    assert st.new_tokens == [15, 15]
    assert ((out >= 0) & (out < V)).all()


def test_sampling_batch_invariance():
    """With an int seed, a request's tokens do not depend on the batch it is in (uniforms keyed by seed and
    absolute position)."""
    model = _tiny("llama")
    ids, mask = _batch([9, 5, 12], seed=11)
    kw = dict(do_sample=True, temperature=1.0, max_new_tokens=12, seed=77, backend="torch")
    both, _ = _patched(model, ids, mask, **kw)
    for b in range(3):
        n = int(mask[b].sum())
        alone, _ = _patched(model, ids[b:b + 1, -n:], mask[b:b + 1, -n:], **kw)
        assert torch.equal(alone[0, n:], both[b, ids.shape[1]:])


@pytest.mark.parametrize("lengths", [[13], [14, 6, 2], [150], [70, 33, 9]],
                         ids=["batch1", "batch3", "long", "long_batch3"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_drafts_change_no_bit_of_the_logits(model, lengths, sample):
    """On the CPU the loop's forwards run row-invariant kernels: the linear layers' skinny kernels and
    masked_attention, whose rows depend on the keys they see alone (csrc/attention.h). So a drafted step's rows are
    the logits an undrafted step computes for the same token, bit for bit: drafted and undrafted decoding return
    the same logits, prompt chunks included (long). GPT-2's Conv1D layers run skinny_linear_t, row-invariant too."""
    ids, mask = _batch(lengths, seed=3)
    kw = dict(max_new_tokens=16, return_dict_in_generate=True, output_logits=True, do_sample=sample)
    if sample:
        kw.update(temperature=0.8, top_k=50, seed=2024)
    ref, st = _patched(model, ids, mask, drafter=Drafter(), **kw)
    assert st.drafted_tokens == 0
    for drafter in (NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)):
        out, st = _patched(model, ids, mask, drafter=drafter, **kw)
        assert st.drafted_tokens > 0 and torch.equal(out.sequences, ref.sequences)
        assert logits_equal(out.logits, ref.logits), type(drafter).__name__


@pytest.mark.parametrize("lengths", [[14, 6, 2], [70, 33, 9]], ids=["batch3", "long_batch3"])
def test_a_request_s_logits_do_not_depend_on_its_batch(model, lengths):
    """The same row-invariance across a batch: a request decoded alone gives, bit for bit, the logits it gets in a
    left-padded batch (its padding keys have weight 0 and are left out of every sum; each row's linear layers are
    its own)."""
    ids, mask = _batch(lengths, seed=3)
    kw = dict(max_new_tokens=16, return_dict_in_generate=True, output_logits=True, do_sample=False)
    both, _ = _patched(model, ids, mask, drafter=NGramDrafter(), **kw)
    for b in range(len(lengths)):
        n = int(mask[b].sum())
        alone, _ = _patched(model, ids[b:b + 1, -n:], mask[b:b + 1, -n:], drafter=NGramDrafter(), **kw)
        assert torch.equal(alone.sequences[0, n:], both.sequences[b, ids.shape[1]:])
        assert logits_equal(both.logits, alone.logits, rows=slice(b, b + 1)), b


def test_a_large_batch_drafts_within_the_kernels_rows():
    """Nine requests drafting chains of 16 would make a forward of 153 rows, which torch's GEMM would take: the loop
    caps each request's draft at (MAX_ROWS - B) // B nodes (``Decoder.row_cap``), so the forward stays within the
    kernels' 128 rows and the logits are the undrafted ones bit for bit; the long prompts run in chunks of
    MAX_ROWS // 9 = 14 tokens per request."""
    from fastverify.hf.linear import MAX_ROWS
    model = _tiny("llama")
    ids, mask = _batch([12, 5, 9, 14, 3, 8, 11, 6, 40], seed=13)
    st = assert_drafts_change_no_bit(model, DraftModelDrafter(model, k=16, tree_topk=1), ids, attention_mask=mask,
                                     pad_token_id=PAD, max_new_tokens=40, do_sample=False)
    cap = (MAX_ROWS - 9) // 9
    assert max(d for depths in st.depth for d in depths if d is not None) == cap  # self-drafting fills the cap


class _Budgets(NGramDrafter):
    """An n-gram drafter that records the budget the loop gives each request."""

    def __init__(self):
        super().__init__()
        self.budgets = []

    def propose(self, contexts, budget):
        self.budgets.append([(int(bud), len(ctx)) for bud, ctx in zip(budget, contexts)])
        return super().propose(contexts, budget)


@pytest.mark.parametrize("pace, rule", [(True, None), (False, None), (True, "topk")])
def test_a_request_well_ahead_of_the_batch_drafts_nothing(pace, rule):
    """Request 0 copies its repetitive prompt several tokens a step, request 1 (random tokens) gains nothing from
    drafts: with ``pace_batch`` request 0 gets no budget once it would end in time at one token a step, while
    request 1 keeps drafting; the output is generate's either way. Not under a lossy rule, whose output depends on
    the drafts (it would then depend on the other requests)."""
    model = _tiny("llama")
    g = torch.Generator().manual_seed(3)
    ids, mask = left_padded([_repetitive(30, 1), torch.randint(3, V, (20,), generator=g).tolist()], PAD)
    want = _reference(model, ids, mask, max_new_tokens=40)
    drafter = _Budgets()
    patch(model, drafter=drafter, rule=rule, pace_batch=pace, **({"k": 2} if rule == "topk" else {}))
    try:
        got = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=40)
        st = stats(model)
    finally:
        unpatch(model)
    assert rule is not None or torch.equal(got, want)
    # (budget, context length) per request and step; request 0's prompt holds 30 tokens, it may emit 40
    paused = [step for step in drafter.budgets if step[0][0] == 0 and step[0][1] < 30 + 39 and step[1][0] > 0]
    assert bool(paused) == (pace and rule is None)
    assert drafter.budgets[0][0][0] > 0 and sum(step[0] or 0 for step in st.accepted) > 0  # request 0 drafted


def test_public_names():
    assert fastverify.patch is patch and fastverify.unpatch is unpatch
    assert fastverify.NGramDrafter is NGramDrafter and fastverify.DraftModelDrafter is DraftModelDrafter
