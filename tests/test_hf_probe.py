"""patch(model, allow_unknown_model=True): a model type outside the registry is checked by fastverify.hf.probe
before the first call the loop runs. A causal LM that honours the loop's contract passes and decodes in the loop;
an encoder used as a language model (bidirectional attention), a decoder whose positions come from its cache's
length, and a model whose forward refuses the loop's inputs fall back to the original generate, with the reason."""

import sys
import warnings

import pytest
import torch

from fastverify.hf import MODEL_REGISTRY, Drafter, NGramDrafter, patch, stats, unpatch
from fastverify.hf import probe
from fastverify.hf.probe import ProbeDrafter, _differs

from test_hf_model_types import PAD, V, _prompts, tiny

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(model, ids, mask, **kw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12, do_sample=False,
                                 **kw)
    return out, [str(w.message) for w in record if "falling back" in str(w.message)]


def test_unregistered_causal_lm_passes_and_runs_in_the_loop(monkeypatch):
    """Llama taken out of the registry: the check passes once (its verdict kept for the patch), and the loop's output
    is generate's."""
    monkeypatch.delitem(MODEL_REGISTRY, "llama")
    calls = []
    check = probe.check_model
    monkeypatch.setattr(sys.modules["fastverify.hf.patch"], "check_model", lambda *a: calls.append(1) or check(*a))
    model = tiny("llama")
    ids, mask = _prompts(3)
    ref, _ = _generate(model, ids, mask)
    patch(model, allow_unknown_model=True)
    try:
        for _ in range(2):
            out, fallbacks = _generate(model, ids, mask)
            assert not fallbacks and stats(model) is not None and torch.equal(out, ref)
    finally:
        unpatch(model)
    assert calls == [1]


def test_registered_types_are_checked_under_a_later_transformers(monkeypatch):
    """Under a transformers release later than TESTED_TRANSFORMERS a registered type is checked as an unregistered
    one is. Here the code the loop binds in for XGLM's own attention no longer computes what the model does (a
    stand-in that permutes and scales its output, as a release that changed XGLM's attention would leave the loop's
    ``_xglm_rows``): under the tested release the patched call returns other tokens than generate, silently; under a
    later one the check finds it and the call falls back, with the reason, to generate's tokens. Llama under a later
    release passes the check once and decodes in the loop."""
    from fastverify.hf import attention
    from fastverify.hf.attention import _xglm_rows
    patch_module = sys.modules["fastverify.hf.patch"]
    calls = []
    check = probe.check_model
    monkeypatch.setattr(patch_module, "check_model", lambda *a: calls.append(1) or check(*a))

    def scaled(self, hidden_states, **kwargs):
        out, weights = _xglm_rows(self, hidden_states, **kwargs)
        return out.flip(-1) * 4, weights

    monkeypatch.setitem(attention._OWN_ATTENTION, ("transformers.models.xglm.modeling_xglm", "XGLMAttention"),
                        ("forward", scaled))
    model = tiny("xglm", "eager")
    # random prompts: on _prompts' repetitive ones this tiny model's tokens come out the same either way
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref, _ = _generate(model, ids, mask)
    for later in (False, True):
        monkeypatch.setattr(patch_module, "_untested_transformers", lambda: later)
        patch(model, drafter=NGramDrafter())
        try:
            out, fallbacks = _generate(model, ids, mask)
        finally:
            unpatch(model)
        if later:
            assert torch.equal(out, ref) and len(fallbacks) == 1
            assert "is later than the releases the registry was tested on" in fallbacks[0]
        else:
            assert not fallbacks and not torch.equal(out, ref)  # the stand-in's output, unchecked
    assert calls == [1]
    model = tiny("llama")
    ref, _ = _generate(model, ids, mask)
    patch(model, drafter=NGramDrafter())
    try:
        for _ in range(2):
            out, fallbacks = _generate(model, ids, mask)
            assert not fallbacks and torch.equal(out, ref) and stats(model).drafted_tokens > 0
    finally:
        unpatch(model)
    assert calls == [1, 1]


