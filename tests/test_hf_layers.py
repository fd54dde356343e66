"""fastverify.hf.layers: the loop's forward of Llama / Mistral / Qwen2 / Qwen3 decoder layers is the model's, bit for
bit."""

import contextlib

import pytest
import torch

import fastverify
from fastverify.hf import layers as hf_layers
from fastverify.hf.attention import cache_kwargs, gqa_attention, new_cache
from fastverify.hf.layers import LiveRows, lean_layers, projection_groups
from fastverify.hf.linear import packed_group, packed_weight, skinny_available, skinny_linears
from fastverify.ops.linear import unpack_blocks
from test_linear import gguf_quantised

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny(family, dtype=torch.float32, quantised=False, seed=0, vocab=96, window=None, window_layers=0):
    """A 2-layer random model of ``family`` (Qwen2: biased q / k / v; Qwen3: q / k norms); ``quantised``: every
    linear layer's weight as a GGUF file's (Q4_1 blocks, the output head Q8_0), so that the layers pack;
    ``window``: a sliding window (Mistral: every layer's; Qwen2 / Qwen3: the layers from ``window_layers`` on)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)
    sliding = dict(use_sliding_window=window is not None, sliding_window=window, max_window_layers=window_layers)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=window))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, **sliding))
    else:  # q_norm / k_norm over each head's 16 dimensions
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16, **sliding))
    model = model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    if quantised:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if type(m) is torch.nn.Linear:
                    m.weight.copy_(gguf_quantised(*m.weight.shape, "q8_0" if m is model.lm_head else "q4_1", g))
                    if m.bias is not None:
                        m.bias.normal_(0, 0.1, generator=g)
    return model.to(dtype)


def forwards(model, ids, lean, prof=None, skinny=True):
    """Logits of a prefill of ids[:, :6], then of 3 rows and 1 row over the cache, within the loop's contexts (its
    linears unless not ``skinny``, its attention, and ``lean_layers`` when ``lean``); and how many layers ran the
    lean forward."""
    out = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if skinny:
            stack.enter_context(skinny_linears(model))
        stack.enter_context(gqa_attention(model))
        n = stack.enter_context(lean_layers(model)) if lean else 0
        if prof is not None:
            stack.enter_context(prof)
        cache = new_cache()
        for lo, hi in ((0, 6), (6, 9), (9, 10)):
            out.append(model(ids[:, lo:hi], use_cache=True, **cache_kwargs(model, cache)).logits)
    return out, n


def assert_lean_is_the_model(model, seed, prof=None, skinny=True):
    """Both layers run the lean forward, and every logit is the model's own, bit for bit."""
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(seed)).to(model.device)
    want, _ = forwards(model, ids, lean=False, skinny=skinny)
    got, n = forwards(model, ids, lean=True, prof=prof, skinny=skinny)
    assert n == 2
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantised", [False, True])
def test_lean_layers_give_the_model_forward_bit_for_bit(family, quantised):
    model = tiny(family, quantised=quantised)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    assert_lean_is_the_model(model, 3, prof)
    if quantised and skinny_available():
        counts = {e.key: e.count for e in prof.key_averages()}
        if hf_layers._pre_op is not None:
            # the layer's steps around its attention from C++ (csrc/layer.cpp), Qwen3's q / k norms included, their
            # projections inside them; the output head its own call
            assert counts.get("fastverify::decoder_pre_attention", 0) == 3 * 2
            assert counts.get("fastverify::decoder_post_attention", 0) == 3 * 2
            assert counts["fastverify::skinny_linear_packed"] == 3
        else:  # per layer and forward: q / k / v in one call, o, gate / up in one, down; and the output head
            assert counts["fastverify::skinny_linear_packed"] == 3 * (2 * 4 + 1)
    if not quantised:  # float32 weights that do not pack: the dense ops, their projections through skinny_linear
        assert_dense_ops_ran(prof, family)
        if skinny_available():
            counts = {e.key: e.count for e in prof.key_averages()}
            assert counts["fastverify::skinny_linear"] == 3 * (2 * 7 + 1)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)  # removed on exit


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantised", [False, True])
def test_live_rows_are_the_padded_forward_rows_bit_for_bit(family, quantised):
    """A step of 4 rows for 3 requests over a cache, of which the loop reads 4 + 1 + 2: with ``LiveRows`` the layers
    compute those only, and each of them is the padded forward's, bit for bit (the causal mask: no live row sees a
    later padding row); the padding rows come out as zeros."""
    model = tiny(family, quantised=quantised, seed=9)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(10))
    index = torch.tensor([0, 1, 2, 3, 4, 8, 9])  # request 0: rows 0-3, request 1: row 0, request 2: rows 0-1
    out = {}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    for name in ("padded", "live"):
        live = LiveRows()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if name == "live":
                stack.enter_context(prof)
            stack.enter_context(skinny_linears(model))
            stack.enter_context(gqa_attention(model))
            assert stack.enter_context(lean_layers(model, live=live)) == 2
            cache = new_cache()
            model(ids[:, :6], use_cache=True, **cache_kwargs(model, cache))
            if name == "live":
                live.index, live.total = index, 12
            out[name] = model(ids[:, 6:], use_cache=True, output_hidden_states=True, **cache_kwargs(model, cache))
    for a, b in zip(out["padded"].hidden_states[1:], out["live"].hidden_states[1:]):
        assert torch.equal(a.reshape(12, -1)[index], b.reshape(12, -1)[index])
        rest = torch.ones(12, dtype=torch.bool)
        rest[index] = False
        assert not b.reshape(12, -1)[rest].any()
    assert torch.equal(out["padded"].logits.reshape(12, -1)[index], out["live"].logits.reshape(12, -1)[index])
    if quantised and skinny_available() and hf_layers._pre_op is not None:  # the live rows from C++ too
        counts = {e.key: e.count for e in prof.key_averages()}
        assert counts.get("fastverify::decoder_post_attention", 0) == 2 * 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_batch_computes_the_verify_rows_only_and_is_exact(family):
    """A batch whose requests draft trees of different sizes: the output projection gets the verify rows only
    (fewer than B * q), and the output is greedy generate's; seeded sampling with and without live rows is the
    same."""
    from conftest import patched_generate, repetitive

    model = tiny(family, quantised=True, seed=11)
    g = torch.Generator().manual_seed(12)
    ids = torch.tensor([repetitive(30, 96, seed=13), torch.randint(3, 96, (30,), generator=g).tolist(),
                        repetitive(30, 96, seed=14)])
    head_rows, layouts = [], []
    handles = [model.lm_head.register_forward_hook(lambda m, a, o: head_rows.append(a[0].shape[:-1].numel())),
               model.register_forward_hook(lambda m, a, kw, o: layouts.append(
                   (kw["input_ids"].shape, o.logits.shape[:2])), with_kwargs=True)]
    try:
        got, st = patched_generate(model, fastverify.NGramDrafter(), ids, options={"row_hooks": True},
                                   do_sample=False, max_new_tokens=20)  # (the hooks record)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(got, model.generate(ids, do_sample=False, max_new_tokens=20))
    assert st.drafted_tokens > 0 and len(head_rows) == len(layouts) == st.steps
    assert all(logits == inputs for inputs, logits in layouts[1:])  # the model's logits keep the [B, q] layout
    assert any(rows < inputs.numel() for rows, (inputs, _) in zip(head_rows[1:], layouts[1:]))
    a, _ = patched_generate(model, fastverify.NGramDrafter(), ids, do_sample=True, max_new_tokens=20, seed=15)
    b, _ = patched_generate(model, fastverify.NGramDrafter(), ids, options={"live_rows": False}, do_sample=True,
                            max_new_tokens=20, seed=15)
    assert torch.equal(a, b)


