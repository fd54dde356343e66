"""Every model type in fastverify.hf.MODEL_REGISTRY, on a tiny random model: greedy through the loop equals the
model's own generate, at batch size 1 and 3 (left padded), with the n-gram drafter and the model drafting for
itself, under eager and sdpa attention; sliding windows the loop masks itself; ALiBi models fall back."""

import threading
import warnings

import pytest
import torch

from fastverify.hf import MODEL_REGISTRY, DraftModelDrafter, NGramDrafter, patch, stats, unpatch

from conftest import TYPE_CONFIGS, assert_drafts_change_no_bit, known_type, latent_sizes, left_padded

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512
PAD = 1
# small sizes under every name the configs use for them (a config ignores the names it does not have)
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, head_dim=16, n_embd=64, n_layer=2, n_head=4,
             n_positions=256, ffn_dim=128, word_embed_proj_dim=64, num_local_experts=4, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, n_inner=128,
             rotary_dim=8, initializer_range=0.08)


def tiny(model_type, attn="sdpa", **config):
    """A random tiny causal LM of ``model_type`` (config keyword arguments set at construction, e.g. a window)."""
    if not known_type(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    cfg = transformers.AutoConfig.for_model(model_type, **dict(TYPE_CONFIGS.get(model_type, {}), **config))
    sizes = dict(SIZES, **latent_sizes(SIZES["head_dim"], SIZES["num_attention_heads"])) if hasattr(
        cfg, "kv_lora_rank") else SIZES
    for k, v in sizes.items():
        if hasattr(cfg, k):
            try:
                setattr(cfg, k, v)
            except AttributeError:  # a derived property (Falcon's head_dim)
                pass
    for k in ("pad_token_id", "bos_token_id"):
        if hasattr(cfg, k):
            setattr(cfg, k, 0)
    if hasattr(cfg, "eos_token_id"):
        cfg.eos_token_id = None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def _prompts(B):
    """B left-padded repetitive prompts of 30, 27, 24 tokens (the n-gram drafter finds its drafts in them)."""
    g = torch.Generator().manual_seed(0)
    motifs = [torch.randint(3, V, (4,), generator=g).tolist() for _ in range(B)]
    return left_padded([(motifs[b] * 30)[:30 - 3 * b] for b in range(B)], PAD)


def _loop_equals_generate(model, ids, mask, drafters, max_new_tokens=16):
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens,
                             do_sample=False)
    for drafter in drafters:
        patch(model, drafter=drafter)
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens,
                                     do_sample=False)
            st = stats(model)
        finally:
            unpatch(model)
        fallbacks = [str(w.message) for w in record if "falling back" in str(w.message)]
        assert not fallbacks and st is not None and st.drafted_tokens > 0, fallbacks
        assert torch.equal(out, ref), (type(drafter).__name__, out.tolist(), ref.tolist())
    return ref


@pytest.mark.parametrize("model_type", sorted(MODEL_REGISTRY))
def test_registered_type_matches_generate(model_type):
    if model_type == "gpt2":
        pytest.skip("covered by test_hf_generate (n_positions and the GPT-2 names)")
    if model_type == "gemma3":
        pytest.skip("an image-text model: test_gemma3_image_text_model_on_text_prompts")
    if not MODEL_REGISTRY[model_type].supported():  # registered from a later transformers: refused before it
        with pytest.raises(ValueError, match="registered for transformers >= "):
            patch(tiny(model_type))
        return
    for attn in ("eager", "sdpa"):
        try:
            model = tiny(model_type, attn)
        except ValueError as e:  # Gemma 2 and gpt-oss: eager only
            assert attn == "sdpa" and "does not support an attention implementation" in str(e)
            continue
        for B in (1, 3):
            ids, mask = _prompts(B)
            drafters = [NGramDrafter()] + ([DraftModelDrafter(model, k=3, tree_topk=2)] if attn == "eager" else [])
            _loop_equals_generate(model, ids, mask, drafters)