@pytest.mark.parametrize("release, later", [("{M}.{m}.0", False), ("{M}.{m}.7", False), ("{M}.{n}.0.dev0", True),
                                           ("{M}.{n}.0", True), ("5.17.0", False)])
def test_later_transformers_by_minor_release(release, later):
    """What counts as later than TESTED_TRANSFORMERS: the next minor release and its development versions, not a
    patch release of the tested one."""
    patch_module = sys.modules["fastverify.hf.patch"]
    major, minor = (int(x) for x in patch_module.TESTED_TRANSFORMERS.split("."))
    assert patch_module._later_than_tested(release.format(M=major, m=minor, n=minor + 1)) is later


def test_verdict_is_per_dtype_and_device(monkeypatch):
    """A verdict holds for the dtype (and device and options) it was made under: the model cast to float64 is checked
    again, and a check that fails there falls back there only; cast back, the float32 verdict stands unchecked."""
    monkeypatch.delitem(MODEL_REGISTRY, "llama")
    calls = []
    check = probe.check_model

    def checked(model, *a):
        calls.append(model.dtype)
        return "refused in float64" if model.dtype == torch.float64 else check(model, *a)

    monkeypatch.setattr(sys.modules["fastverify.hf.patch"], "check_model", checked)
    model = tiny("llama")
    ids, mask = _prompts(2)
    ref, _ = _generate(model, ids, mask)
    patch(model, allow_unknown_model=True)
    try:
        out, fallbacks = _generate(model, ids, mask)
        assert not fallbacks and torch.equal(out, ref)
        model.double()
        out, fallbacks = _generate(model, ids, mask)
        assert len(fallbacks) == 1 and "refused in float64" in fallbacks[0]
        model.float()
        for _ in range(2):
            out, fallbacks = _generate(model, ids, mask)
            assert not fallbacks and torch.equal(out, ref)
        # the state of a model pickled before verdicts were kept per setup: checked afresh
        del model.__dict__[sys.modules["fastverify.hf.patch"]._STATE_ATTR].checks
        out, fallbacks = _generate(model, ids, mask)
        assert not fallbacks and torch.equal(out, ref)
    finally:
        unpatch(model)
    assert calls == [torch.float32, torch.float64, torch.float32]


@pytest.mark.parametrize("model_type, reason", [
    ("bert", "logits for new token"),  # bidirectional attention (is_decoder unset)
    ("trocr", "logits for new token"),  # positions from the cache's length, not position_ids
    ("openai-gpt", "the loop raised"),  # its attention refuses the 4D mask
])
def test_unregistered_model_that_fails_falls_back(model_type, reason):
    model = tiny(model_type, "eager")
    ids, mask = _prompts(2)
    ref, _ = _generate(model, ids, mask)
    patch(model, allow_unknown_model=True)
    try:
        for _ in range(2):  # the verdict stands for every call
            out, fallbacks = _generate(model, ids, mask)
            assert torch.equal(out, ref)
            assert len(fallbacks) == 1 and "failed the loop's check" in fallbacks[0] and reason in fallbacks[0]
    finally:
        unpatch(model)


def test_registered_types_are_not_checked(monkeypatch):
    monkeypatch.setattr(sys.modules["fastverify.hf.patch"], "check_model", lambda *a: pytest.fail("a registered type was checked"))
    model = tiny("llama")
    ids, mask = _prompts(1)
    patch(model)
    try:
        _, fallbacks = _generate(model, ids, mask)
    finally:
        unpatch(model)
    assert not fallbacks


