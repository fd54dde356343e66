"""Patched generate never returns a wrong token silently: attention windows and position-dependent RoPE, invalid
logits, sampling with a deterministic rule, seeds on the fallback path, arguments that used to crash the
fallback check, pickling, drafter output, rule options checked at patch time, the fallback messages, calls from
two threads at once, a model in training mode and forward hooks."""

import contextlib
import copy
import io
import logging
import pickle
import threading
import time
import types
import warnings

import pytest
import torch

import fastverify
from fastverify.hf import DraftModelDrafter, Drafter, NGramDrafter, is_patched, patch, stats, unpatch
from fastverify.tree import Tree

from conftest import left_padded

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512
PAD = 1
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08, pad_token_id=0)


def _finish(model):
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model.eval()


def _llama(**kw):
    torch.manual_seed(0)
    return _finish(transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(COMMON, **kw))))


def _prompts(B, L=30, seed=0):
    """B left-padded repetitive prompts of lengths L, L - 3, ...: (ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    motifs = [torch.randint(3, V, (4,), generator=g).tolist() for _ in range(B)]
    return left_padded([(motifs[b] * L)[:L - 3 * b] for b in range(B)], PAD)


def _run(model, ids, mask, **kw):
    """(output, fastverify warnings) of one generate call."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
    return out, [str(w.message) for w in record if "fastverify" in str(w.message)]


def _fallbacks(messages):
    return [m for m in messages if "falling back to the original generate" in m]


# ------------------------------------------------------------------------------------ 1. windows and RoPE

def _windowed(arch, window):
    torch.manual_seed(0)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=16, use_sliding_window=True, sliding_window=window,
                                       max_window_layers=0)
        return _finish(transformers.Qwen3ForCausalLM(cfg)), {}
    if arch == "qwen2_mixed":  # the second layer a sliding one, the first full
        cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=1)
        assert cfg.layer_types == ["full_attention", "sliding_attention"]
        return _finish(transformers.Qwen2ForCausalLM(cfg)), {}
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=window)
        return _finish(transformers.Gemma2ForCausalLM(cfg)), {}
    if arch == "gemma3_text":
        cfg = transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=window)
        return _finish(transformers.Gemma3ForCausalLM(cfg)), {}
    if arch == "mistral":
        return _finish(transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=window))), {}
    if arch == "phi3":
        return _finish(transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, sliding_window=window))), {}
    # types whose forward takes a mask per layer type; two layers, the first a sliding one
    if arch == "cohere2":
        cfg = transformers.Cohere2Config(**COMMON, sliding_window=window, sliding_window_pattern=2)
        return _finish(transformers.Cohere2ForCausalLM(cfg)), {}
    if arch == "ministral":
        cfg = transformers.MinistralConfig(**COMMON, head_dim=16, sliding_window=window,
                                           layer_types=["sliding_attention", "full_attention"])
        return _finish(transformers.MinistralForCausalLM(cfg)), {}
    if arch == "olmo3":
        cfg = transformers.Olmo3Config(**COMMON, sliding_window=window,
                                       layer_types=["sliding_attention", "full_attention"])
        return _finish(transformers.Olmo3ForCausalLM(cfg)), {}
    if arch == "smollm3":
        cfg = transformers.SmolLM3Config(**COMMON, sliding_window=window, use_sliding_window=True,
                                         layer_types=["sliding_attention", "full_attention"])
        return _finish(transformers.SmolLM3ForCausalLM(cfg)), {}
    if arch == "gpt_oss":  # attention sinks, a mixture of experts
        cfg = transformers.GptOssConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=window)
        return _finish(transformers.GptOssForCausalLM(cfg)), {}
    raise ValueError(arch)


WINDOWED = ["qwen3", "qwen2_mixed", "gemma2", "gemma3_text", "mistral", "phi3", "cohere2", "ministral", "olmo3",
            "smollm3", "gpt_oss"]


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_sliding_window_shorter_than_sequence_is_masked_by_the_loop(arch, B, drafter):
    """Prompts of 30 tokens and 20 new ones through windows of 6 and 16: the loop masks each sliding layer's window
    itself (the prompt's rows in the first step, and every draft row on its own path), exact against generate,
    whose cache keeps only the window; an n-gram drafter on repetitive prompts, and the model drafting for itself.
    At least one window changes generate's output, so the comparison tells masked from unmasked."""
    changed = []
    for window in (6, 16):
        model, extra = _windowed(arch, window)
        ids, mask = _prompts(B)
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
        d = NGramDrafter() if drafter == "ngram" else DraftModelDrafter(model, k=3, tree_topk=2)
        patch(model, drafter=d, **extra)
        out, messages = _run(model, ids, mask, max_new_tokens=20, do_sample=False)
        assert not _fallbacks(messages), messages
        st = stats(model)
        assert st.steps >= 1 and st.drafted_tokens > 0
        assert torch.equal(out, ref), (window, out.tolist(), ref.tolist())
        unpatch(model)
        full, _ = _windowed(arch, 256)
        changed.append(not torch.equal(full.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20,
                                                     do_sample=False), ref))
    assert any(changed)


def test_sliding_window_sampling_equals_autoregressive_sampling():
    """Seeded sampling through a window: the coupled rule's output equals the loop's own one-token-a-step sampling
    with the same seed (drafts change nothing)."""
    model, _ = _windowed("qwen3", 8)
    ids, mask = _prompts(2)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, seed=11)
    patch(model, drafter=Drafter())
    ref, _ = _run(model, ids, mask, **kw)
    patch(model, drafter=DraftModelDrafter(model, k=3))
    out, messages = _run(model, ids, mask, **kw)
    assert not _fallbacks(messages) and stats(model).drafted_tokens > 0
    assert torch.equal(out, ref)


def test_window_the_loop_does_not_mask_falls_back():
    """A window of a model type the loop does not know how to mask (here a Llama config given a sliding_window,
    which Llama's layers ignore) still bounds the sequence: beyond it, the original generate with a warning."""
    from fastverify.hf.model_limits import loop_window, sequence_limit
    model = _llama()
    model.config.sliding_window = 16
    assert loop_window(model.config) is None and sequence_limit(model.config) == (16, "sliding_window=16")
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    fb = _fallbacks(messages)
    assert len(fb) == 1 and "sliding" in fb[0] and "16" in fb[0], messages


def test_bidirectional_gemma3_falls_back():
    """Gemma 3 with use_bidirectional_attention: generate's masks are not causal, the loop's are; it refuses."""
    cfg = transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=16, use_bidirectional_attention=True)
    from fastverify.hf.model_limits import sequence_limit
    limit, what = sequence_limit(cfg)
    assert limit == 0 and "bidirectional" in what


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3_text", "mistral"])
def test_sliding_window_longer_than_sequence_runs_the_loop(arch):
    model, extra = _windowed(arch, 64)  # 30 + 20 tokens fit in the window: full attention is exact
    ids, mask = _prompts(2)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
    patch(model, **extra)
    out, messages = _run(model, ids, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages) and stats(model).steps >= 1


