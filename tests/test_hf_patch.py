"""fastverify.patch / unpatch: exact restoration, registry, version refusal, fallback with one warning, streamer."""

import importlib
import warnings

import pytest
import torch

from fastverify.hf import NGramDrafter, is_patched, patch, stats, unpatch

transformers = pytest.importorskip("transformers")
# the module (fastverify.hf.patch as an attribute is the function)
hf_patch = importlib.import_module("fastverify.hf.patch")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.08)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.generation_config.pad_token_id = None
    m.generation_config.eos_token_id = None
    return m


PROMPT = torch.tensor([[11, 12, 13, 14, 11, 12, 13, 14, 11, 12]])


def _fallback_warnings(record):
    return [w for w in record if "falling back to the original generate" in str(w.message)]


def test_patch_returns_same_model_and_rebinds_on_instance(model):
    cls_generate = type(model).generate
    assert "generate" not in model.__dict__
    out = patch(model)
    assert out is model and is_patched(model)
    assert model.generate.__func__ is not cls_generate and model.generate.__self__ is model
    assert type(model).generate is cls_generate  # the class is untouched
    other = type(model)(model.config)
    assert other.generate.__func__ is cls_generate  # other instances too


def test_unpatch_restores_exactly(model):
    before = dict(model.__dict__)
    patch(model, drafter=NGramDrafter())
    model.generate(PROMPT, max_new_tokens=4)
    unpatch(model)
    assert "generate" not in model.__dict__
    assert model.generate.__func__ is type(model).generate
    assert set(model.__dict__) == set(before)
    for name, value in before.items():
        assert model.__dict__[name] is value
    assert not is_patched(model) and stats(model) is None
    unpatch(model)  # a no-op on an unpatched model


def test_unpatch_restores_an_instance_generate(model):
    def custom(*a, **k):
        return "custom"
    model.generate = custom
    patch(model)
    assert model.generate is not custom
    unpatch(model)
    assert model.__dict__["generate"] is custom and model.generate() == "custom"


def test_repatch_replaces_options(model):
    patch(model, rule="greedy")
    first = model.generate
    d = NGramDrafter(max_n=2)
    patch(model, drafter=d, rule="topk", k=2)
    state = model.__dict__[hf_patch._STATE_ATTR]
    assert state.drafter is d and state.rule == "topk" and state.options["k"] == 2
    assert model.generate is not first
    unpatch(model)
    assert "generate" not in model.__dict__  # restoring goes back to the original, not the first patch


def test_patched_generate_matches_and_records_stats(model):
    ref = model.generate(PROMPT, do_sample=False, max_new_tokens=12)
    patch(model)
    out = model.generate(PROMPT, do_sample=False, max_new_tokens=12)
    st = stats(model)
    assert torch.equal(out, ref)
    assert st.steps >= 1 and st.new_tokens == [12] and st.time_forward > 0
    assert st.steps + st.accepted_tokens == 12
    summary = st.summary()
    assert 0 <= summary["non_forward_fraction"] < 1
    text = str(st)  # print(stats(model)): one line; repr keeps the per-step lists
    assert text.startswith(f"12 new tokens in {st.steps} steps ({12 / st.steps:.2f} tokens per request-step; ")
    assert f"{st.accepted_tokens} accepted" in text and "forwards" in text and "drafted=" in repr(st)


def test_input_ids_keyword_and_max_length(model):
    ref = model.generate(input_ids=PROMPT, max_length=16)
    patch(model)
    out = model.generate(input_ids=PROMPT, max_length=16)
    assert out.shape == (1, 16) and torch.equal(out, ref)


