"""The loop's attention and cache plumbing: the grouped-query sdpa (gqa_attention) against transformers' own sdpa
function (bit for bit where it runs torch's SDPA, to float32 rounding where fastverify's masked_attention); its
switch and restore of the attention implementation; the buffered cache layer against a DynamicLayer under the
loop's updates, crops and compactions; patched generate exact with both in place."""

import types

import pytest
import torch

from fastverify.hf import patch, unpatch
from fastverify.hf import attention
from fastverify.hf import layers as fastverify_layers
from fastverify.hf.attention import GQA_ATTENTION, _gqa_sdpa, crop_cache, gqa_attention, new_cache
from fastverify.hf.linear import substituting
from fastverify.ops.cache import compact_cache

from conftest import tiny_llama

transformers = pytest.importorskip("transformers")


class _Attn(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(B, Hkv, groups, q, S, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(B * 1000 + q * 10 + S)
    query = torch.randn(B, Hkv * groups, q, D, generator=g).to(dtype)
    key = torch.randn(B, Hkv, S + q, D, generator=g).to(dtype)
    value = torch.randn(B, Hkv, S + q, D, generator=g).to(dtype)
    visible = torch.rand(B, 1, q, S + q, generator=g) < 0.7
    visible[..., -1] = True  # every row sees something
    mask = torch.zeros(B, 1, q, S + q, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return query, key, value, mask



@pytest.fixture
def loop_thread():
    """The test's thread inside the loop's contexts (``substituting``), where the functions they bind in compute the
    loop's way (on any other thread, the model's own code)."""
    with substituting():
        yield


SHAPES = [(1, 3, 3, 1, 37, 64), (1, 3, 3, 16, 300, 64), (2, 2, 2, 5, 19, 16), (3, 1, 4, 7, 8, 8), (1, 2, 1, 4, 11, 32),
          (1, 3, 3, 17, 40, 64), (2, 2, 2, 20, 9, 16)]


@pytest.mark.usefixtures("loop_thread")
@pytest.mark.parametrize("B,Hkv,groups,q,S,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_sdpa_equals_transformers_sdpa(B, Hkv, groups, q, S, D, dtype):
    """Bit for bit where it runs torch's SDPA (more query rows than MASKED_ATTENTION_ROWS, other dtypes, no mask);
    with a float32 mask and at most that many rows it is fastverify's masked_attention, to float32 rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    query, key, value, mask = _inputs(B, Hkv, groups, q, S, D, dtype)
    module = _Attn(groups)
    for m in (mask, None):
        want, _ = sdpa_attention_forward(module, query, key, value, m, scaling=D ** -0.5)
        got, none = _gqa_sdpa(module, query, key, value, m, scaling=D ** -0.5)
        assert none is None and got.shape == want.shape == (B, q, Hkv * groups, D)
        kernel = (m is not None and dtype == torch.float32 and q <= attention.MASKED_ATTENTION_ROWS
                  and attention._masked_attention_op() is not None)
        if kernel:
            op = torch.ops.fastverify.masked_attention(query, key, value, m, D ** -0.5)
            assert torch.equal(got, op.transpose(1, 2))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        else:
            assert torch.equal(got, want)



@pytest.mark.parametrize("q", [1, 5])
def test_bound_functions_are_the_models_own_outside_the_loops_contexts(q):
    """On a thread outside the loop's contexts (another thread's forward while a patched call runs), ``_gqa_sdpa`` is
    transformers' sdpa function and ``_eager_rows`` the modeling file's own, bit for bit, where inside they take the
    rows to masked_attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    query, key, value, mask = _inputs(2, 2, 3, q, 30, 32)
    module = _Attn(3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
    assert torch.equal(_gqa_sdpa(module, query, key, value, mask, scaling=0.2)[0], want)
    _, cls = _modeling_file("fv_test_outside", gpt_oss_eager)
    module = cls(3)
    module.sinks = torch.randn(6) + 4
    want, _ = gpt_oss_eager(module, query, key, value, mask, scaling=0.2, dropout=0.0, s_aux=module.sinks)
    got, _ = attention._eager_rows(module, query, key, value, mask, scaling=0.2, dropout=0.0, s_aux=module.sinks)
    assert torch.equal(got, want)
    if attention._masked_attention_op() is not None:
        with substituting():
            inside, _ = _gqa_sdpa(module, query, key, value, mask, scaling=0.2)
        assert not torch.equal(inside, sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)[0])

@pytest.mark.usefixtures("loop_thread")
def test_gqa_sdpa_leaves_masks_it_does_not_take_to_sdpa():
    """A mask that broadcasts over the batch, or a boolean one, goes to transformers' own function (bit for bit)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    query, key, value, mask = _inputs(2, 3, 3, 4, 20, 64)
    module = _Attn(3)
    for m in (mask[:1], mask == 0):
        want, _ = sdpa_attention_forward(module, query, key, value, m, scaling=0.125)
        got, _ = _gqa_sdpa(module, query, key, value, m, scaling=0.125)
        assert torch.equal(got, want)


@pytest.mark.usefixtures("loop_thread")
@pytest.mark.parametrize("q", [1, 4, 17])
def test_gqa_sdpa_values_narrower_than_keys(q):
    """Latent attention (DeepSeek-V2 / V3): values narrower than the keys go to the masked_attention kernel too,
    SDPA's result to float32 rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    query, key, value, mask = _inputs(1, 4, 1, q, 30, 32)
    value = value[..., :16].contiguous()
    module = _Attn(1)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
    got, _ = _gqa_sdpa(module, query, key, value, mask, scaling=0.2)
    assert got.shape == (1, q, 4, 16)
    if attention._masked_attention_op() is not None:
        op = torch.ops.fastverify.masked_attention(query, key, value, mask, 0.2)
        assert torch.equal(got, op.transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_gqa_attention_switches_and_restores():
    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    with gqa_attention(model) as on:
        assert on and model.config._attn_implementation == GQA_ATTENTION
        ids = torch.tensor([[1, 2, 3, 4]])
        out = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(out, model(ids).logits)
    model.config._attn_implementation = "eager"
    with gqa_attention(model) as on:
        assert not on and model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"


def test_gqa_attention_without_registries_keeps_the_model_attention(monkeypatch):
    import fastverify.hf.attention as attention
    monkeypatch.setattr(attention, "_register_gqa_attention", lambda: False)
    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    with gqa_attention(model) as on:
        assert not on and model.config._attn_implementation == "sdpa"


def test_gqa_attention_restores_on_error():
    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with gqa_attention(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("Hkv,groups", [(1, 4), (4, 1), (2, 2)])
def test_sdpa_rows_against_torch_sdpa(Hkv, groups):
    """The SDPA a modeling file calls itself (Falcon, under gqa_attention): float32 rows with an additive mask are
    masked_attention's bits (one key head broadcast over the query heads: Falcon's multi-query layout), torch's to
    float32 rounding; a causal call, a boolean mask, more rows than the kernel takes or bfloat16 are torch's own."""
    from fastverify.hf.attention import _sdpa_rows
    F = torch.nn.functional
    for q, dtype in ((1, torch.float32), (5, torch.float32), (attention.MASKED_ATTENTION_ROWS + 1, torch.float32),
                     (5, torch.bfloat16)):
        query, key, value, mask = _inputs(2, Hkv, groups, q, 23, 16, dtype)
        gqa = dict(enable_gqa=True) if Hkv > 1 and groups > 1 else {}  # torch broadcasts one head, groups no more
        want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, **gqa)
        got = _sdpa_rows(query, key, value, attn_mask=mask, **gqa)
        if (dtype == torch.float32 and q <= attention.MASKED_ATTENTION_ROWS
                and attention._masked_attention_op() is not None):
            assert torch.equal(got, torch.ops.fastverify.masked_attention(query, key, value, mask, 0.25))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        else:
            assert torch.equal(got, want)
        for kwargs in (dict(attn_mask=mask == 0, **gqa), dict(is_causal=True, **gqa),
                       dict(attn_mask=mask, scale=0.1, **gqa)):
            want = F.scaled_dot_product_attention(query, key, value, **kwargs)
            got = _sdpa_rows(query, key, value, **kwargs)
            if "scale" in kwargs and dtype == torch.float32 and q <= attention.MASKED_ATTENTION_ROWS:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
            else:
                assert torch.equal(got, want)


def test_gqa_attention_on_falcon_as_its_release_computes():
    """Falcon's attention under sdpa. Before transformers 5.25 its file calls torch's SDPA itself (its eager branch:
    matmuls over the query rows): its config keeps sdpa, its file's ``torch`` is the one whose SDPA is
    ``_sdpa_rows``, nested loops restore it once, and a file whose ``torch`` something else holds is left to it.
    From 5.25 it goes through transformers' attention functions: its config is switched as any other model's and its
    file's ``torch`` left alone. Either way the logits stay SDPA's to float32 rounding (and the rows stay the same
    bits beside draft rows: test_hf_model_types.py's Falcon cases)."""
    import sys
    from test_hf_model_types import tiny
    model = tiny("falcon")
    mod = sys.modules[type(model).__module__]
    own = attention._calls_sdpa_itself(mod.__name__)  # the file's own SDPA call, as before transformers 5.25
    ids = torch.tensor([[5, 9, 3, 7, 2]])
    with torch.no_grad():
        want = model(ids).logits
        with gqa_attention(model) as on:
            assert on and model.config._attn_implementation == ("sdpa" if own else attention.GQA_ATTENTION)
            assert (mod.torch is attention._SDPA_TORCH) == own and (mod.torch is torch) != own
            with gqa_attention(model):
                assert (mod.torch is attention._SDPA_TORCH) == own
            assert (mod.torch is attention._SDPA_TORCH) == own
            got = model(ids).logits
    assert mod.torch is torch and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not own:
        return
    # a file whose torch something else holds (a user's own stand-in) is left to it
    theirs = types.SimpleNamespace(**vars(torch))
    mod.torch = theirs
    try:
        with gqa_attention(model) as on:
            assert not on and mod.torch is theirs
        assert mod.torch is theirs
    finally:
        mod.torch = torch


def _layer_pairs(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_buffered_cache_follows_a_dynamic_cache():
    """The loop's sequence on both caches: prefill, steps of several rows, crops (views), compactions in place,
    growth past the buffer, and a layer replaced from outside; every layer equal after every operation."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    ref, buf = DynamicCache(), new_cache()
    assert buf.layer_class_to_replicate.__name__ == "BufferedLayer"
    B, H, D, layers = 2, 3, 8, 2

    def update(n):
        for i in range(layers):
            k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
            a, b = ref.update(k, v, i), buf.update(k.clone(), v.clone(), i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def same():
        for (k1, v1), (k2, v2) in zip(_layer_pairs(ref), _layer_pairs(buf)):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    update(20)
    first = buf.layers[0]._kbuf
    for step in range(60):
        S = ref.layers[0].keys.shape[-2]
        n = 1 + step % 7
        update(n)
        if step % 3 == 0:
            accepted = torch.tensor([[1, 3, 4], [2, 5, 6]], dtype=torch.int32)[:, : max(0, n - 4)]
            alen = torch.full((B,), accepted.shape[1], dtype=torch.int32)
            for cache in (ref, buf):
                compact_cache(cache, torch.tensor([S + 1, S + 1]), S, accepted, alen)
        else:
            for cache in (ref, buf):
                crop_cache(cache, S + 1 + step % 2)
        same()
    assert buf.layers[0]._kbuf is not first  # grew past its first buffer
    assert buf.layers[0].keys.data_ptr() == buf.layers[0]._kbuf.data_ptr()
    for cache in (ref, buf):  # replaced from outside: the next update copies it into a new buffer
        cache.layers[1].keys = cache.layers[1].keys.clone()
        cache.layers[1].values = cache.layers[1].values.clone()
    assert buf.layers[1].room(3, (B, H)) == -1 and buf.layers[0].room(3, (B, H)) >= 0
    update(3)
    same()
    for cache in (ref, buf):  # a batch narrowed from outside (a view of the buffer that is not its prefix)
        cache.layers[0].keys = cache.layers[0].keys[:1]
        cache.layers[0].values = cache.layers[0].values[:1]
    assert buf.layers[0].room(1, (1, H)) == -1
    for cache in (ref, buf):
        cache.layers[0].update(torch.ones(1, H, 1, D), torch.ones(1, H, 1, D))
    same()
    for cache in (ref, buf):
        cache.layers[1].reset()
    for a, b in ((ref.layers[1].keys, buf.layers[1].keys), (ref.layers[1].values, buf.layers[1].values)):
        # as the release's DynamicLayer resets: dropped (5.18 and later), or zeroed in place (before)
        assert (a is None and b is None) or (torch.equal(a, b) and not b.any())


@pytest.mark.skipif(fastverify_layers._append_op is None, reason="fastverify._C has no append_attention")
def test_buffered_cache_appended_by_append_attention_follows_a_dynamic_cache():
    """The lean layers' append (``append_attention`` on the buffers, ``room`` and the layer's lengths) between
    crops: the cache holds what a DynamicCache's update gives, and the attention is masked_attention's over it."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(1)
    ref, buf = DynamicCache(), new_cache()
    B, H, G, D = 1, 2, 3, 8
    k0, v0 = torch.randn(B, H, 12, D, generator=g), torch.randn(B, H, 12, D, generator=g)
    ref.update(k0, v0, 0)
    buf.update(k0.clone(), v0.clone(), 0)
    layer = buf.layers[0]
    for step in range(90):  # grows past the first buffer: room says -1, the update path takes that step
        n = 1 + step % 4
        q = torch.randn(B, H * G, n, D, generator=g)
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        keys, values = ref.update(k, v, 0)
        mask = torch.zeros(B, 1, n, keys.shape[2])
        want = torch.ops.fastverify.masked_attention(q, keys, values, mask, 0.5, True).transpose(1, 2)
        start = layer.room(n, (B, H))
        if start < 0:
            got_k, got_v = buf.update(k, v, 0)
            got = torch.ops.fastverify.masked_attention(q, got_k, got_v, mask, 0.5, True).transpose(1, 2)
        else:
            got = torch.ops.fastverify.append_attention(q, k, v, layer._kbuf, layer._vbuf, start, mask, 0.5)
            layer._klen = layer._vlen = start + n
        assert torch.equal(got, want)
        length = keys.shape[2] - (step % 3)
        for cache in (ref, buf):
            crop_cache(cache, length)
        assert torch.equal(layer.keys, ref.layers[0].keys) and torch.equal(layer.values, ref.layers[0].values)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_patched_greedy_exact_with_gqa_attention(attn, one_thread):
    model = tiny_llama(vocab=97)
    model.config._attn_implementation = attn
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 30))
    ids[:, 10:20] = ids[:, :10]  # repeats, so that the n-gram drafter drafts
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    patch(model)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    try:
        with prof:
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    finally:
        unpatch(model)
    assert torch.equal(got, want)
    assert model.config._attn_implementation == attn
    if attn == "sdpa" and fastverify_layers._append_op is not None:  # the steps' append and attention in one call
        counts = {e.key: e.count for e in prof.key_averages()}
        assert counts.get("fastverify::append_attention", 0) >= 2 * 5


def test_patched_generate_runs_while_the_loop_attention_is_switched_in(one_thread):
    """A patched generate called while another one holds the model under gqa_attention (a second thread, or a
    streamer that generates) runs the loop, not the fallback, and leaves the switch to its owner."""
    import warnings
    model = tiny_llama(vocab=97)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    patch(model)
    try:
        with gqa_attention(model), warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            assert model.config._attn_implementation == GQA_ATTENTION
    finally:
        unpatch(model)
    assert torch.equal(got, want) and model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------
# eager attention: a modeling file's eager_attention_forward through masked_attention while the loop runs

def _modeling_file(name, eager):
    """A stand-in modeling file ``name`` whose ``eager_attention_forward`` is ``eager``, and an attention class of it."""
    import sys
    import types
    mod = types.ModuleType(name)
    mod.eager_attention_forward = eager
    sys.modules[name] = mod
    cls = type("FileAttention", (_Attn,), {"__module__": name})
    return mod, cls


def _gemma2_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   softcap=softcap, **kwargs)


@pytest.mark.usefixtures("loop_thread")
@pytest.mark.parametrize("q", [1, 5, attention.MASKED_ATTENTION_ROWS + 1])
def test_eager_rows_take_the_soft_cap_and_sinks_to_masked_attention(q):
    """Gemma 2's soft cap and gpt-oss's sinks (transformers' own eager functions) go to masked_attention with the
    variant, to float32 rounding of the file's function; more rows than MASKED_ATTENTION_ROWS go to the file's
    function bit for bit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    query, key, value, mask = _inputs(2, 2, 3, q, 30, 32)
    query = query * 3
    for name, eager, kwargs in (("fv_test_gemma2", _gemma2_eager, dict(softcap=2.0)),
                                ("fv_test_gpt_oss", gpt_oss_eager, {})):
        _, cls = _modeling_file(name, eager)
        module = cls(3)
        module.sinks = torch.randn(6) + 4 if name == "fv_test_gpt_oss" else None
        if module.sinks is not None:
            kwargs = dict(s_aux=module.sinks)
        want, _ = eager(module, query, key, value, mask, scaling=0.2, dropout=0.0, **kwargs)
        got, weights = attention._eager_rows(module, query, key, value, mask, scaling=0.2, dropout=0.0, **kwargs)
        assert got.shape == want.shape == (2, q, 6, 32)
        if q > attention.MASKED_ATTENTION_ROWS or attention._masked_attention_op() is None:
            assert torch.equal(got, want)
            continue
        op = torch.ops.fastverify.masked_attention(query, key, value, mask, 0.2, True, kwargs.get("softcap", 0.0),
                                                   module.sinks)
        assert weights is None and torch.equal(got, op.transpose(1, 2))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        plain = torch.ops.fastverify.masked_attention(query, key, value, mask, 0.2).transpose(1, 2)
        assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)  # the variant is applied


@pytest.mark.usefixtures("loop_thread")
def test_eager_rows_keep_a_file_function_they_do_not_compute():
    """A modeling file whose eager attention holds more than its arguments show (here: its output doubled) keeps it:
    the first call finds the two apart, and that class runs its own function from then on."""
    def doubled(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return 2 * out.transpose(1, 2).contiguous(), None
    _, cls = _modeling_file("fv_test_doubled", doubled)
    query, key, value, mask = _inputs(1, 2, 2, 3, 20, 16)
    module = cls(2)
    for _ in range(2):
        got, _ = attention._eager_rows(module, query, key, value, mask, scaling=0.25, dropout=0.0)
        assert torch.equal(got, doubled(module, query, key, value, mask, scaling=0.25)[0])
    if attention._masked_attention_op() is not None:
        assert [v for k, v in attention._EAGER_AGREES.items() if k[0] is cls] == [False]


@pytest.mark.usefixtures("loop_thread")
def test_eager_rows_fall_back_to_the_calling_files_function():
    """A class whose own file has no eager function (a subclass defined elsewhere), called from a modeling file's
    code while that file's function is swapped: the fallback is the calling file's original function."""
    calls = []

    def own(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    mod, _ = _modeling_file("fv_test_caller", own)
    exec("def attend(module, *a, **k):\n    return eager_attention_forward(module, *a, **k)", mod.__dict__)
    elsewhere = type("Elsewhere", (_Attn,), {"__module__": "fv_test_no_such_file"})(2)
    query, key, value, mask = _inputs(1, 2, 2, attention.MASKED_ATTENTION_ROWS + 3, 10, 16)  # rows: the fallback
    with attention.module_globals([mod], "eager_attention_forward", attention._eager_rows):
        got, _ = mod.attend(elsewhere, query, key, value, mask, scaling=0.25, dropout=0.0)
    assert calls == [1] and torch.equal(got, own(elsewhere, query, key, value, mask, scaling=0.25)[0])
    with pytest.raises(RuntimeError, match="no eager_attention_forward found"):
        attention._eager_rows(elsewhere, query, key, value, mask, scaling=0.25)


def test_eager_attention_swaps_and_restores_the_files_function():
    """Within eager_attention(model) an eager model's modeling file calls _eager_rows; nested holds restore it once,
    when the last ends, and on error; an sdpa model's file is left alone."""
    import sys
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    own = mod.eager_attention_forward
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = model(ids).logits
        with attention.eager_attention(model) as n:
            assert n >= 1 and mod.eager_attention_forward is attention._eager_rows
            with attention.eager_attention(model):
                assert mod.eager_attention_forward is attention._eager_rows
            assert mod.eager_attention_forward is attention._eager_rows
            out = model(ids).logits
        assert mod.eager_attention_forward is own
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="inside"):
            with attention.eager_attention(model):
                raise RuntimeError("inside")
        assert mod.eager_attention_forward is own
        model.config._attn_implementation = "sdpa"
        with attention.eager_attention(model) as n:
            assert n == 0 and mod.eager_attention_forward is own


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_oss"])
def test_eager_models_draft_without_changing_a_bit(model_type, one_thread):
    """A Llama loaded with eager attention, Gemma 2 (soft cap) and gpt-oss (sinks): drafted decoding returns the
    undrafted loop's logits bit for bit, and greedy equals the model's own generate."""
    from conftest import assert_drafts_change_no_bit
    from fastverify.hf import DraftModelDrafter
    from test_hf_model_types import _prompts, tiny, PAD
    model = tiny(model_type, "eager")
    for B in (1, 3):
        ids, mask = _prompts(B)
        assert_drafts_change_no_bit(model, DraftModelDrafter(model, k=3, tree_topk=2), ids, attention_mask=mask,
                                    pad_token_id=PAD, max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("model_type", ["xglm", "gpt_neox_japanese", "codegen", "gptj"])
def test_own_attention_runs_masked_attention_and_restores(model_type, monkeypatch):
    """XGLM's, GPT-NeoX-Japanese's and (before transformers 5.24) CodeGen's and GPT-J's attention is their modeling
    files' own code (torch's bmm / baddbmm / matmul over the query rows). Within own_attention(model) each attention
    module runs its rows on masked_attention (the method of ``_OWN_ATTENTION`` bound on the instance): the model's
    logits its own attention's to float32 rounding, a cached step's rows each the same alone as beside others; a
    forward of more rows falls back to the class's own code, bit for bit; after the block (an error inside too) the
    instances are as they were."""
    from transformers import DynamicCache
    from fastverify.hf.linear import skinny_linears
    from test_hf_model_types import tiny
    model = tiny(model_type, "eager")
    table = attention._OWN_ATTENTION
    own = [m for m in model.modules() if (type(m).__module__, type(m).__qualname__) in table
           and hasattr(type(m), table[type(m).__module__, type(m).__qualname__][0])]
    if not own:
        pytest.skip(f"transformers {transformers.__version__}: {model_type}'s attention is transformers' functions")
    method = table[type(own[0]).__module__, type(own[0]).__qualname__][0]
    op, calls = attention._masked_attention_op(), []
    monkeypatch.setattr(attention, "_masked_attention_op", lambda: (lambda *a: calls.append(1) or op(*a)))
    g = torch.Generator().manual_seed(0)
    prompt, step = torch.randint(3, 60, (1, 9), generator=g), torch.randint(3, 60, (1, 5), generator=g)
    with torch.no_grad():
        ref = model(torch.cat([prompt, step], 1)).logits
        with attention.own_attention(model) as n:
            assert n == len(own) > 0 and all(method in m.__dict__ for m in own)
            out = model(torch.cat([prompt, step], 1)).logits
            assert len(calls) == len(own)
        rows = []  # the step's rows after a cached prompt, the layers on the skinny kernels: all five, each alone
        with attention.own_attention(model), skinny_linears(model):
            calls.clear()
            for cut in (None, 0, 1, 2, 3, 4):
                kw = attention.cache_kwargs(model, DynamicCache(config=model.config))
                model(prompt, **kw)
                if cut:  # the rows before it in the cache first, one call
                    model(step[:, :cut], **kw)
                rows.append(model(step if cut is None else step[:, cut:cut + 1], **kw).logits)
            assert len(calls) == len(own) * 16  # every forward's attention: 6 prompts, 4 rows before, 6 steps
        assert not any(method in m.__dict__ for m in own)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for i in range(5):
            assert torch.equal(rows[1 + i][0, -1], rows[0][0, i]), i
        long = torch.randint(3, 60, (1, attention.MASKED_ATTENTION_ROWS + 1), generator=g)
        with attention.own_attention(model):
            calls.clear()
            twice = model(long).logits
            assert not calls  # more rows than masked_attention takes: the class's own code
        assert torch.equal(twice, model(long).logits)
        with pytest.raises(RuntimeError, match="inside"):
            with attention.own_attention(model):
                raise RuntimeError("inside")
        assert not any(method in m.__dict__ for m in own)


def test_polar_rows_rotate_each_position_as_alone():
    """Llama 4's rotary embedding before transformers 5.19 makes its angles a matmul's output transposed, and torch's
    polar keeps that layout: the complex product that rotates the queries then rounds a position by how many
    positions stand beside it. ``_polar_rows`` (Llama 4's file's ``torch.polar`` within own_attention, restored after)
    lays its output out position by position, and each position rotates as it does alone."""
    import sys
    from test_hf_model_types import tiny
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    g = torch.Generator().manual_seed(0)

    def rotated(x, pos, polar):  # as the 5.17 / 5.18 modeling file computes it
        angles = (inv_freq[None, :, None].expand(pos.shape[0], -1, 1) @ pos[:, None, :].float()).transpose(1, 2)
        freqs_cis = polar(torch.ones_like(angles), angles)
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_ * freqs_cis[:, :, None, :]).flatten(3)

    differ = {}
    for polar in (torch.polar, attention._polar_rows):
        differ[polar] = 0
        for T in (2, 5, 13, 17):
            pos, x = torch.arange(3 * T).view(3, T) * 7 + 11, torch.randn(3, T, 4, 16, generator=g)
            together = rotated(x, pos, polar)
            differ[polar] += sum(not torch.equal(together[b, i], rotated(x[b:b + 1, i:i + 1], pos[b:b + 1, i:i + 1],
                                                                          polar)[0, 0])
                                 for b in range(3) for i in range(T))
    assert differ[attention._polar_rows] == 0 and differ[torch.polar] > 0
    model = tiny("llama4_text")
    mod = sys.modules[type(model.model.rotary_emb).__module__]
    with attention.own_attention(model):
        assert mod.torch is attention._POLAR_TORCH and mod.torch.polar is attention._polar_rows
    assert mod.torch is torch


def test_gqa_sdpa_leaves_a_soft_cap_out_where_the_release_does():
    """transformers' sdpa function leaves a soft cap out before 5.21 (where Gemma 2 loads with sdpa) and refuses one
    from 5.21. ``_gqa_sdpa`` does as the installed release does: before 5.21 a float32 call with a soft cap runs
    masked_attention without it (the release's function's result to float32 rounding, the bits of a call without
    the cap); from 5.21 it reaches transformers' function, which raises."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    query, key, value, mask = _inputs(1, 2, 2, 5, 19, 16)
    module = _Attn(2)
    if attention._sdpa_drops_softcap():
        out, _ = _gqa_sdpa(module, query, key, value, mask, softcap=50.0)
        want, _ = sdpa_attention_forward(module, query, key, value, mask, softcap=50.0)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, _gqa_sdpa(module, query, key, value, mask)[0])
    else:
        with pytest.raises(ValueError, match="softcap"):
            _gqa_sdpa(module, query, key, value, mask, softcap=50.0)