def test_window_of_only_some_layers_counts():
    """Qwen2 windows only the layers from max_window_layers on: none here, so nothing limits the loop."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert set(cfg.layer_types) == {"full_attention"}
    model = _finish(transformers.Qwen2ForCausalLM(cfg))
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12, do_sample=False)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages)


@pytest.mark.parametrize("rope, falls_back", [({"rope_type": "dynamic", "factor": 2.0}, True),
                                              ({"rope_type": "linear", "factor": 2.0}, False)])
def test_position_dependent_rope(rope, falls_back):
    model = _llama(max_position_embeddings=40, rope_parameters=dict(rope, rope_theta=10000.0))
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=20, do_sample=False)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    assert bool(_fallbacks(messages)) == falls_back, messages
    # within the original length the dynamic RoPE keeps its frequencies: the loop runs
    ref = model.generate(ids[:, :20], pad_token_id=PAD, max_new_tokens=10, do_sample=False)
    out, messages = _run(model, ids[:, :20], mask[:, :20], max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages)


def _slot_drafter(model, ptp, seed=0):
    """A LUD (ptp: O-PTP) slot drafter with 4 slots and random, active adapters."""
    from fastverify.hf.slots import BlockSlotDrafter, PTPSlotDrafter
    D = model.config.hidden_size
    d = PTPSlotDrafter(D, num_slots=4) if ptp else BlockSlotDrafter(D, num_slots=4, method="lud")
    d.init_adapters(model, rank=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in d.adapters.values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.1)
    return d


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                   "original_max_position_embeddings": 40}])
@pytest.mark.parametrize("ptp", [False, True])
@pytest.mark.parametrize("L, new", [(24, 16), (36, 4)])  # the second: slot rows reach the bound in the first step
def test_slot_rows_stay_below_a_position_dependent_rope_bound(rope, ptp, L, new):
    """A slot drafter's placeholder rows stand up to a block past the draft; near the end of a sequence that just
    fits a dynamic / longrope RoPE's bound they would pass it and switch the frequencies of the whole forward,
    verified rows included. The loop drops those blocks."""
    from fastverify.hf.model_limits import position_limit
    model = _llama(max_position_embeddings=40, rope_parameters=dict(rope, rope_theta=10000.0), head_dim=16)
    assert position_limit(model.config) == 40
    ids, mask = _prompts(2, L=L)
    opts = dict(max_new_tokens=new, do_sample=ptp, **({"top_k": 0} if ptp else {}))
    if ptp:  # the coupled rule's output is the loop's own autoregressive sampling with the seed
        patch(model, drafter=Drafter())
        ref, _ = _run(model, ids, mask, seed=7, **opts)
        unpatch(model)
    else:
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **opts)
    # a longer call in between: a dynamic RoPE grows its frequencies and keeps them until a forward spans fewer
    # positions than its bound (plain decoding's first forward does; the loop's must too)
    model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=24, do_sample=False)
    patch(model, drafter=_slot_drafter(model, ptp))
    out, messages = _run(model, ids, mask, **({"seed": 7} if ptp else {}), **opts)
    assert not _fallbacks(messages) and stats(model).drafted_tokens > 0
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_greedy_warns_once(dtype):
    """Half precision: the multi-row verify forward rounds differently from one-row decoding, so near-ties may
    resolve the other way; the first generate says so, once per patch. float32 and lossy rules do not warn."""
    model = _llama().to(dtype)
    ids, mask = _prompts(1)
    patch(model)
    messages = [_run(model, ids, mask, max_new_tokens=4, do_sample=False)[1] for _ in range(2)]
    assert len(messages[0]) == 1 and "rounds differently" in messages[0][0] and str(dtype)[6:] in messages[0][0]
    assert messages[1] == []
    patch(model)  # a new patch warns again
    assert len(_run(model, ids, mask, max_new_tokens=4, do_sample=False)[1]) == 1
    patch(model, rule="topk", k=2)
    assert _run(model, ids, mask, max_new_tokens=4, do_sample=False)[1] == []
    model = _llama()
    patch(model)
    assert _run(model, ids, mask, max_new_tokens=4, do_sample=False)[1] == []


def test_unknown_layer_type_falls_back():
    from fastverify.hf.model_limits import sequence_limit
    cfg = transformers.LlamaConfig(**COMMON)
    cfg.layer_types = ["full_attention", "linear_attention"]
    limit, what = sequence_limit(cfg)
    assert limit == 0 and "linear_attention" in what


def test_unknown_model_refusal_names_windows():
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="sliding-window"):
        patch(model)


# ------------------------------------------------------------------------------------ 2. invalid logits

def _nan_model():
    model = _llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    return model


@pytest.mark.parametrize("max_new_tokens", [1, 2, 8])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_nan_logits_raise_naming_request_and_step(max_new_tokens, backend):
    model = _nan_model()
    patch(model, backend=backend)
    ids, mask = _prompts(2)
    with pytest.raises(ValueError, match=r"request 0 at decoding step 1 .*invalid \(NaN"):
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens, do_sample=False)
    with pytest.raises(ValueError, match="request 0 at decoding step 1"):
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens, do_sample=True,
                       seed=3)


POISON = 7


class _PoisonDrafter(Drafter):
    """Proposes the poison token as a child of the root next to a chain of ``inner`` drafts."""

    def __init__(self, inner):
        self.inner = inner

    def reset(self, batch_size):
        self.inner.reset(batch_size)

    def propose(self, contexts, budget):
        trees = []
        for t, bud in zip(self.inner.propose(contexts, [max(b - 1, 0) for b in budget]), budget):
            if bud <= 0:
                trees.append(t)
                continue
            tokens = [POISON] + t.tokens.tolist()
            parents = [-1] + [p + 1 if p >= 0 else -1 for p in t.parents.tolist()]
            trees.append(Tree(tokens, parents))
        return trees

    def update(self, accepted):
        self.inner.update(accepted)


def _poison_rows(model):
    """A hook that makes the logits row of every position fed the poison token NaN (as float16 overflow on one
    token would): plain decoding never feeds it, drafts do."""
    state = {}

    def pre(module, args, kwargs):
        state["ids"] = kwargs.get("input_ids", args[0] if args else None)

    def post(module, args, kwargs, out):
        ids = state["ids"]
        if ids is not None:
            ids = ids[:, ids.shape[1] - out.logits.shape[1]:]  # the rows with logits (logits_to_keep)
        if ids is not None and (ids == POISON).any():
            out.logits[ids == POISON] = float("nan")
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("sampling", [False, True])
def test_invalid_rows_off_the_committed_path_do_not_stop_decoding(backend, sampling):
    model = _llama()
    ids, mask = _prompts(3)
    kw = dict(max_new_tokens=16, do_sample=sampling)
    if sampling:
        kw["seed"] = 11
        patch(model, drafter=Drafter(), backend=backend)  # the loop's own autoregressive sampling
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
        unpatch(model)
    else:
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
    assert not (ref[:, ids.shape[1]:] == POISON).any()
    _poison_rows(model)
    patch(model, drafter=_PoisonDrafter(NGramDrafter()), backend=backend, row_hooks=True)  # (the hooks: row-wise)
    out, _ = _run(model, ids, mask, **kw)
    assert torch.equal(out, ref)
    if not sampling:
        assert stats(model).accepted_tokens > 0  # the n-gram chain beside the poison was still accepted


# ------------------------------------------------------------------------------------ 3. sampling and seeds

@pytest.mark.parametrize("rule, opts", [("greedy", {}), ("topk", {"k": 3})])
def test_deterministic_rule_with_do_sample_switches_with_a_warning(rule, opts):
    model = _llama()
    ids, mask = _prompts(1)
    patch(model, rule=rule, **opts)
    one, messages = _run(model, ids, mask, max_new_tokens=16, do_sample=True, seed=1)
    two, _ = _run(model, ids, mask, max_new_tokens=16, do_sample=True, seed=2)
    assert any("does not sample" in m and "coupled" in m for m in messages), messages
    assert not torch.equal(one, two)
    patch(model, rule="coupled")
    assert torch.equal(model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16,
                                      do_sample=True, seed=1), one)


def test_fallback_honours_the_seed():
    model = _llama()
    ids, mask = _prompts(1)
    patch(model)
    kw = dict(max_new_tokens=16, do_sample=True, guidance_scale=1.5)
    one, messages = _run(model, ids, mask, seed=5, **kw)
    two, _ = _run(model, ids, mask, seed=5, **kw)
    other, _ = _run(model, ids, mask, seed=6, **kw)
    assert torch.equal(one, two) and not torch.equal(one, other)
    assert "seed 5 seeds torch's generators" in _fallbacks(messages)[0]
    # the seed does not leak: torch's global stream is where it was
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    _run(model, ids, mask, seed=5, **kw)
    assert torch.equal(torch.rand(3), a)


def test_seed_of_another_type_raises_naming_it():
    """seed= takes an int, a list of ints or an integer tensor (numpy integers too); anything else is a ValueError
    naming the argument, whether the call samples or not (it crashed in torch.as_tensor, or truncated floats)."""
    import numpy as np
    model = _llama()
    ids, mask = _prompts(2)
    patch(model)
    for bad in ("x", 1.5, [1, 2.5], True, [], torch.tensor([1.0, 2.0]), None.__class__):
        for sample in (True, False):
            with pytest.raises(ValueError, match="seed: expected"):
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=3, do_sample=sample,
                               seed=bad)
    ref, _ = _run(model, ids, mask, max_new_tokens=6, do_sample=True, seed=[4, 9])
    for same in (np.int64(4), [np.int32(4), 9], torch.tensor([4, 9])):
        seeds = [same, 9] if isinstance(same, np.integer) else same
        out, _ = _run(model, ids, mask, max_new_tokens=6, do_sample=True, seed=seeds)
        assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------ 4. tensor arguments

def test_tensor_arguments_fall_back_instead_of_crashing():
    model = _llama()
    ids, mask = _prompts(1)
    embeds = model.get_input_embeddings()(ids)
    ref = model.generate(inputs_embeds=embeds, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6)
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(inputs_embeds=embeds, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6)
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, negative_prompt_ids=ids,
                       guidance_scale=1.5)
    messages = [str(w.message) for w in record]
    assert torch.equal(out, ref)
    assert any("inputs_embeds is not supported" in m for m in messages)
    assert any("negative_prompt_ids is not supported" in m for m in messages)


# ------------------------------------------------------------------------------------ 5. pickling

@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_patched_model_pickles_and_loads_patched(how):
    model = _llama()
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12, do_sample=False)
    patch(model, rule="greedy", max_draft=8)
    model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    elif how == "deepcopy":
        loaded = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    assert loaded is not model and is_patched(loaded) and loaded.generate.__self__ is loaded
    out, messages = _run(loaded, ids, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages) and stats(loaded).steps >= 1
    unpatch(loaded)
    assert "generate" not in loaded.__dict__ and not is_patched(loaded)
    assert torch.equal(loaded.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12), ref)


def test_save_pretrained_after_patch_writes_the_model_as_it_was(tmp_path):
    """A patched model's state dict and saved files hold its own weights only (the packed copies the loop streams
    are not among them); reloaded, unpatched, it generates as before."""
    model = _llama()
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12, do_sample=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    model.save_pretrained(tmp_path)
    loaded = _finish(transformers.LlamaForCausalLM.from_pretrained(tmp_path))
    assert not is_patched(loaded)
    assert torch.equal(loaded.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12), ref)


@pytest.mark.parametrize("device_map", ["cpu", "disk"])
def test_accelerate_device_map_and_disk_offload(tmp_path, device_map):
    """A model loaded with accelerate's ``device_map`` (its hooks on the modules; "disk": every weight offloaded,
    on the meta device until a hook loads it for a forward) decodes in the loop exactly as its own generate."""
    pytest.importorskip("accelerate")
    _llama().save_pretrained(tmp_path / "model")
    kw = ({"device_map": "cpu"} if device_map == "cpu" else
          {"device_map": "auto", "max_memory": {"cpu": "10KB"}, "offload_folder": str(tmp_path / "offload")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _finish(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model", **kw))
    if device_map == "disk":
        assert set(model.hf_device_map.values()) == {"disk"}
    ids, mask = _prompts(2)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=False)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref) and not _fallbacks(messages) and stats(model).steps >= 1


# ------------------------------------------------------------------------------------ 6. drafter output

class _BadDrafter(Drafter):
    def __init__(self, tokens, parents, count=None):
        self.tokens, self.parents, self.count = tokens, parents, count

    def propose(self, contexts, budget):
        n = len(contexts) if self.count is None else self.count
        return [Tree(self.tokens, self.parents, validate=False) for _ in range(n)]


@pytest.mark.parametrize("drafter, match", [
    (_BadDrafter([5, V], [-1, 0]), rf"drafter _BadDrafter: proposed token id\(s\) \[{V}\] for request 0; "
                                   rf"expected ids in \[0, {V}\)"),
    (_BadDrafter([5, -2], [-1, 0]), r"proposed token id\(s\) \[-2\]"),
    (_BadDrafter([5, 6], [-1, 1]), r"drafter _BadDrafter: request 0's tree gives node 1 the parent 1"),
    (_BadDrafter([5, 6], [-1, 0], count=3), r"must return 1 fastverify.tree.Tree .* got 3 items"),
])
def test_bad_drafter_output_names_the_drafter(drafter, match):
    model = _llama()
    ids, mask = _prompts(1)
    patch(model, drafter=drafter)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4)


def test_a_drafter_made_for_a_model_of_another_width_is_refused():
    """Drafters that read the target's hidden state are made for one model (its output projection, its width): a
    HeadsDrafter made for a model of hidden size 64, patched onto one of 96, raises naming the drafter and both
    widths before the first step (before, an einsum's shape error deep in the heads). One made for a model of the
    same width drafts (the output is the target's own, as for any drafter)."""
    from fastverify.heads import ProposalHeads
    from fastverify.hf.bpd import HeadsDrafter
    drafter = HeadsDrafter(_llama(), ProposalHeads(COMMON["hidden_size"], 3))
    ids, mask = _prompts(1)
    wide, deep = _llama(hidden_size=96), _llama(num_hidden_layers=3)
    patch(wide, drafter=drafter)
    with pytest.raises(ValueError, match="drafter: HeadsDrafter reads hidden states of width 64, and this model's "
                                         "output projection takes 96"):
        wide.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8)
    want = deep.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8)
    patch(deep, drafter=drafter)
    out, messages = _run(deep, ids, mask, max_new_tokens=8)
    assert torch.equal(out, want) and not _fallbacks(messages)