# Dense types of differing build (learned positions, parallel residuals, partial rotary, biases, GELU / ReLU MLPs,
# q / k norms, multi-query attention, sliding and global layers), whose every linear layer is an nn.Linear and whose
# sdpa attention the loop runs with masked_attention. (Of the 94 registered types, 49 gave drafted decoding the
# undrafted logits bit for bit in a survey; the others run some rows through torch's GEMM or SDPA: mixture-of-experts
# layers' 3-D expert weights, latent attention's narrower values, eager-only attention. GPT-2's Conv1D layers run
# skinny_linear_t; transformers' experts modules and routers run fastverify.hf.experts; latent attention runs
# masked_attention with values narrower than the keys; routers' logits over a few experts come row-aligned
# (fastverify.hf.linear.row_aligned) for the sigmoid that scores them; eager-only types' attention (soft caps, sinks)
# runs masked_attention too (fastverify.hf.attention.eager_attention): mixture-of-experts, latent-attention and
# eager types too.)
ROW_INVARIANT = ["gpt2", "mixtral", "qwen3_moe", "olmoe", "granitemoe", "qwen2_moe", "deepseek_v3", "deepseek_v2",
                 "minicpm3", "glm4_moe_lite", "sarvam_moe", "aria_text", "gemma2", "gpt_oss", "flint", "mimo_v2_flash",
                 "opt", "gpt_neox", "phi", "cohere", "gemma3_text", "starcoder2", "olmo2", "stablelm", "gpt_bigcode",
                 "codegen", "nemotron", "persimmon", "modernbert-decoder", "falcon", "dbrx", "jetmoe", "longcat_flash",
                 "llama4_text", "kolibri1", "laguna", "xglm", "gpt_neox_japanese"]


ROW_INVARIANT_FROM = "5.24"  # the release ROW_INVARIANT was surveyed on: older ones compute some types otherwise


def _skip_where_an_older_release_varies(model):
    """On a transformers release before ROW_INVARIANT_FROM, skip a model whose rows the loop's own check
    (``probe.check_rows``: what seeded sampling asks before it drafts) finds varying: an older release's modeling code
    may compute a type with torch's GEMMs or its own attention where the loop has no route for it (on 5.17, 5.19 and
    5.21 every type was row-invariant when last surveyed). On later releases, and wherever the check passes, the bits
    are asserted."""
    from fastverify.hf.loop import DecodeSettings
    from fastverify.hf.probe import check_rows
    from fastverify.hf.processors import transformers_at_least
    if transformers_at_least(ROW_INVARIANT_FROM):
        return
    reason = check_rows(model, DecodeSettings(max_new_tokens=1, eos_token_ids=[], pad_token_id=0))
    if reason is not None:
        pytest.skip(f"transformers {transformers.__version__}: not row-invariant ({reason})")


@pytest.mark.parametrize("model_type", ROW_INVARIANT)
def test_dense_types_draft_without_changing_a_bit(model_type):
    """Drafted decoding returns the undrafted loop's logits bit for bit (the loop's forwards are row-invariant on the
    CPU: test_hf_generate.test_drafts_change_no_bit_of_the_logits), at batch 1 and 3."""
    _assert_rows_invariant_at_batch_1_and_3(_sdpa_or_eager(model_type))


def _assert_rows_invariant_at_batch_1_and_3(model):
    """Drafted decoding (the model drafting for itself, k = 3, two candidates a node) returns the undrafted loop's
    logits bit for bit, at batch 1 and 3, 12 new tokens (skipped where an older release varies)."""
    _skip_where_an_older_release_varies(model)
    for B in (1, 3):
        ids, mask = _prompts(B)
        assert_drafts_change_no_bit(model, DraftModelDrafter(model, k=3, tree_topk=2), ids, attention_mask=mask,
                                    pad_token_id=PAD, max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("config", [{"multi_query": False, "num_kv_heads": 4},
                                    {"new_decoder_architecture": True, "num_kv_heads": 2}])
def test_falcon_layouts_draft_without_changing_a_bit(config):
    """Falcon's attention (before transformers 5.25 its own call of torch's SDPA, fastverify.hf.attention._sdpa_rows
    under the loop; from 5.25 transformers' attention functions), in its other head layouts (ROW_INVARIANT has its
    multi-query default): one key / value head per query head, and the new decoder architecture's grouped heads."""
    _assert_rows_invariant_at_batch_1_and_3(tiny("falcon", **config))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "minicpm3"])
def test_latent_attention_drafts_without_changing_a_bit_past_the_kernels_rows(model_type):
    """Latent attention expands every cached latent at every step (``kv_b_proj`` over B x the sequence's rows): at
    batch 3 and 30 new tokens that passes the skinny kernels' 128 rows, where it stays on the kernel
    (fastverify.hf.linear.skinny_linears), so drafted decoding still returns the undrafted logits bit for bit."""
    model = _sdpa_or_eager(model_type)
    ids, mask = _prompts(3)
    assert_drafts_change_no_bit(model, DraftModelDrafter(model, k=4, tree_topk=3), ids, attention_mask=mask,
                                pad_token_id=PAD, max_new_tokens=30, do_sample=False)


def _sdpa_or_eager(model_type, **config):
    """``tiny`` under sdpa attention, or eager where transformers has no sdpa path for the type."""
    try:
        return tiny(model_type, **config)
    except ValueError as e:
        assert "does not support an attention implementation" in str(e)
        return tiny(model_type, "eager", **config)