def test_probe_drafter_trees():
    """Even steps: the next two tokens as a chain with a wrong sibling and a wrong node below; odd steps: one wrong
    token; within the budget, the chain first."""
    d = ProbeDrafter([[5, 6, 7, 8, 9], [1, 2, 3]], [4, 2], vocab_size=10)
    d.reset(2)
    trees = d.propose([[0] * 4, [0] * 2], [4, 2])
    assert trees[0].tokens.tolist() == [5, 6, 6, 9] and trees[0].parents.tolist() == [-1, -1, 0, 2]
    assert trees[1].tokens.tolist() == [1, 2] and trees[1].parents.tolist() == [-1, 0]
    trees = d.propose([[0] * 7, [0] * 5], [3, 0])
    assert trees[0].tokens.tolist() == [9] and len(trees[1]) == 0
    d = ProbeDrafter([[0, 0]], [3], vocab_size=1)  # no wrong token exists: no draft
    d.reset(1)
    assert len(d.propose([[0] * 3], [4])[0]) == 0


def test_differs_allows_rounding_and_near_ties_only():
    ref = [torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([[0.0, 5.0, 5.0]])]
    near = [r + 1e-6 for r in ref]
    assert _differs(near, ref, [[1, 1]], [[1, 1]], 1e-3) is None
    assert _differs(near, ref, [[1, 2]], [[1, 1]], 1e-3) is None  # a tie at token 1 resolved the other way
    assert "new token 0 is 2" in _differs(near, ref, [[2, 1]], [[1, 1]], 1e-3)  # not a tie
    far = [ref[0] + torch.tensor([[0.0, 0.1, 0.0]]), ref[1]]
    assert "differ from generate's by 0.0333" in _differs(far, ref, [[1, 1]], [[1, 1]], 1e-3)
    nan = [ref[0], torch.tensor([[0.0, float("nan"), 5.0]])]
    assert "new token 1" in _differs(nan, ref, [[1, 1]], [[1, 1]], 1e-3)


def _sample(model, ids, mask, drafter, **kw):
    """A seeded sampled patched generate with ``drafter``: (output, its stats, the warnings' messages)."""
    patch(model, drafter=drafter)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=True,
                                     temperature=1.3, seed=7, **kw)
        return out, stats(model), [str(w.message) for w in record]
    finally:
        unpatch(model)


@pytest.mark.parametrize("model_type", ["llama", "falcon"])
def test_sampling_drafts_where_the_loop_is_row_invariant(model_type):
    """Llama through the loop's kernels, and Falcon, whose attention calls torch's SDPA itself before transformers
    5.25 (under the loop ``fastverify.hf.attention._sdpa_rows``): their rows are the same bits beside draft rows, so
    sampled calls draft."""
    from fastverify.hf.loop import DecodeSettings
    model = tiny(model_type)
    assert probe.check_rows(model, DecodeSettings(max_new_tokens=1, eos_token_ids=[], pad_token_id=0)) is None
    ids, mask = _prompts(2)
    out, st, messages = _sample(model, ids, mask, NGramDrafter())
    assert st.drafted_tokens > 0 and not any("without drafts" in m for m in messages)
    ref, _, _ = _sample(model, ids, mask, Drafter())
    assert torch.equal(out, ref)


def test_check_rows_batch_finds_a_router_that_rounds_by_the_row_count():
    """A tiny Laguna's router with a soft cap divides its logits, four per row, by the cap before their tanh and
    sigmoid (new contiguous tensors, so which rows take torch's scalar tail depends on how many there are; without the
    cap, as Laguna's release ships, its rows are the same alone as beside others): check_rows's batch of three requests
    and 12 tokens finds it, where the greedy probe's batch (two requests, 7 tokens) does not."""
    from fastverify.hf.loop import DecodeSettings
    assert probe.check_rows(tiny("laguna"), DecodeSettings(max_new_tokens=1, eos_token_ids=[], pad_token_id=0)) is None
    model = tiny("laguna", moe_router_logit_softcapping=30.0)
    settings = DecodeSettings(max_new_tokens=1, eos_token_ids=[], pad_token_id=0)
    assert probe.check_rows(model, settings).startswith("with draft rows beside them")
    assert probe.check_rows(tiny("qwen3_moe"), settings) is None