@pytest.mark.parametrize("draft_vocab", [V // 2, 2 * V])
def test_a_draft_model_of_another_vocabulary_is_refused(draft_vocab):
    """A draft model must read the target's token ids and propose ids of its vocabulary: one of another vocabulary
    size is refused by ``patch`` (before: an IndexError in the draft's embedding for a smaller one, an error naming
    the proposed ids mid-call for a larger one), and as ``assistant_model`` the call falls back to generate, whose
    own error follows (it asks for both tokenizers)."""
    model, small = _llama(), _llama(vocab_size=draft_vocab, num_hidden_layers=1)
    with pytest.raises(ValueError, match=f"drafter: the draft model's vocabulary has {draft_vocab} token ids and "
                                         f"the model's {V}"):
        patch(model, drafter=DraftModelDrafter(small))
    assert not is_patched(model)
    ids, mask = _prompts(1)
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="different tokenizers"):
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, assistant_model=small)
    assert any("assistant_model: the draft model's vocabulary" in str(w.message) for w in record)


def test_drafter_returning_no_tree():
    class NotATree(Drafter):
        def propose(self, contexts, budget):
            return [[1, 2] for _ in contexts]
    model = _llama()
    patch(model, drafter=NotATree())
    with pytest.raises(TypeError, match="drafter NotATree: propose.. returned list for request 0"):
        model.generate(_prompts(1)[0], max_new_tokens=4, pad_token_id=PAD)


# ------------------------------------------------------------------------------------ 7. options at patch()

@pytest.mark.parametrize("rule, opts, match", [
    ("topk", {}, "k"), ("typical", {}, "eps"), ("gad", {"beta": 3}, "tau"), ("gad", {"tau": 1.0}, "beta"),
    ("distance", {}, "eps"), ("confidence", {}, "beta"), ("topk", {"k": 0}, "k"), ("confidence", {"beta": 2.0}, "beta"),
    ("greedy", {"k": 2}, "k: not a parameter of rule 'greedy'"), (None, {"tau": 1.0}, "tau: not a parameter"),
    ("coupled", {"min_accept": 2}, "min_accept"),
])
def test_rule_options_checked_at_patch(rule, opts, match):
    model = _llama()
    with pytest.raises(ValueError, match=match):
        patch(model, rule=rule, **opts)
    assert not is_patched(model)


# ------------------------------------------------------------------------------------ 8. docs of lossy rules

def test_lossy_rules_documented():
    import os
    from fastverify.hf.patch import LOSSY_RULES
    doc = fastverify.patch.__doc__
    assert all(f'"{r}"' in doc for r in LOSSY_RULES) and "CHANGE the output" in doc
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        readme = f.read()
    assert "change the output" in readme and all(f"`{r}`" in readme for r in LOSSY_RULES)