# model types whose every layer slides when sliding_window is set, and types with a sliding layer type
WINDOWS = {"mixtral": {"sliding_window": 6}, "starcoder2": {"sliding_window": 6},
           "qwen3_moe": {"use_sliding_window": True, "sliding_window": 6},
           "qwen2_moe": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
           "exaone4": {"sliding_window": 6, "sliding_window_pattern": 2},
           **{t: {"sliding_window": 6} for t in ("afmoe", "cohere2_moe", "cwm", "exaone_moe", "granite_swa",
                                                 "granitemoe_swa", "kolibri1", "mimo_v2_flash",
                                                 "modernbert-decoder")},
           "flint": {"sliding_window": 6, "num_hidden_layers": 2,  # (its first layers are full ones)
                     "layer_types": ["sliding_attention", "full_attention"]}}


@pytest.mark.parametrize("model_type", sorted(WINDOWS))
def test_window_masked_by_the_loop(model_type):
    """A window of 6 tokens under prompts of 24-30: the loop masks it (no fallback), exact; the window changes
    generate's output, so the comparison tells masked from unmasked."""
    from fastverify.hf.model_limits import loop_window
    model = _sdpa_or_eager(model_type, **WINDOWS[model_type])
    assert loop_window(model.config) is not None
    ids, mask = _prompts(3)
    ref = _loop_equals_generate(model, ids, mask, [NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)])
    wide = _sdpa_or_eager(model_type, **dict(WINDOWS[model_type], sliding_window=256))
    with torch.no_grad():
        assert not torch.equal(wide.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16,
                                             do_sample=False), ref)


@pytest.mark.parametrize("model_type, config", [("bloom", {}), ("mpt", {}), ("falcon", {"alibi": True})])
def test_alibi_falls_back(model_type, config):
    """ALiBi models build their position bias from a 2D attention mask: the loop's 4D one does not fit, so the
    patched generate falls back (allow_unknown_model or not registered), with the original's output."""
    model = tiny(model_type, "eager", **config)
    ids, mask = _prompts(2)
    kw = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False, use_cache=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    patch(model, allow_unknown_model=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(ids, **kw)
    fallbacks = [str(w.message) for w in record if "falling back" in str(w.message)]
    assert len(fallbacks) == 1 and "ALiBi" in fallbacks[0] and torch.equal(out, ref)


@pytest.mark.parametrize("model_type", ["opt", "gptj", "gpt_bigcode", "biogpt", "ctrl"])
def test_slot_rows_stay_inside_a_position_table(model_type):
    """Models whose positions index a table of max_position_embeddings rows: a slot drafter's placeholder rows,
    which stand past the draft, are dropped where they would read outside the table (a sequence that just fits)."""
    from fastverify.hf.model_limits import position_limit
    from fastverify.hf.slots import BlockSlotDrafter
    model = _sdpa_or_eager(model_type)  # (GPT-J has sdpa from transformers 5.24)
    model.config.max_position_embeddings = 256  # the table the model was built with
    assert position_limit(model.config) == 256
    ids, mask = _prompts(2)
    ids, mask = torch.cat([ids] * 8, 1)[:, :240], torch.cat([mask] * 8, 1)[:, :240]  # 240 + 16 = the table
    mask[:, :] = 1
    drafter = BlockSlotDrafter(model.config.hidden_size, num_slots=4, method="lud")
    head = model.get_output_embeddings()
    drafter.init_adapters(model, rank=4, targets={n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                                  if type(m) is torch.nn.Linear and m is not head})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in drafter.adapters.values():
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g) * 0.1)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=False)
    patch(model, drafter=drafter)
    try:
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, do_sample=False)
        assert stats(model) is not None
    finally:
        unpatch(model)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("window", [6, 512])
def test_gemma3_image_text_model_on_text_prompts(window):
    """Gemma3ForConditionalGeneration (model type gemma3) on text prompts: the loop drives its language model,
    sliding windows masked as for gemma3_text (a window of 6 under 24-30-token prompts); a call with images falls
    back (pixel_values is a model input the loop does not take)."""
    model = _gemma3(window)
    for B in (1, 3):
        ids, mask = _prompts(B)
        ref = _loop_equals_generate(model, ids, mask, [NGramDrafter(), DraftModelDrafter(model, k=3, tree_topk=2)])
    if window == 6:  # the window changes the output: the comparison tells masked from unmasked
        with torch.no_grad():
            assert not torch.equal(_gemma3(512).generate(ids, attention_mask=mask, pad_token_id=PAD,
                                                         max_new_tokens=16, do_sample=False), ref)
    patch(model)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            try:
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=2,
                               pixel_values=torch.zeros(1, 3, 28, 28))
            except Exception:  # the original generate's own check of this made-up image input
                pass
    finally:
        unpatch(model)
    assert any("pixel_values" in str(w.message) for w in record if "falling back" in str(w.message))