def test_check_rows_batch_of_one_finds_a_slice_that_is_contiguous_at_one_row(monkeypatch):
    """ModernBERT's decoder applies GELU to a chunk of its MLP's output: contiguous at one row, strided at several,
    and torch's GELU rounds the two otherwise. Without the loop's ``row_gelu`` a batch of one drafts other bits than
    it decodes undrafted, which check_rows's batch of one finds (its batch of three, strided either way, does not);
    with it the rows agree."""
    import contextlib
    from fastverify.hf.loop import DecodeSettings
    model = tiny("modernbert-decoder")
    settings = DecodeSettings(max_new_tokens=1, eos_token_ids=[], pad_token_id=0)
    assert probe.check_rows(model, settings) is None
    monkeypatch.setattr(sys.modules["fastverify.hf.loop"], "row_gelu", lambda model: contextlib.nullcontext())
    assert "(a batch of 1)" in probe.check_rows(model, settings)


def test_a_verdict_holds_for_the_attention_implementation_it_was_made_under(monkeypatch):
    """A model switched to another attention implementation while patched is checked again there: Llama with sdpa
    runs the loop's kernels and samples with drafts; switched to eager, run here as transformers runs it (torch's
    matmul over the query rows: the loop's eager_attention switched off), its first sampled call checks the rows
    again and decodes without drafts; switched back, the sdpa verdict stands unchecked. Every call draws what
    undrafted decoding draws."""
    import contextlib
    calls = []
    check = probe.check_rows
    monkeypatch.setattr(sys.modules["fastverify.hf.patch"], "check_rows", lambda *a: calls.append(1) or check(*a))
    monkeypatch.setattr(sys.modules["fastverify.hf.loop"], "eager_attention", lambda model: contextlib.nullcontext())
    model = tiny("llama")
    ids, mask = _prompts(2)
    ref = {}
    for attention in ("sdpa", "eager"):
        model.set_attn_implementation(attention)
        ref[attention], _, _ = _sample(model, ids, mask, Drafter())
    patch(model, drafter=NGramDrafter())
    try:
        for attention, drafted in (("sdpa", True), ("eager", False), ("sdpa", True)):
            model.set_attn_implementation(attention)
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16,
                                         do_sample=True, temperature=1.3, seed=7)
            undrafted = any("sampling without drafts" in str(w.message) for w in record)
            assert (stats(model).drafted_tokens > 0) == drafted and undrafted == (not drafted)
            assert torch.equal(out, ref[attention])
    finally:
        unpatch(model)
    assert calls == [1, 1]


def test_sampling_without_drafts_where_the_loop_is_not_row_invariant(monkeypatch):
    """A bfloat16 Llama on the CPU (its layers on torch's bfloat16 kernels, whose result for a row depends on the
    rows computed beside it) gives a row's logits differently beside draft rows: sampled calls decode without
    drafts, with a warning, and draw what undrafted decoding draws; greedy calls still draft. The verdict is kept
    for the patch: one check."""
    calls = []
    check = probe.check_rows
    monkeypatch.setattr(sys.modules["fastverify.hf.patch"], "check_rows", lambda *a: calls.append(1) or check(*a))
    model = tiny("llama").to(torch.bfloat16)
    ids, mask = _prompts(2)
    out, st, messages = _sample(model, ids, mask, NGramDrafter())
    assert st.drafted_tokens == 0
    assert any("sampling without drafts: this model's verify forward is not row-invariant" in m for m in messages)
    ref, _, _ = _sample(model, ids, mask, Drafter())
    assert torch.equal(out, ref)
    patch(model, drafter=NGramDrafter())
    try:
        with torch.no_grad():
            for _ in range(2):
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=True, seed=7)
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=False)
        assert stats(model).drafted_tokens > 0  # greedy drafts
    finally:
        unpatch(model)
    assert calls == [1, 1]  # the first sampled call of each patch
    patch(model, drafter=NGramDrafter(), invariant_sampling=False)  # drafting anyway, unchecked
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=True, seed=7)
        assert stats(model).drafted_tokens > 0
    finally:
        unpatch(model)
    assert calls == [1, 1]