def test_processor_values_generate_refuses_fall_back_to_its_error():
    """Values generate's own processors refuse (a bad word or a biased / forced token outside the vocabulary, an
    empty list, a non-float penalty or bias, a fractional n-gram size or minimum length) reach generate, whose error
    names them; the loop runs none of them. A size <= 0 is no processor there, and none here."""
    model = _llama()
    ids, mask = _prompts(1)
    patch(model)
    for kw in ({"bad_words_ids": [[V + 5]]}, {"bad_words_ids": []}, {"repetition_penalty": 2},
               {"no_repeat_ngram_size": 2.5}, {"sequence_bias": {(3, V + 1): 1.0}}, {"sequence_bias": [[[3], 1]]},
               {"sequence_bias": {}}, {"forced_eos_token_id": V + 2}, {"min_new_tokens": 3.0, "eos_token_id": 5},
               {"min_length": 31.5, "eos_token_id": 5}):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with pytest.raises((ValueError, IndexError)):  # (a forced token outside: its IndexError)
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, **kw)
        assert any(next(iter(kw)) in str(w.message) for w in record if "falling back" in str(w.message)), kw
    ref = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6)
    out, messages = _run(model, ids, mask, max_new_tokens=6, no_repeat_ngram_size=-1)
    assert torch.equal(out, ref) and not _fallbacks(messages)


def test_sampling_values_generate_refuses_fall_back_to_its_error():
    """Sampling with a value generate's warpers refuse (temperature 0, which the verify op would have taken for
    greedy decoding; top_p, top_k or min_p out of range) reaches generate, whose error names it. top_p 0, which
    generate takes (its one token to keep, the most probable), runs in the loop: the greedy output; top_p above 1,
    which generate ignores, too."""
    model = _llama()
    ids, mask = _prompts(2)
    patch(model)
    for kw in ({"temperature": 0.0}, {"temperature": -0.5}, {"top_p": -0.5}, {"top_k": -3}, {"min_p": 2.0}):
        with pytest.raises(ValueError):  # generate's own
            _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, do_sample=True, **kw)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with pytest.raises(ValueError):
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, do_sample=True, **kw)
        assert any("warper" in str(w.message) for w in record if "falling back" in str(w.message)), kw
    ref = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False)
    for seed in (1, 2):
        out, messages = _run(model, ids, mask, max_new_tokens=8, do_sample=True, top_p=0.0, seed=seed)
        assert torch.equal(out, ref) and not _fallbacks(messages) and stats(model).steps >= 1
    ref, _ = _run(model, ids, mask, max_new_tokens=8, do_sample=True, top_p=1.0, seed=3)
    out, messages = _run(model, ids, mask, max_new_tokens=8, do_sample=True, top_p=1.5, seed=3)
    assert torch.equal(out, ref) and not _fallbacks(messages)


def test_an_empty_eos_list_without_a_pad_token_falls_back_to_generates_error():
    """eos_token_id=[] with no pad_token_id: generate takes the first eos id as its pad and raises an IndexError
    (transformers 5.17-5.24); the patched generate falls back, so its caller sees that error, not an output plain
    generate never gives. With a pad_token_id, an empty eos list decodes in the loop as in generate (nothing ends a
    row)."""
    model = _llama()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    ids, mask = _prompts(1)
    with pytest.raises(IndexError):
        _llama().generate(ids, attention_mask=mask, eos_token_id=[], max_new_tokens=4, do_sample=False)
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(IndexError):
            model.generate(ids, attention_mask=mask, eos_token_id=[], max_new_tokens=4, do_sample=False)
    assert any("eos_token_id=[] without a pad_token_id" in m for m in _fallbacks([str(w.message) for w in record]))
    ids, mask = _prompts(2)
    ref = _llama().generate(ids, attention_mask=mask, eos_token_id=[], pad_token_id=PAD, max_new_tokens=8)
    out, messages = _run(model, ids, mask, eos_token_id=[], max_new_tokens=8)
    assert torch.equal(out, ref) and not _fallbacks(messages)


def test_an_empty_eos_list_pads_a_row_a_stop_string_ended():
    """eos_token_id=[] is no eos id, yet generate holds an eos criterion for it (it tests the field against None),
    and with one it pads a row that a stop string or a stopping criterion ended, where without one (eos_token_id
    None) the row runs on. The loop ran it on (the fuzz's seed 200698: another output from the stopped row's next
    token)."""
    model, tok = _llama(), _word_tokenizer()
    model.generation_config.eos_token_id = None
    ids, mask = _prompts(2)
    kw = dict(max_new_tokens=10, stop_strings=["w101"], tokenizer=tok)
    padded = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, eos_token_id=[], **kw)
    ran_on = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
    L = ids.shape[1]
    assert padded.shape == ran_on.shape and not torch.equal(padded, ran_on)
    assert 101 in padded[0, L:].tolist() and padded[0, -1] == PAD and padded[1, -1] != PAD
    patch(model)
    for eos, want in (([], padded), (None, ran_on)):
        out, messages = _run(model, ids, mask, eos_token_id=eos, **kw)
        assert torch.equal(out, want) and not _fallbacks(messages), eos


def test_counts_set_to_none_fall_back_to_generates_error():
    """num_beams=None / num_return_sequences=None in the call: generate's max() of the two raises a TypeError; the
    loop read None as 1 and decoded."""
    model = _llama()
    ids, mask = _prompts(2)
    patch(model)
    for name in ("num_beams", "num_return_sequences"):
        with pytest.raises(TypeError):
            _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, **{name: None})
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with pytest.raises(TypeError):
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, **{name: None})
        assert any(f"{name}=None" in m for m in _fallbacks([str(w.message) for w in record]))


@pytest.mark.parametrize("B, kw", [
    (2, {"bos_token_id": ""}), (2, {"decoder_start_token_id": ""}), (2, {"forced_eos_token_id": True}),
    (2, {"no_repeat_ngram_size": True}), (2, {"penalty_alpha": ""}), (2, {"top_k": []}),
    (2, {"prefill_chunk_size": 0}), (2, {"prefill_chunk_size": 0.5}), (1, {"prompt_lookup_num_tokens": 0}),
    (1, {"prompt_lookup_num_tokens": 0.5}), (1, {"prompt_lookup_num_tokens": ""}),
    (2, {"do_sample": True, "top_k": True}), (2, {"do_sample": True, "num_return_sequences": -1}),
    (2, {"do_sample": True, "num_return_sequences": 0.5}),
], ids=lambda x: str(x) if isinstance(x, dict) else None)
def test_a_value_generate_reads_otherwise_is_read_as_generate_reads_it(B, kw):
    """Values found by setting each generation-config field in turn to 0, False, "", [], 1, True, -1, 0.5 and 2 and
    comparing the patched call with generate's (tiny Llama, batch 1 and 2, greedy and sampled; transformers 5.17 and
    5.24): where generate raises (a generation mode that compares a string, a token id that is no number, a bool
    as top_k or n-gram size, a prompt lookup size it refuses, a prefill chunk size that is no positive int), the
    patched call falls back to that error; where generate decodes (num_return_sequences below 1: its expand size
    is max(1, n)), the loop decodes one sequence per prompt. Before, each of these decoded where generate raised,
    or raised where it decoded. Sampled calls are compared by their errors and shapes (the loop's sampler is its
    own)."""
    model = _llama()
    ids, mask = _prompts(B)
    try:
        want, raised = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6, **kw), None
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        want, raised = None, type(e)
    patch(model)
    if raised is not None:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with pytest.raises(raised):
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6, **kw)
        assert _fallbacks([str(w.message) for w in record])
    else:
        out, messages = _run(model, ids, mask, max_new_tokens=6, **kw)
        assert out.shape == want.shape and (kw.get("do_sample") or torch.equal(out, want))