def test_left_padded_prompts_skip_their_padding_in_the_first_forward():
    """A batch of prompts of 30, 17 and 24 tokens (left padded): the first forward computes the real tokens only
    (the final norm's input is zero at the padding), and the output is greedy generate's."""
    from conftest import patched_generate, repetitive

    model = tiny("qwen2", quantised=True, seed=16)
    lens = (30, 17, 24)
    ids = torch.zeros(3, 30, dtype=torch.int64)
    mask = torch.zeros(3, 30, dtype=torch.int64)
    for b, n in enumerate(lens):
        ids[b, 30 - n:] = torch.tensor(repetitive(n, 96, seed=17 + b))
        mask[b, 30 - n:] = 1
    seen = []
    handle = model.model.norm.register_forward_hook(lambda m, a, o: seen.append(a[0].clone()))
    try:
        got, _ = patched_generate(model, fastverify.NGramDrafter(), ids, options={"row_hooks": True},
                                  attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    finally:
        handle.remove()
    first = seen[0]
    assert first.shape[0] == 3 and first.shape[1] >= 30  # the prompts but their last tokens, then the step rows
    for b, n in enumerate(lens):
        assert not first[b, :30 - n].any() and first[b, 30 - n:29].abs().sum(-1).gt(0).all()
    assert torch.equal(got, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                                           pad_token_id=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lean_layers_in_half_precision(dtype):
    assert_lean_is_the_model(tiny("qwen2", dtype=dtype), 4)


def assert_dense_ops_ran(prof, family):
    """Each forward of each layer ran the dense decoder ops (csrc/layer.cpp), Qwen3's q / k norms included."""
    if hf_layers._dense_pre_op is None:
        return
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("fastverify::decoder_pre_attention_dense", 0) == 3 * 2
    assert counts.get("fastverify::decoder_post_attention_dense", 0) == 3 * 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_layers_with_their_own_linears_run_the_dense_ops_bit_for_bit(family, dtype):
    """Projections that run their own nn.Linear forward (as on a GPU; here the CPU without skinny_linears): the
    steps around the attention from C++ on the unpacked weights, the model's forward bit for bit."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    assert_lean_is_the_model(tiny(family, dtype=dtype, seed=11), 12, prof, skinny=False)
    assert_dense_ops_ran(prof, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_generate_with_lean_layers_is_greedy_exact_and_samples_the_same_stream(family):
    from conftest import assert_greedy_exact, patched_generate, repetitive

    model = tiny(family, quantised=True, seed=5)
    ids = torch.tensor([repetitive(30, 96, seed=6), repetitive(30, 96, seed=7)])
    assert_greedy_exact(model, fastverify.NGramDrafter(), ids, max_new_tokens=20)
    a, _ = patched_generate(model, fastverify.NGramDrafter(), ids, do_sample=True, max_new_tokens=20, seed=8)
    b, _ = patched_generate(model, fastverify.NGramDrafter(), ids, options={"lean_layers": False}, do_sample=True,
                            max_new_tokens=20, seed=8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_generate_runs_the_layers_as_one_stack(family):
    """On the loop's cache, every decoding step's layers run as one decoder_stack call (the first step's prompt
    fills the cache through the layers' own calls), greedy output exact; a forward hook on a layer keeps the
    layers' own calls (the hook sees its layer's output) and the same output."""
    from conftest import assert_greedy_exact, patched_generate, repetitive

    if hf_layers._stack_op is None or not skinny_available():
        pytest.skip("fastverify._C without the decoder layer ops or the skinny kernels")
    model = tiny(family, quantised=True, seed=9)
    ids = torch.tensor([repetitive(30, 96, seed=10)])
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        out, stats = patched_generate(model, fastverify.NGramDrafter(), ids, max_new_tokens=12)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("fastverify::decoder_stack", 0) == stats.steps - 1 > 0
    assert_greedy_exact(model, fastverify.NGramDrafter(), ids, max_new_tokens=12)
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda m, args, output: seen.append(output))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    try:
        with prof:
            hooked, stats = patched_generate(model, fastverify.NGramDrafter(), ids, options={"row_hooks": True},
                                             max_new_tokens=12)
    finally:
        handle.remove()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("fastverify::decoder_stack", 0) == 0 and len(seen) == stats.steps
    assert torch.equal(hooked, out)


def stacks_against_own_calls(model, ids, max_new_tokens=16):
    """Patched greedy generate with the n-gram drafter, as the loop runs it and with every layer's own calls (no
    decoder stack): the same tokens and every step's logits bit for bit, and generate's output. Returns the first
    call's decoder_stack calls and its stats."""
    from conftest import assert_greedy_exact, logits_equal, patched_generate

    kw = dict(max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_logits=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        got, stats = patched_generate(model, fastverify.NGramDrafter(), ids, **kw)
    stack_op = hf_layers._stack_op
    hf_layers._stack_op = None  # every layer its own calls
    try:
        want, _ = patched_generate(model, fastverify.NGramDrafter(), ids, **kw)
    finally:
        hf_layers._stack_op = stack_op
    assert torch.equal(got.sequences, want.sequences) and logits_equal(got.logits, want.logits)
    assert_greedy_exact(model, fastverify.NGramDrafter(), ids, max_new_tokens=max_new_tokens)
    return {e.key: e.count for e in prof.key_averages()}.get("fastverify::decoder_stack", 0), stats


@pytest.mark.parametrize("family, window_layers", [("mistral", 0), ("qwen2", 0), ("qwen3", 0), ("qwen2", 1)])
def test_the_stack_under_a_sliding_window(family, window_layers):
    """A window of 6 under 30-token prompts and 16 new tokens: where every layer slides over the same window (one
    mask, the loop's, holding it), every decoding step's layers run as one stack; where only some do (Qwen2's
    second layer: a mask per layer type), the layers keep their own calls. Either way tokens and every step's
    logits are those of the layers' own calls, bit for bit, and greedy output is generate's."""
    from conftest import repetitive

    if hf_layers._stack_op is None or not skinny_available():
        pytest.skip("fastverify._C without the decoder layer ops or the skinny kernels")
    model = tiny(family, quantised=True, seed=15, window=6, window_layers=window_layers)
    ids = torch.tensor([repetitive(30, 96, seed=16), repetitive(30, 96, seed=17)])
    stacks, stats = stacks_against_own_calls(model, ids)
    assert stacks == (stats.steps - 1 if window_layers == 0 else 0)
    assert stats.steps > 2 and stats.drafted_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stack_under_eager_attention(family, monkeypatch):
    """A model loaded with eager attention: its file's eager function agrees with masked_attention (checked once per
    attention class, fastverify.hf.attention.eager_agrees), so every decoding step's layers run as one stack, the
    tokens and every step's logits those of the layers' own calls bit for bit, greedy output generate's. A file
    whose eager function computes something else (here: its output scaled) keeps the layers' own calls, and its
    function."""
    import sys
    from conftest import repetitive
    from fastverify.hf import attention as hf_attention

    if hf_layers._stack_op is None or not skinny_available():
        pytest.skip("fastverify._C without the decoder layer ops or the skinny kernels")
    monkeypatch.setattr(hf_attention, "_EAGER_AGREES", {})
    model = tiny(family, quantised=True, seed=19)
    model.set_attn_implementation("eager")
    ids = torch.tensor([repetitive(30, 96, seed=20), repetitive(30, 96, seed=21)])
    stacks, stats = stacks_against_own_calls(model, ids)
    assert stacks == stats.steps - 1 > 0 and stats.drafted_tokens > 0
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    own = modeling.eager_attention_forward
    monkeypatch.setattr(hf_attention, "_EAGER_AGREES", {})
    monkeypatch.setattr(modeling, "eager_attention_forward", lambda *a, **k: (own(*a, **k)[0] * 1.5, None))
    stacks, stats = stacks_against_own_calls(model, ids)
    assert stacks == 0 and stats.drafted_tokens > 0


def test_a_layer_called_out_of_the_stacks_order_raises():
    """After the stack ran a forward's layers, a later layer is handed the stack's result in order; anything else
    (a model forward that changes the hidden state between layers) is an error, never a layer run twice."""
    model = tiny("llama", quantised=True)
    with skinny_linears(model), gqa_attention(model), lean_layers(model):
        stack = model.model.layers[0]._fastverify[0].stack
        assert stack is not None and model.model.layers[1]._fastverify[0].stack is stack
        out = torch.zeros(1, 2, 64)
        stack.passing.next, stack.passing.out = 1, out
        assert stack.hands_on(1, out) and stack.passing.out is None  # the last layer: done
        stack.passing.next, stack.passing.out = 1, out
        with pytest.raises(RuntimeError, match="decoder layer 1 was called after the decoder stack ran"):
            stack.hands_on(1, out.clone())
        assert not stack.hands_on(1, out)  # reset by the error


def test_hooked_and_other_layers_keep_their_own_forward():
    model = tiny("llama")
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        with lean_layers(model) as n:
            assert n == 1
            assert "forward" not in model.model.layers[0].__dict__
            assert "forward" in model.model.layers[1].__dict__
    finally:
        handle.remove()
    # transformers' output-capturing hooks (installed for good by a call that asks for attentions) record nothing
    # unless asked: the layers stay eligible; so do layers with hooks of their own (they run around the forward)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), output_attentions=True, output_hidden_states=True)
    assert model.model.layers[1].self_attn._forward_hooks and model.model.layers[1]._forward_hooks
    assert_lean_is_the_model(model, 6)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    assert projection_groups(gpt2) == []
    with lean_layers(gpt2) as n:
        assert n == 0


def test_a_layer_that_computes_otherwise_keeps_its_own_forward(monkeypatch):
    """The first layer of a class is run both ways; a class whose forward differs (here its MLP multiplies the
    other way round) is not rebound, and the verdict is kept."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(hf_layers, "_VERDICT", {})
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward",
                        lambda self, x: self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)) + 1.0))
    model = tiny("llama")
    with lean_layers(model) as n:
        assert n == 0
    assert list(hf_layers._VERDICT.values()) == [False]
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)


@pytest.mark.skipif(not skinny_available(), reason="fastverify._C is not built")
def test_packed_group_stacks_the_projections_and_its_members_stream_views_of_it():
    model = tiny("qwen2", quantised=True)
    a = model.model.layers[0].self_attn
    mods = [a.q_proj, a.k_proj, a.v_proj]
    stack = packed_group(mods)
    assert stack is not None and stack.shape == (64 + 32 + 32, 64)
    assert torch.equal(unpack_blocks(*stack), torch.cat([m.weight for m in mods]))
    row_bytes = stack.q.shape[1]
    for m, start in zip(mods, (0, 64, 96)):
        p = packed_weight(m)
        assert p.q.data_ptr() == stack.q.data_ptr() + start * row_bytes  # a view: no second copy
        assert torch.equal(unpack_blocks(*p), m.weight)
    assert packed_group(mods) is stack  # kept
    with torch.no_grad():  # a member whose weight changed (and no longer packs): the stack is made again, or None
        a.k_proj.weight.add_(1e-3 * torch.randn(a.k_proj.weight.shape))
    assert packed_group(mods) is None
    assert packed_weight(a.q_proj) is not None and packed_weight(a.k_proj) is None


def test_lean_layers_with_eager_attention():
    model = tiny("mistral", quantised=True)
    model.config._attn_implementation = "eager"
    assert_lean_is_the_model(model, 5)


def test_a_layer_whose_attributes_the_plan_cannot_read_keeps_its_own_forward(monkeypatch):
    model = tiny("llama")
    first = model.model.layers[0]
    init = hf_layers._Plan.__init__

    def plan(self, layer, *args):
        if layer is first:
            raise AttributeError("head_dim")  # as a transformers release without the attribute would
        init(self, layer, *args)

    monkeypatch.setattr(hf_layers._Plan, "__init__", plan)
    with lean_layers(model) as n:
        assert n == 1
        assert "forward" not in first.__dict__ and "forward" in model.model.layers[1].__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_layers_on_cuda_give_the_model_forward_bit_for_bit(family, dtype):
    """On a GPU the projections are each layer's own GEMMs (concatenated), the rest the same ops: from C++ (the
    dense decoder ops)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    assert_lean_is_the_model(tiny(family, dtype=dtype).cuda(), 7, prof)
    assert_dense_ops_ran(prof, family)


def test_rotary_follows_its_inputs():
    rotary = hf_layers._Rotary()
    a, b, c = torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for cos, sin in ((c, a), (c, a), (c, b), (a, b), (c, a), (b, b)):
        got_cos, got_sin, got_rolled = rotary(cos, sin)
        assert torch.equal(got_cos, cos.unsqueeze(1)) and torch.equal(got_sin, sin.unsqueeze(1))
        assert torch.equal(got_rolled, torch.cat((-sin[..., :4], sin[..., 4:]), -1).unsqueeze(1))