@pytest.mark.parametrize("L", [5, 30])
def test_no_length_given_makes_generates_default_count_of_new_tokens(L):
    """With no max_length / max_new_tokens in the call, its generation config or the model's, generate makes 20 new
    tokens past the prompt (at most max_position_embeddings in all); a max_length given anywhere counts the prompt.
    The loop took 20 for the whole sequence: 15 new tokens after 5, and a fallback after 30."""
    for positions in (512, L + 12):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=positions, initializer_range=0.2)).eval()
        model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
        ids = (torch.arange(L)[None] % 7) * 5 + 3
        ref = model.generate(ids)
        assert ref.shape[1] == min(L + 20, positions)
        patch(model)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model.generate(ids)
        assert torch.equal(out, ref) and not _fallback_warnings(record) and stats(model).steps >= 1
        unpatch(model)
    model.generation_config.max_length = L + 7  # the model's own: the whole sequence
    ref = model.generate(ids)
    assert ref.shape[1] == L + 7
    patch(model)
    assert torch.equal(model.generate(ids), ref)


def test_every_rule_selectable(model):
    ref = model.generate(PROMPT, do_sample=False, max_new_tokens=8)
    for rule, opts in (("greedy", {}), ("topk", {"k": 1}), ("distance", {"eps": 0}), ("gad", {"beta": 1, "tau": 0.0}),
                       ("coupled", {"backend": "torch"}), ("speculative", {"backend": "torch"})):
        patch(model, rule=rule, **opts)
        # with k=1 / eps=0 / beta=1 (and sampling rules at temperature 0), every rule reduces to greedy
        out = model.generate(PROMPT, do_sample=False, max_new_tokens=8)
        assert torch.equal(out, ref), rule
    for rule, opts in (("typical", {"eps": 0.3}), ("confidence", {"beta": 0.5})):
        patch(model, rule=rule, **opts)
        out = model.generate(PROMPT, do_sample=False, max_new_tokens=8)
        assert out.shape == ref.shape and torch.equal(out[:, :PROMPT.shape[1]], PROMPT)


@pytest.mark.parametrize("kwargs, reason", [
    ({"num_beams": 2}, "num_beams"),
    ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"return_dict_in_generate": True, "output_attentions": True}, "output_attentions"),
    ({"encoder_no_repeat_ngram_size": 2}, "encoder_no_repeat_ngram_size"),
    ({"forced_bos_token_id": 0}, "forced_bos_token_id=0"),  # a token id: 0 asks for it too
    ({"use_cache": None}, "use_cache=None"),  # generate prepares no cache then: another output than with one
])
def test_fallback_warns_once_and_runs_original(model, kwargs, reason):
    ref = model.generate(PROMPT, max_new_tokens=6, **kwargs) if not kwargs.get("do_sample") else None
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(PROMPT, max_new_tokens=6, **kwargs)
    fb = _fallback_warnings(record)
    assert len(fb) == 1 and reason in str(fb[0].message)
    assert stats(model) is None
    if ref is not None:
        if isinstance(ref, torch.Tensor):
            assert torch.equal(out, ref)
        else:
            assert torch.equal(out.sequences, ref.sequences)


def test_forced_bos_token_0_after_a_one_token_prompt(model):
    """forced_bos_token_id=0 forces token 0 as the first new token after a one-token prompt (generate tests the
    field against None): a falsy value is no unset field. The loop decoded on, without it."""
    one = PROMPT[:, :1]
    ref = model.generate(one, max_new_tokens=6, forced_bos_token_id=0)
    assert ref[0, 1] == 0 and not torch.equal(ref, model.generate(one, max_new_tokens=6))
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(one, max_new_tokens=6, forced_bos_token_id=0)
    assert torch.equal(out, ref) and len(_fallback_warnings(record)) == 1