@pytest.mark.parametrize("kw", [
    {"logits_processor": 0}, {"stopping_criteria": False}, {"inputs_embeds": []}, {"past_key_values": ()},
    {"logits_to_keep": None}, {"return_dict": None},
], ids=str)
def test_an_argument_generate_refuses_falls_back_to_its_error(kw):
    """generate's arguments at values it refuses (hf_option_sweep.py's second part): falsy ones were read as not
    given, and the loop decoded. An empty list of processors or criteria is a list (nothing to run: the loop runs),
    and None model inputs generate takes as such (position_ids, token_type_ids) are left out."""
    model = _llama()
    ids, mask = _prompts(2)
    with pytest.raises(Exception) as plain:
        _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, **kw)
    patch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(plain.type):
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, **kw)
    assert _fallbacks([str(w.message) for w in record])
    want = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4)
    for ok in ({"logits_processor": transformers.LogitsProcessorList()}, {"stopping_criteria": []},
               {"position_ids": None}, {"token_type_ids": None}):
        out, messages = _run(model, ids, mask, max_new_tokens=4, **ok)
        assert torch.equal(out, want) and not _fallbacks(messages), ok


@contextlib.contextmanager
def said():
    """Collects what the code inside says into the list it yields: its warnings other than fastverify's, then
    transformers' log lines; transformers' once-only warnings forgotten first, so that each call may give them."""
    logging.Logger.warning_once.cache_clear()  # (transformers' lru_cache on the Logger class)
    log, lines = io.StringIO(), []
    handler = logging.StreamHandler(log)
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            yield lines
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        lines += [str(w.message) for w in record if "fastverify" not in str(w.message)] + log.getvalue().splitlines()


@pytest.mark.parametrize("B, kw", [
    (1, {"max_length": 40, "max_new_tokens": 5}), (1, {"min_length": 40, "min_new_tokens": 2, "max_new_tokens": 6}),
    (1, {}), (1, {"min_length": 60, "max_length": 40}), (1, {"min_new_tokens": 20, "max_length": 36}),
    (2, {"max_new_tokens": 6, "mask": False}), (2, {"max_new_tokens": 6, "mask": False, "pad_token_id": None}),
    (2, {"max_new_tokens": 6, "mask": False, "ends_in_pad": True}), (1, {"max_new_tokens": 6, "eos_token_id": -1}),
    (1, {"max_new_tokens": 228}), (2, {"max_new_tokens": 6, "quiet": True}),
    (1, {"max_new_tokens": 227, "quiet": True}),
], ids=lambda x: str(x) if isinstance(x, dict) else None)
def test_a_call_the_loop_runs_gives_generates_warnings(B, kw):
    """The warnings generate gives as it prepares a call (transformers' own methods: both max_new_tokens and
    max_length set, the default length, minimums past the maximum, a batch without attention mask whose pad is its
    eos, a negative eos; generate's right-padding check on the last tokens; its length criterion's reminder where
    the sequence runs past max_position_embeddings, 256 here: 30 + 228 tokens, and not at 30 + 227, where that
    length ends the call) come from the patched call too, once, with the same output. Before, a call the loop ran
    gave none of them."""
    kw = dict(kw)
    quiet = kw.pop("quiet", False)
    ids, mask = _prompts(B)
    if kw.pop("ends_in_pad", False):  # a row ending in the pad token, which is an eos: no padding to infer
        ids[0, -1] = 7
    call = {"input_ids": ids, "do_sample": False, "eos_token_id": 7, "pad_token_id": 7, **kw}
    if call.pop("mask", True):
        call["attention_mask"] = mask
    with said() as wanted:
        want = _llama().generate(**call)
    assert bool(wanted) != quiet
    model = _llama()
    patch(model)
    with said() as got:
        out = model.generate(**call)
    assert stats(model) is not None, "the loop ran the call"
    assert torch.equal(out, want)
    assert got == wanted


def test_pad_token_outside_the_vocabulary():
    """pad_token_id outside the vocabulary (-1, or past it) runs as in generate, which never feeds it to the model
    while no row has ended: the loop's rows of a request that reached max_new_tokens before the others feed the
    request's last token instead (they are never read)."""
    model = _llama()
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([_prompts(1, L=24)[0], torch.randint(3, V, (2, 24), generator=g)])  # one row drafts well
    mask = torch.ones_like(ids)
    for pad in (-1, V + 7):
        ref = _llama().generate(ids, attention_mask=mask, pad_token_id=pad, max_new_tokens=16, do_sample=False)
        patch(model, pace_batch=False)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model.generate(ids, attention_mask=mask, pad_token_id=pad, max_new_tokens=16, do_sample=False)
        st = stats(model)
        assert torch.equal(out, ref) and not _fallbacks([str(w.message) for w in record])
        # the repetitive row ended before the others, which ran on with its rows in the batch
        assert any(a[0] is None for a in st.accepted), st.accepted


def test_input_ids_outside_the_vocabulary_raise_naming_them():
    model = _llama()
    ids, mask = _prompts(2)
    patch(model)
    for bad in (V, V + 100, -1):
        ids_bad = ids.clone()
        ids_bad[1, -2] = bad
        with pytest.raises(ValueError, match=rf"input_ids: token ids must lie in \[0, {V}\).*got {bad} at \[1, "):
            model.generate(ids_bad, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4)
    # ids of a float or bool dtype: refused, a one-token prompt too (its one token reaches no embedding as it is)
    for prompt in (ids, ids[:, -1:]):
        for dtype in (torch.float32, torch.bool):
            with pytest.raises(TypeError, match=f"input_ids: expected an integer tensor of token ids, got dtype "
                                                f"{dtype}"):
                model.generate(prompt.to(dtype), pad_token_id=PAD, max_new_tokens=4)


def test_forced_eos_every_token_suppressed_gives_token_0():
    """forced_eos_token_id whose tokens begin_suppress_tokens all bans on the only new token: every score is -inf
    on that row, and generate's greedy argmax picks token 0; so does the loop (a row the processors leave all -inf,
    the model's own row finite). With a second new token the forced row is not the first one."""
    model = _llama()
    ids, mask = _prompts(1)
    kw = {"forced_eos_token_id": [7, 9], "begin_suppress_tokens": [7, 9]}
    for new in (1, 3):
        ref = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=new, **kw)
        patch(model)
        out, messages = _run(model, ids, mask, max_new_tokens=new, **kw)
        assert torch.equal(out, ref) and not _fallbacks(messages) and stats(model).steps >= 1
    assert int(ref[0, -1]) in (7, 9) and int(_llama().generate(ids, attention_mask=mask, pad_token_id=PAD,
                                                               max_new_tokens=1, **kw)[0, -1]) == 0


# ------------------------------------------------------------------------------------ 10. stop_strings

def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(V)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w1")


def test_stop_strings_run_in_the_loop_and_need_the_tokenizer():
    model = _llama()
    tok = _word_tokenizer()
    ids, mask = _prompts(1)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, stop_strings=["w9"],
                         tokenizer=tok)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=8, stop_strings=["w9"], tokenizer=tok)
    assert torch.equal(out, ref) and not _fallbacks(messages) and fastverify.hf.stats(model) is not None
    # without the tokenizer: the original generate, whose own error names what is missing
    with pytest.raises(ValueError, match="tokenizer"):
        _run(model, ids, mask, max_new_tokens=8, stop_strings=["w9"])
    # the tokenizer alone asks for nothing the loop does not do
    out, messages = _run(model, ids, mask, max_new_tokens=8, tokenizer=tok)
    assert not _fallbacks(messages)


class _AfterScores(transformers.StoppingCriteria):
    """Ends every row once ``scores`` (generate's tuple of the scores so far, or None) holds ``n`` steps."""

    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), scores is not None and len(scores) >= self.n, dtype=torch.bool)