def _gemma3(window):
    text = transformers.Gemma3TextConfig(**{k: SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                  "num_hidden_layers", "num_attention_heads",
                                                                  "num_key_value_heads", "head_dim",
                                                                  "max_position_embeddings")},
                                         sliding_window=window, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=V - 1, boi_token_index=V - 2, eoi_token_index=V - 3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model


def test_gpt_neo_local_layers_within_their_window():
    """GPT-Neo (not registered: ``allow_unknown_model``, the probe passes it) masks a key of its local layers by the
    key's row in the cache, not by its position, so a verify forward's tree rows (past their positions) would see
    fewer keys than one-row decoding once a sequence passes ``window_size``. The loop bounds a sequence by that
    window: up to it, drafted trees and all, the output is generate's; a call that would pass it falls back with a
    warning that names it (and without that bound the loop's output differs)."""
    model = tiny("gpt_neo", "eager", window_size=12)
    ids, mask = left_padded([[5, 9, 5, 9, 5, 9], [7, 3, 7, 3, 7], [4, 4]], PAD)
    kw = dict(attention_mask=mask, pad_token_id=PAD, do_sample=False)
    for new in (6, 20):  # 6 + 6 = the window; 6 + 20 past it
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=new, **kw)
        for drafter in (NGramDrafter(), DraftModelDrafter(model, k=4, tree_topk=3)):
            patch(model, drafter=drafter, allow_unknown_model=True)
            try:
                with warnings.catch_warnings(record=True) as record:
                    warnings.simplefilter("always")
                    out = model.generate(ids, max_new_tokens=new, **kw)
                st = stats(model)
            finally:
                unpatch(model)
            fallbacks = [str(w.message) for w in record if "falling back" in str(w.message)]
            assert torch.equal(out, ref), (new, type(drafter).__name__)
            if new == 6:
                assert not fallbacks and st is not None and st.drafted_tokens > 0, fallbacks
            else:
                assert len(fallbacks) == 1 and "window_size=12" in fallbacks[0], fallbacks


class _ForwardsBeside(NGramDrafter):
    """The n-gram drafter, which at its first proposal (inside the loop's contexts, which bind the model's modules,
    its configs' implementations and its modeling files' globals) runs ``calls`` on another thread and keeps their
    results."""

    def __init__(self, calls):
        super().__init__()
        self.calls, self.results = calls, None

    def propose(self, contexts, budget):
        if self.results is None:
            self.results = {}

            def run():
                with torch.no_grad():
                    self.results.update({name: call() for name, call in self.calls.items()})

            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        return super().propose(contexts, budget)


# one type of each way the loop binds its own code in for its duration: linear layers and GELU modules, the sdpa and
# eager attention functions, a file's own SDPA (Falcon), an attention class's own method (XGLM), the decoder layers'
# forward (Llama, Qwen3), experts implementations and routers (Qwen2-MoE, Mixtral), a file's F (JetMoE, Laguna),
# experts' own methods (DBRX, Llama 4) and routers (Kolibri, Llama 4), GPT-2's Conv1D, GPT-NeoX's GELU modules
_BOUND_KINDS = [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("gpt2", "sdpa"), ("gpt_neox", "sdpa"),
                ("gemma2", "eager"), ("falcon", "sdpa"), ("xglm", "eager"), ("qwen2_moe", "sdpa"),
                ("mixtral", "sdpa"), ("jetmoe", "eager"), ("dbrx", "sdpa"), ("kolibri1", "sdpa"), ("laguna", "sdpa"),
                ("llama4_text", "sdpa")]


@pytest.mark.parametrize("model_type,attn", _BOUND_KINDS)
def test_forwards_on_another_thread_during_a_patched_call_are_the_models_own(model_type, attn):
    """While a patched call decodes, a plain forward of the same model on another thread, and one of another model of
    the same type, return the logits they return without fastverify, bit for bit: the code the loop binds in for
    its duration (on the model's modules, its config, its modeling file) runs the loop's way on the loop's thread
    only."""
    model, other = tiny(model_type, attn), tiny(model_type, attn)
    ids, mask = _prompts(3)
    with torch.no_grad():
        want = {"model": model(ids, attention_mask=mask).logits, "other": other(ids, attention_mask=mask).logits}
    drafter = _ForwardsBeside({"model": lambda: model(ids, attention_mask=mask).logits,
                               "other": lambda: other(ids, attention_mask=mask).logits})
    patch(model, drafter=drafter)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False)
    assert not [w for w in record if "falling back" in str(w.message)] and stats(model).steps >= 1
    for name, logits in want.items():
        assert torch.equal(drafter.results[name], logits), (
            name, (drafter.results[name] - logits).abs().max().item())