def test_fallback_custom_processors_and_criteria_the_loop_cannot_mirror(model):
    """A custom processor / criterion of a type generate builds itself for this call replaces generate's own in its
    list; a custom processor at batch size > 1 would be called on rows generate does not have; a list of
    non-callables is generate's to refuse; a criterion with an eos_token_id makes generate pad ended rows, which it
    cannot without eos ids. Each falls back, with the reason named."""
    from transformers import (EosTokenCriteria, ExponentialDecayLengthPenalty, InfNanRemoveLogitsProcessor,
                              LogitsProcessorList, MaxLengthCriteria,
                              PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                              StoppingCriteriaList, TopKLogitsWarper)
    patch(model)
    batch = torch.cat([PROMPT, PROMPT.flip(1)])
    cases = [(dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)]),
                   repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor"),
             (dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(14)])), "MaxLengthCriteria"),
             (dict(logits_processor=LogitsProcessorList([PrefixConstrainedLogitsProcessor(lambda b, s: [3], 1)]),
                   prefix_allowed_tokens_fn=lambda b, s: [4]), "PrefixConstrainedLogitsProcessor"),
             (dict(input_ids=batch, logits_processor=LogitsProcessorList([TopKLogitsWarper(5)])), "batch size > 1"),
             (dict(logits_processor=LogitsProcessorList([ExponentialDecayLengthPenalty((1, 1.5), 5, 8)]),
                   exponential_decay_length_penalty=(2, 3.0), eos_token_id=5), "ExponentialDecayLengthPenalty"),
             (dict(logits_processor=LogitsProcessorList([InfNanRemoveLogitsProcessor()]), remove_invalid_values=True),
              "InfNanRemoveLogitsProcessor"),
             (dict(logits_processor=[3]), "expected a list of callables"),
             (dict(stopping_criteria=StoppingCriteriaList([EosTokenCriteria(5)])), "eos_token_id")]
    for kwargs, reason in cases:
        ids = kwargs.pop("input_ids", PROMPT)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            try:
                model.generate(ids, max_new_tokens=4, **kwargs)
            except (AttributeError, TypeError, ValueError):
                pass  # generate's own error, after the announced fallback
        fb = _fallback_warnings(record)
        assert len(fb) == 1 and reason in str(fb[0].message), (reason, [str(w.message) for w in record])
        assert stats(model) is None


def test_num_return_sequences_without_sampling_raises_generates_error(model):
    with pytest.raises(ValueError, match="num_return_sequences") as plain:
        model.generate(PROMPT, max_new_tokens=4, num_return_sequences=2)
    patch(model)
    with pytest.raises(ValueError, match="num_return_sequences") as patched:
        model.generate(PROMPT, max_new_tokens=4, num_return_sequences=2)
    assert str(patched.value) == str(plain.value)