@pytest.mark.parametrize("B", [1, 2])
def test_a_criterion_with_output_scores_falls_back(B):
    """With return_dict_in_generate and output_scores, generate hands each stopping criterion the scores so far (a
    tuple, one [B, V] tensor per step; None without them); the loop asked its criteria with None, so a criterion
    reading them ended nothing (16 new tokens where generate gave 5). Falls back; without output_scores the loop
    runs it (None both ways)."""
    model = _llama()
    ids, mask = _prompts(B)
    kw = dict(max_new_tokens=16, eos_token_id=None, stopping_criteria=[_AfterScores(5)])
    want = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, return_dict_in_generate=True,
                             output_scores=True, **kw)
    assert want.sequences.shape[1] == ids.shape[1] + 5
    patch(model)
    out, messages = _run(model, ids, mask, return_dict_in_generate=True, output_scores=True, **kw)
    assert torch.equal(out.sequences, want.sequences)
    assert any("stopping_criteria with output_scores" in m for m in _fallbacks(messages))
    want = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
    out, messages = _run(model, ids, mask, **kw)
    assert torch.equal(out, want) and out.shape[1] == ids.shape[1] + 16 and not _fallbacks(messages)


def test_an_empty_stop_string_ends_rows_as_in_generate():
    """stop_strings="" is set (generate tests ``is not None``): an empty string matches at every token, so generate
    ends each row at its first new token; the loop did so too only for [""] and decoded on for "" (8 tokens where
    generate gave 1). An empty list, which generate's criteria refuse, falls back to that error."""
    model, tok = _llama(), _word_tokenizer()
    ids, mask = _prompts(2)
    patch(model)
    for stop in ("", [""], ["w9", ""]):
        ref = _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, stop_strings=stop,
                                tokenizer=tok)
        out, messages = _run(model, ids, mask, max_new_tokens=8, stop_strings=stop, tokenizer=tok)
        assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 1 and not _fallbacks(messages), stop
    with pytest.raises(ValueError, match="unable to identify tokens"):
        _llama().generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, stop_strings=[], tokenizer=tok)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="unable to identify tokens"):
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, stop_strings=[], tokenizer=tok)
    assert any("stop_strings=[]" in m for m in _fallbacks([str(w.message) for w in record]))


# ------------------------------------------------------------------------------------ 11. threads

class _Meanwhile(transformers.StoppingCriteria):
    """At its first call (the first token committed) starts ``other`` on a thread and waits up to ``seconds`` for
    it to end; records whether it had."""

    def __init__(self, other, seconds):
        self.other, self.seconds, self.thread, self.ended_meanwhile = other, seconds, None, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.thread is None:
            self.thread = threading.Thread(target=self.other)
            self.thread.start()
            self.thread.join(self.seconds)
            self.ended_meanwhile = not self.thread.is_alive()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("second_kw", [{}, {"num_beams": 2}], ids=["loop", "fallback"])
def test_a_second_thread_waits_for_the_first_threads_call(second_kw):
    """The loop's contexts rebind the model's own modules for a call's duration, so a second thread's patched call
    on the same model waits for the first to end (``hf.linear.model_lock``; on SmolLM2, three threads at once
    crashed in the decoder stack before: a layer run twice, its cache appended twice), a call that falls back to
    the original generate too (it would run through the rebound modules), and both give generate's output. Without
    the wait, the second call (a tiny model's 12 tokens) ends well within the 2 s given it."""
    model = _llama()
    a, mask_a = _prompts(1)
    b, mask_b = _prompts(2, seed=1)
    want_a = model.generate(a, attention_mask=mask_a, pad_token_id=PAD, max_new_tokens=12)
    want_b = model.generate(b, attention_mask=mask_b, pad_token_id=PAD, max_new_tokens=12, **second_kw)
    patch(model)
    got = {}

    def second():  # (the fallback's warning is left to pytest: catch_warnings is not thread-safe)
        got["b"] = model.generate(b, attention_mask=mask_b, pad_token_id=PAD, max_new_tokens=12, **second_kw)

    meanwhile = _Meanwhile(second, seconds=2.0)
    got["a"] = model.generate(a, attention_mask=mask_a, pad_token_id=PAD, max_new_tokens=12,
                              stopping_criteria=transformers.StoppingCriteriaList([meanwhile]))
    meanwhile.thread.join()
    assert meanwhile.ended_meanwhile is False
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)


def test_another_threads_forward_meanwhile_is_its_own():
    """While a batch call's forward runs (its live rows set: the padding rows skipped in the layers and the output
    projection, ``LiveRows`` and the loop's hooks on the projection), a plain forward of the model on another
    thread with as many rows computes every row as it would outside the call, and the call's output is generate's:
    what the loop sets is its thread's. The other forward runs in a hook on the output projection, after its
    input's live rows were gathered and before its output is laid out again."""
    model = _llama()
    ids, mask = _prompts(2)  # left padded: the first step's forward skips the padding rows
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
    patch(model, row_hooks=True)  # (the test's hooks read shapes and start the other forward)
    seen, main = {"total": 0}, threading.get_ident()

    def meanwhile(module, args, output):  # registered before the loop's own hooks: runs before its scatter
        rows = output.shape[0] * output.shape[1]
        if threading.get_ident() != main or "x" in seen or rows == seen["total"]:
            return None  # (the first forward whose live rows were gathered)
        seen["x"] = torch.randint(3, V, (1, seen["total"]), generator=torch.Generator().manual_seed(1))

        def plain():
            with torch.no_grad():
                seen["logits"] = model(seen["x"]).logits

        thread = threading.Thread(target=plain)
        thread.start()
        thread.join()
        return None

    def rows(module, args):  # the forward's [B, q] rows, before the loop gathers the live ones
        if threading.get_ident() == main:
            seen["total"] = args[0].shape[0] * args[0].shape[1]

    handles = [model.lm_head.register_forward_hook(meanwhile), model.lm_head.register_forward_pre_hook(rows)]
    try:
        out, _ = _run(model, ids, mask, max_new_tokens=16)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(out, want) and "x" in seen
    with torch.no_grad():
        ref = model(seen["x"]).logits
    torch.testing.assert_close(seen["logits"], ref, rtol=1e-4, atol=1e-4)


def test_the_hidden_state_kept_for_drafters_is_from_the_calls_thread():
    """The final hidden state the loop keeps for drafters that read it (``_HiddenCapture``) is its own thread's
    latest forward's, never another thread's forward of the model meanwhile."""
    from fastverify.hf.loop import _HiddenCapture
    model = _llama()
    capture = _HiddenCapture(model)
    try:
        with torch.no_grad():
            thread = threading.Thread(target=lambda: model(torch.tensor([[5, 6, 7, 8]])))
            thread.start()
            thread.join()
            assert capture.value is None
            model(torch.tensor([[5, 6, 7]]))
        assert capture.value.shape[:2] == (1, 3)
    finally:
        capture.close()


def test_a_draft_model_that_another_threads_loop_holds_is_left_as_it_is():
    """A ``DraftModelDrafter`` binds its draft model's layers (skinny linears) for its own forwards; where another
    thread's loop holds that model (it decodes with it as its target), the drafter runs the model as bound by that
    loop instead, never binding or restoring it under the other call."""
    from fastverify.hf.linear import model_lock
    target, small = _llama(), _llama(num_hidden_layers=1)
    ids, mask = _prompts(1)
    want = target.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=10)
    drafter = DraftModelDrafter(small, k=3)
    bound, propose = [], drafter._propose

    def seen(contexts, budget):  # whether the draft model's linears run the drafter's bound forward
        bound.append(all("forward" in m.__dict__ for m in small.modules() if type(m) is torch.nn.Linear))
        return propose(contexts, budget)

    drafter._propose = seen
    patch(target, drafter=drafter)
    held, release = threading.Event(), threading.Event()

    def other_loop():  # stands for another thread's loop over the draft model
        with model_lock(small):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=other_loop)
    thread.start()
    held.wait(30)
    try:
        out, _ = _run(target, ids, mask, max_new_tokens=10)
    finally:
        release.set()
        thread.join()
    assert torch.equal(out, want) and bound and not any(bound)
    bound.clear()
    out, _ = _run(target, ids, mask, max_new_tokens=10)
    assert torch.equal(out, want) and bound and all(bound)


class _SlowNGram(NGramDrafter):
    """An n-gram drafter that records which thread each of its calls came from and sleeps in each proposal (so
    that two calls at once would interleave)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def reset(self, batch_size):
        self.events.append(("reset", threading.get_ident()))
        super().reset(batch_size)

    def propose(self, contexts, budget):
        self.events.append(("propose", threading.get_ident()))
        time.sleep(0.002)
        return super().propose(contexts, budget)


def test_two_models_patched_with_one_drafter_decode_one_at_a_time():
    """A drafter keeps a call's requests between its steps (reset, then propose / update per step): two models
    patched with the same drafter, called from two threads at once, take turns with it (``decode`` holds the
    drafter's lock as the model's). Before, the calls interleaved on it (a shared DraftModelDrafter: an IndexError
    in one of them)."""
    m1, m2 = _llama(), _llama(num_hidden_layers=3)
    a, mask_a = _prompts(1)
    b, mask_b = _prompts(3, seed=1)
    want_a = m1.generate(a, attention_mask=mask_a, pad_token_id=PAD, max_new_tokens=24)
    want_b = m2.generate(b, attention_mask=mask_b, pad_token_id=PAD, max_new_tokens=24)
    drafter = _SlowNGram()
    patch(m1, drafter=drafter)
    patch(m2, drafter=drafter)
    got = {}

    def call(key, model, ids, mask):
        got[key] = [model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=24) for _ in range(2)]

    threads = [threading.Thread(target=call, args=("a", m1, a, mask_a)),
               threading.Thread(target=call, args=("b", m2, b, mask_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(out, want_a) for out in got["a"]) and all(torch.equal(out, want_b) for out in got["b"])
    calls = []  # each call's events: a reset, then its proposals, all from the reset's thread
    for kind, thread in drafter.events:
        if kind == "reset":
            calls.append([])
        calls[-1].append(thread)
    assert len(calls) == 4 and len({t for c in calls for t in c}) == 2 and all(len(set(c)) == 1 for c in calls)


def test_the_lock_of_an_unhashable_drafter_is_its_own_and_leaves_with_it():
    """A drafter that cannot be a weak dictionary's key (a dataclass compares by value, so has no hash) gets its lock
    by id: the same lock while it lives, and the entry leaves with it, so an object that later takes its id gets a
    lock of its own (before, the lock stayed for the process)."""
    import dataclasses
    import gc
    from fastverify.hf import linear

    @dataclasses.dataclass
    class Unhashable(NGramDrafter):
        k: int = 4

    drafter = Unhashable()
    lock = linear.model_lock(drafter)
    assert linear.model_lock(drafter) is lock and linear.model_lock(Unhashable()) is not lock
    key = id(drafter)
    assert linear._UNHASHABLE_LOCKS[key] is lock
    del drafter
    gc.collect()
    assert key not in linear._UNHASHABLE_LOCKS


# ------------------------------------------------------------------------------------ 12. training mode

def _typed(model_type, **kw):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **dict(COMMON, **kw))
    return _finish(transformers.AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize("model_type, config, named", [
    ("llama", {"attention_dropout": 0.3}, "model.layers.0.self_attn (attention_dropout=0.3)"),
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.2, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     "transformer.h.0.attn.resid_dropout (Dropout(p=0.2))"),
    ("mixtral", {"num_local_experts": 4, "router_jitter_noise": 0.5}, "(jitter_noise=0.5)"),
])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_a_model_in_training_mode_that_draws_at_random_falls_back(model_type, config, named, sampling):
    """A model in training mode whose forward draws at random (dropout, a router's jitter): plain generate applies
    them with torch's generator, which drafted forwards (more rows, other steps) cannot follow; the patched call
    falls back, naming the module and what it draws, and gives generate's output under the same seed. Before, the
    loop decoded it (a Llama of attention dropout 0.5: another output, silently)."""
    model = _typed(model_type, **config).train()
    ids, mask = _prompts(1)
    kw = dict(max_new_tokens=12, do_sample=sampling)
    torch.manual_seed(5)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)
    patch(model)
    torch.manual_seed(5)
    out, messages = _run(model, ids, mask, **kw)
    assert torch.equal(out, want)
    [message] = _fallbacks(messages)
    assert "training mode" in message and named in message and "model.eval()" in message
    model.eval()  # in eval mode its dropouts and jitter draw nothing: the loop runs
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
    out, messages = _run(model, ids, mask, max_new_tokens=12)
    assert torch.equal(out, want) and not _fallbacks(messages)


def test_training_mode_that_draws_nothing_runs_the_loop():
    """Training mode with every dropout 0 computes as eval mode does: the loop runs it, exact."""
    model = _llama().train()
    ids, mask = _prompts(2)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=12)
    assert torch.equal(out, want) and not _fallbacks(messages)


def test_one_layer_in_training_mode_falls_back():
    """A model in eval mode with one layer in training mode draws at random in that layer: found there too."""
    model = _llama(attention_dropout=0.3)
    model.model.layers[1].train()
    ids, mask = _prompts(1)
    patch(model)
    torch.manual_seed(5)
    out, messages = _run(model, ids, mask, max_new_tokens=12)
    [message] = _fallbacks(messages)
    assert "model.layers.1.self_attn (attention_dropout=0.3)" in message
    unpatch(model)
    torch.manual_seed(5)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12))


# ------------------------------------------------------------------------------------ 13. forward hooks

def _last_row_hook(v):
    """A forward hook adding ``v`` to a layer's last row only (a steering vector at the newest position)."""
    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h = h.clone()
        h[:, -1] += v
        return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h
    return hook


def _every_row_hook(v):
    def hook(module, args, output):
        return (output[0] + v,) + tuple(output[1:]) if isinstance(output, tuple) else output + v
    return hook


def test_a_forward_hook_falls_back_unless_declared_row_wise():
    """A hook sees the loop's forwards, whose rows are a request's draft tokens after its committed ones: one that
    picks a row by position (the last) acts on another token than in generate. Before, the loop ran it and gave
    another output, silently; now the call falls back, naming the module, unless ``row_hooks=True`` declares every
    hook row-wise (a row-wise hook then gives generate's output through the loop)."""
    model = _llama()
    ids, mask = _prompts(2)
    v = torch.randn(COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
    for make in (_last_row_hook, _every_row_hook):
        handle = model.model.layers[0].register_forward_hook(make(v))
        want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
        patch(model)
        out, messages = _run(model, ids, mask, max_new_tokens=16)
        assert torch.equal(out, want)
        [message] = _fallbacks(messages)
        assert "a forward hook on model.layers.0:" in message and "row_hooks=True" in message
        patch(model, row_hooks=True)
        out, messages = _run(model, ids, mask, max_new_tokens=16)
        assert not _fallbacks(messages) and stats(model).steps > 0
        assert torch.equal(out, want) == (make is _every_row_hook)  # the declaration is the caller's
        unpatch(model)
        handle.remove()


def test_a_global_hook_falls_back_and_transformers_own_hooks_do_not():
    """A global module hook (``torch.nn.modules.module.register_module_forward_hook``) sees every module's call: a
    fallback too. transformers' output-capturing hooks, installed for good by a call that asks for hidden states,
    record nothing unless a forward asks, and ``enable_input_require_grads``'s hook changes no value: the loop
    runs."""
    from torch.nn.modules.module import register_module_forward_hook
    model = _llama()
    ids, mask = _prompts(1)
    with torch.no_grad():
        model(ids, output_hidden_states=True, output_attentions=True)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
    model.enable_input_require_grads()  # (its hook on the input embedding changes no value)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=12)
    assert torch.equal(out, want) and not _fallbacks(messages)
    handle = register_module_forward_hook(lambda module, args, output: None)
    try:
        out, messages = _run(model, ids, mask, max_new_tokens=12)
    finally:
        handle.remove()
    [message] = _fallbacks(messages)
    assert torch.equal(out, want) and "global module hook" in message


# ------------------------------------------------------------------------------------ 14. code of one's own

class _CausalAttention(torch.nn.Module):
    """A user's attention for a Llama layer: causal SDPA over the cache, ignoring the 4D mask it is handed (right
    for one chain of rows, wrong for a tree's siblings)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        a, (B, S, _) = self.inner, hidden_states.shape
        q, k, v = (p(hidden_states).view(B, S, -1, a.head_dim).transpose(1, 2)
                   for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        cache = past_key_values if past_key_values is not None else kw.get("cache")
        if cache is not None:
            k, v = cache.update(k, v, a.layer_idx)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        causal = torch.ones(S, k.shape[2], dtype=torch.bool).tril(k.shape[2] - S)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return a.o_proj(out.transpose(1, 2).reshape(B, S, -1)), None


class _ScaledLinear(torch.nn.Module):
    """A user's row-wise wrapper of a linear layer (as an adapter library's layers are)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.5


def test_module_classes_of_ones_own_are_checked_first():
    """A registered type vouches for transformers' classes of it only. A model holding module classes from
    elsewhere (a user's attention, an adapter library's layers, remote code) is checked as an unregistered type is,
    once per set of such classes (``fastverify.hf.probe``): an attention that ignores the loop's 4D mask fails it
    and the call falls back, naming the class; a row-wise wrapper passes it and the loop runs. Before, the loop ran
    the mask-ignoring attention and gave another output, silently (with a self-drafting tree drafter)."""
    from fastverify.hf.linear import modules
    from fastverify.hf.patch import _foreign_code
    model = _llama()
    assert _foreign_code(modules(model)) == ()
    ids, mask = _prompts(2)
    for layer in model.model.layers:
        layer.mlp.down_proj = _ScaledLinear(layer.mlp.down_proj)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
    patch(model, drafter=DraftModelDrafter(copy.deepcopy(model), k=4, tree_topk=3))
    out, messages = _run(model, ids, mask, max_new_tokens=16)
    assert torch.equal(out, want) and not _fallbacks(messages) and stats(model).accepted_tokens > 0
    state = model._fastverify_patch
    assert [key[1] for key in state.checks] == [(f"{__name__}._ScaledLinear",)]
    _run(model, ids, mask, max_new_tokens=16)
    assert len(state.checks) == 1  # the verdict kept
    for layer in model.model.layers:
        layer.self_attn = _CausalAttention(layer.self_attn)
    unpatch(model)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
    patch(model, drafter=DraftModelDrafter(copy.deepcopy(model), k=4, tree_topk=3))
    out, messages = _run(model, ids, mask, max_new_tokens=16)
    [message] = _fallbacks(messages)
    assert torch.equal(out, want)
    assert f"running code from outside transformers ({__name__}._CausalAttention, {__name__}._ScaledLinear)" in \
        message and "failed the loop's check" in message


def _causal_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
    """``_CausalAttention``'s forward, bound over a LlamaAttention's own (as long-context patches replace it)."""
    return _CausalAttention.forward(types.SimpleNamespace(inner=self), hidden_states, position_embeddings,
                                    attention_mask, past_key_values, **kw)


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_forward_bound_over_transformers_own_is_checked_first(where, monkeypatch):
    """A transformers class whose ``forward`` is replaced (as long-context patches replace an attention's), or an
    instance given a forward of its own, runs code the registration does not vouch for: checked first, as classes
    of one's own are; the mask-ignoring forward fails and the call falls back, naming it. Before, the loop ran it
    (another output, silently)."""
    from transformers.models.llama import modeling_llama
    model = _llama()
    ids, mask = _prompts(2)
    if where == "class":
        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", _causal_forward)
        named = f"LlamaAttention.forward = {__name__}._causal_forward"
    else:
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(_causal_forward, layer.self_attn)
        named = f"LlamaAttention instance.forward = {__name__}._causal_forward"
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
    patch(model, drafter=DraftModelDrafter(copy.deepcopy(model), k=4, tree_topk=3))
    out, messages = _run(model, ids, mask, max_new_tokens=16)
    [message] = _fallbacks(messages)
    assert torch.equal(out, want) and named in message and "failed the loop's check" in message


def test_dynamically_quantized_linears_are_checked_and_fall_back():
    """torch's dynamic quantization (``torch.ao``) quantizes a linear layer's input with one scale for all of its
    rows, so a row's result depends on the rows beside it: a verify forward's draft rows move it. Its classes are
    not torch.nn's, so the model is checked first, fails, and the call falls back (before: 5 of 6 small batches gave
    another output, silently)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao's deprecation)
        model = torch.ao.quantization.quantize_dynamic(_llama(), {torch.nn.Linear}, dtype=torch.qint8)
    ids, mask = _prompts(2, seed=1)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=24)
    patch(model)
    out, messages = _run(model, ids, mask, max_new_tokens=24)
    [message] = _fallbacks(messages)
    assert torch.equal(out, want) and "torch.ao.nn.quantized.dynamic.modules.linear.Linear" in message


def test_a_compiled_model_patches_the_model_it_wraps():
    """``patch(torch.compile(model))``: the wrapper's ``generate`` is its model's, so the model it wraps is patched
    (the loop runs its own kernels); ``is_patched``, ``stats`` and ``unpatch`` take the wrapper too. Before,
    generate raised AttributeError (the wrapper's class has no generate)."""
    model = _llama()
    ids, mask = _prompts(1)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
    compiled = torch.compile(model, backend="eager")
    assert patch(compiled) is compiled and is_patched(compiled) and is_patched(model)
    out, messages = _run(compiled, ids, mask, max_new_tokens=12)
    assert torch.equal(out, want) and not _fallbacks(messages) and stats(compiled).steps > 0
    assert unpatch(compiled) is compiled and not is_patched(model) and "generate" not in model.__dict__


def test_a_model_whose_layers_are_compiled_decodes_exactly_through_them():
    """Layers compiled in place (``layer.compile()``, transformers' regional compilation): the loop's forwards run
    through the compiled layers, which trace the loop's own layer code and recompile for its shapes until dynamo's
    limit, and the output is generate's, in the first call and the next; unpatched, generate's again."""
    torch._dynamo.reset()
    model = _llama()
    ids, mask = _prompts(2)
    want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    patch(model)
    try:
        for _ in range(2):
            out, messages = _run(model, ids, mask, max_new_tokens=16)
            assert torch.equal(out, want) and not _fallbacks(messages) and stats(model).steps > 0
    finally:
        unpatch(model)
        torch._dynamo.reset()
    assert torch.equal(model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16), want)


def test_autocast_falls_back_to_generate_under_it():
    """Under ``torch.autocast`` generate's forwards compute in the autocast dtype; the loop's kernels compute in the
    model's, so the loop would give the model's own float32 tokens (on SmolLM2-135M-Instruct, 3 of the first 3
    Spec-Bench questions whose output autocast changes, 100 new tokens). The call falls back, naming it, and gives
    generate's tokens under autocast."""
    model = _llama()
    ids, mask = _prompts(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
        patch(model)
        out, messages = _run(model, ids, mask, max_new_tokens=12)
    assert torch.equal(out, want)
    [message] = _fallbacks(messages)
    assert "torch.autocast is on for cpu (bfloat16)" in message
    out, messages = _run(model, ids, mask, max_new_tokens=12)  # outside autocast: the loop
    assert not _fallbacks(messages) and stats(model).steps > 0


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("rounds", [None, True], ids=["this CPU", "a CPU that rounds"])
def test_float32_matmuls_rounding_lower_fall_back(precision, rounds, monkeypatch):
    """``torch.set_float32_matmul_precision("medium")`` lets oneDNN round float32 matmuls through bfloat16 on a CPU
    with bfloat16 instructions (AVX512-BF16, AMX), which generate's forwards then do and the loop's kernels do not:
    the call falls back, naming the setting, and gives generate's tokens. A precision this machine's matmuls do not
    round at (tf32 on current CPUs, bf16 on one without those instructions) leaves the loop running, its output
    generate's. ``rounds=True``: the machine check answering yes, as on such a CPU, so that the fallback runs on
    every machine."""
    import importlib
    hf_patch = importlib.import_module("fastverify.hf.patch")
    if rounds is not None:
        monkeypatch.setattr(hf_patch, "_matmul_rounds", lambda precision: rounds)
    model = _llama()
    ids, mask = _prompts(2)
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = precision
        want = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=12)
        patch(model)
        out, messages = _run(model, ids, mask, max_new_tokens=12)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    assert torch.equal(out, want)
    if hf_patch._matmul_rounds(precision):
        [message] = _fallbacks(messages)
        assert f"float32 matmul precision {precision!r}" in message
    else:
        assert not _fallbacks(messages) and stats(model).steps > 0