def test_cache_implementations_holding_the_same_values_run_the_loop(model):
    """cache_implementation "static" / "offloaded" keep the keys and values generate's dynamic cache keeps (where
    they live differs): the loop runs with its own cache, output generate's; "quantized" changes them: fallback."""
    ref = model.generate(PROMPT, max_new_tokens=8, cache_implementation="static")
    assert torch.equal(ref, model.generate(PROMPT, max_new_tokens=8))
    patch(model)
    for cache in ("static", "offloaded"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model.generate(PROMPT, max_new_tokens=8, cache_implementation=cache)
        assert not _fallback_warnings(record) and stats(model) is not None and torch.equal(out, ref)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            model.generate(PROMPT, max_new_tokens=8, cache_implementation="quantized")
        except (ImportError, ValueError, TypeError):
            pass  # generate's own error (its quantization backend), after the announced fallback
    assert any("cache_implementation='quantized'" in str(w.message) for w in _fallback_warnings(record))


def test_streamer_batch_falls_back(model):
    class Collect:
        def put(self, value):
            pass

        def end(self):
            pass

    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.generate(torch.cat([PROMPT, PROMPT]), max_new_tokens=4, streamer=Collect())
    fb = _fallback_warnings(record)
    assert len(fb) == 1 and "streamer" in str(fb[0].message)


def test_no_warning_on_supported_call(model):
    patch(model, backend="torch")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.generate(PROMPT, max_new_tokens=4, do_sample=True, top_p=0.9, seed=1, eos_token_id=[3, 4])
    assert not _fallback_warnings(record)
    assert stats(model) is not None


def test_streamer_receives_every_token(model):
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    patch(model)
    s = Collect()
    out = model.generate(PROMPT, max_new_tokens=9, streamer=s)
    assert s.ended and s.puts[0] == PROMPT[0].tolist()
    assert sum(s.puts[1:], []) == out[0, PROMPT.shape[1]:].tolist()


def test_version_refused(model, monkeypatch):
    # by name: the module object in sys.modules is the one patch() imports
    monkeypatch.setattr("transformers.__version__", "4.40.0")
    with pytest.raises(RuntimeError, match="transformers 4.40.0 is not supported"):
        patch(model)
    monkeypatch.setattr("transformers.__version__", "6.0.0")
    with pytest.raises(RuntimeError, match=">= 5.17, < 6"):
        patch(model)
    monkeypatch.setattr("transformers.__version__", "5.16.2")
    with pytest.raises(RuntimeError, match="transformers 5.16.2 is not supported"):
        patch(model)
    assert not is_patched(model)


def test_type_registered_from_a_later_release(model, monkeypatch):
    """A registered type whose ``min_transformers`` the installed release is below counts as unregistered: patch
    refuses it, naming the release, and with allow_unknown_model the loop is checked against the model first."""
    monkeypatch.setitem(hf_patch.MODEL_REGISTRY, "llama", hf_patch.ModelSpec("llama", min_transformers="5.999"))
    with pytest.raises(ValueError, match="'llama' is registered for transformers >= 5.999"):
        patch(model)
    assert not is_patched(model)
    ref = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    patch(model, allow_unknown_model=True)
    try:
        assert model.__dict__[hf_patch._STATE_ATTR].unregistered
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, ref) and not _fallback_warnings(record) and stats(model) is not None
    finally:
        unpatch(model)
    monkeypatch.setitem(hf_patch.MODEL_REGISTRY, "llama", hf_patch.ModelSpec("llama", min_transformers="5.17"))
    patch(model)
    assert not model.__dict__[hf_patch._STATE_ATTR].unregistered
    unpatch(model)


def test_registry_and_bad_arguments(model, monkeypatch):
    assert {"llama", "qwen2", "mistral", "gpt2", "gemma"} <= set(hf_patch.MODEL_REGISTRY)
    monkeypatch.setattr(model.config, "model_type", "mystery")
    with pytest.raises(ValueError, match="not in the registry"):
        patch(model)
    patch(model, allow_unknown_model=True)
    unpatch(model)
    monkeypatch.setattr(model.config, "model_type", "llama")
    with pytest.raises(ValueError, match="rule"):
        patch(model, rule="nope")
    with pytest.raises(TypeError, match="unknown option"):
        patch(model, depth=3)
    with pytest.raises(TypeError, match="drafter"):
        patch(model, drafter=object())
    with pytest.raises(TypeError, match="skinny_linear"):
        patch(model, skinny_linear="yes")
    with pytest.raises(TypeError, match="pack_weights: expected a bool"):
        patch(model, pack_weights="yes")
    with pytest.raises(TypeError, match="sync: expected a bool"):
        patch(model, sync="yes")
    for draft in (2.5, "3", True):
        with pytest.raises(TypeError, match="max_draft: expected an int"):
            patch(model, max_draft=draft)
    with pytest.raises(ValueError, match=r"max_draft: expected >= 0 \(0: no drafts\), got -1"):
        patch(model, max_draft=-1)
    assert not is_patched(model)


@pytest.mark.parametrize("skinny", [True, False])
def test_skinny_linear_option(model, skinny):
    # on or off, greedy output equals the unpatched generate, and no rerouted forward is left on the model
    ref = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    patch(model, skinny_linear=skinny)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12, do_sample=False), ref)
    assert not any("forward" in m.__dict__ for m in model.modules())
    unpatch(model)


def test_bad_seed_length(model):
    patch(model, backend="torch")
    with pytest.raises(ValueError, match="seed"):
        model.generate(PROMPT.expand(2, -1), do_sample=True, max_new_tokens=3, seed=[1, 2, 3])
