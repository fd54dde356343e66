"""fastverify.hf.experts: transformers' experts modules through the skinny kernels while the loop runs. The forward
against transformers' own batched_mm implementation (float32 rounding), a row's result independent of the rows
beside it, the implementation switched for the loop and restored after it."""

import warnings

import pytest
import torch

from fastverify.hf import NGramDrafter, patch, stats, unpatch
from fastverify.hf.experts import EXPERTS_IMPLEMENTATION, skinny_experts, skinny_experts_forward
from fastverify.hf.linear import MAX_ROWS, skinny_available

pytestmark = pytest.mark.skipif(not skinny_available(), reason="cpp backend: fastverify._C has no skinny kernels")

moe = pytest.importorskip("transformers.integrations.moe")

from test_hf_model_types import tiny  # noqa: E402


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def _found(modules, model_type, what):
    """``modules``, or a skip where the installed transformers builds ``model_type`` without such modules (Aria
    before 5.18: experts and router of its own)."""
    if not modules:
        import transformers
        pytest.skip(f"transformers {transformers.__version__} builds {model_type} without an {what}")
    return modules


def _routing(tokens, k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "aria_text"])  # aria: weights stored [in, out]
@pytest.mark.parametrize("tokens", [1, 5, 17, MAX_ROWS + 3])  # past MAX_ROWS rows an expert: F.linear
def test_forward_matches_transformers_batched_mm(model_type, tokens):
    module = _found(_experts(tiny(model_type)), model_type, "experts module")[0]
    num_experts = module.gate_up_proj.shape[0]
    k = min(2, num_experts)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, module.gate_up_proj.shape[1 if module.is_transposed else 2], generator=g)
    index, weights = _routing(tokens, k, num_experts, tokens)
    with torch.no_grad():
        mine = skinny_experts_forward(module, x, index, weights)
        ref = moe.batched_mm_experts_forward(module, x, index, weights)
    assert mine.shape == ref.shape and mine.dtype == ref.dtype
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    if tokens <= MAX_ROWS:  # each token's row alone gives its row of the batch, bit for bit
        for t in (0, tokens - 1):
            with torch.no_grad():
                alone = skinny_experts_forward(module, x[t:t + 1], index[t:t + 1], weights[t:t + 1])
            assert torch.equal(alone[0], mine[t])


def test_forward_in_float64_and_with_gradients_takes_f_linear():
    module = _experts(tiny("mixtral"))[0]
    index, weights = _routing(3, 2, module.gate_up_proj.shape[0], 0)
    x = torch.randn(3, module.gate_up_proj.shape[2])
    ref = moe.batched_mm_experts_forward(module, x, index, weights)
    out = skinny_experts_forward(module, x, index, weights)  # gradients on: torch's path, differentiable
    assert out.requires_grad
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    module.double()
    with torch.no_grad():
        out = skinny_experts_forward(module, x.double(), index, weights.double())
        ref = moe.batched_mm_experts_forward(module, x.double(), index, weights.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref)


def test_implementation_switched_for_the_loop_and_restored():
    model = tiny("qwen3_moe")
    cfg = _experts(model)[0].config
    before = cfg._experts_implementation
    with skinny_experts(model) as n:
        assert n >= 1 and cfg._experts_implementation == EXPERTS_IMPLEMENTATION
    assert cfg._experts_implementation == before
    seen = []
    real = moe.ALL_EXPERTS_FUNCTIONS[EXPERTS_IMPLEMENTATION]
    moe.ALL_EXPERTS_FUNCTIONS._global_mapping[EXPERTS_IMPLEMENTATION] = (
        lambda *a, **kw: seen.append(1) or real(*a, **kw))
    try:
        patch(model, drafter=NGramDrafter())
        ids = torch.randint(3, 60, (1, 12))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
        assert seen and stats(model).steps > 0  # the loop's forwards ran the experts through it
    finally:
        moe.ALL_EXPERTS_FUNCTIONS._global_mapping[EXPERTS_IMPLEMENTATION] = real
        unpatch(model)
    assert cfg._experts_implementation == before
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type,name", [("qwen3_moe", "F"), ("aria_text", "nn")])
def test_routers_files_bound_to_the_row_functions_and_restored(model_type, name):
    """A router's modeling file has ``F`` (Qwen3-MoE) or ``nn`` (Aria: ``nn.functional.linear``) bound to the
    proxies whose ``linear`` takes few float32 rows to skinny_linear, within skinny_experts, nested ones too; the
    router's logits are then the kernel's, row-aligned; restored after."""
    import sys
    from fastverify.hf import experts
    model = tiny(model_type)
    router = _found([m for m in model.modules() if type(m).__name__.lower().endswith("router")], model_type,
                    "router module")[0]
    mod = sys.modules[type(router).__module__]
    before = getattr(mod, name)
    proxy = experts._ROW_F if name == "F" else experts._ROW_NN
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad(), skinny_experts(model):
        with skinny_experts(model):
            assert getattr(mod, name) is proxy
        assert getattr(mod, name) is proxy
        outputs = router(x)
    assert getattr(mod, name) is before
    # the router's logits, [5, experts] (Aria returns them last before transformers 5.21, first from it)
    logits, = [t for t in outputs if t.is_floating_point() and t.shape == (5, router.weight.shape[0])]
    if experts.skinny_available():
        assert torch.equal(logits, torch.ops.fastverify.skinny_linear(x, router.weight, None))
        assert logits.stride(0) == 32  # fewer than 32 experts: row-aligned
        assert proxy.softmax is torch.nn.functional.softmax if name == "F" else proxy.Linear is torch.nn.Linear


def test_seeded_sampling_drafts_on_a_mixture_of_experts_model():
    """Its forwards are row-invariant now, so the probe's check passes and sampled calls draft: the draws those of the
    loop's own undrafted sampling with the seed."""
    from fastverify.hf import Drafter
    model = tiny("mixtral")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 60, (4,), generator=g).repeat(6)[None]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=True, temperature=0.3, seed=7,
              pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "sampling without drafts" warning
        patch(model, drafter=Drafter())
        ref = model.generate(ids, **kw)
        patch(model, drafter=NGramDrafter())
        out = model.generate(ids, **kw)
    st = stats(model)
    unpatch(model)
    assert torch.equal(out, ref) and st.drafted_tokens > 0


def test_experts_of_a_files_own_code_on_the_kernels_and_restored():
    """DBRX's expert GLU (``x.matmul`` of its expert's weights) runs ``_glu_rows`` within skinny_experts, nested ones
    too, and its own forward after; on float32 rows its output is the kernels' bits (act(x w1^T) * x v1^T, then
    skinny_linear_t by w2) and its own forward's to float32 rounding. JetMoE's and LongCat-Flash's files, whose experts
    call ``F.linear`` per expert, have ``F`` bound to the row proxy, then restored."""
    import sys
    from fastverify.hf import experts
    model = tiny("dbrx")
    glu = [m for m in model.modules() if type(m).__name__ == "DbrxExpertGLU"][0]
    ffn = glu.w1.shape[0] // glu.moe_num_experts
    w1, v1, w2 = (getattr(glu, n).view(-1, ffn, glu.hidden_size)[1] for n in ("w1", "v1", "w2"))
    x = torch.randn(5, glu.hidden_size)
    with torch.no_grad():
        want = glu(x, w1, v1, w2)
        with skinny_experts(model):
            with skinny_experts(model):
                assert glu.forward.__func__.__wrapped__ is experts._glu_rows
            assert glu.forward.__func__.__wrapped__ is experts._glu_rows
            got = glu(x, w1, v1, w2)
        assert "forward" not in glu.__dict__
        ops = torch.ops.fastverify
        h = glu.activation_fn(ops.skinny_linear(x, w1, None)) * ops.skinny_linear(x, v1, None)
    assert torch.equal(got, ops.skinny_linear_t(h, w2, None))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for model_type in ("jetmoe", "longcat_flash"):
        model = tiny(model_type)
        mod = sys.modules[type(model).__module__]
        before = mod.F
        with skinny_experts(model):
            assert mod.F is experts._ROW_F
        assert mod.F is before is torch.nn.functional


def test_llama4_experts_and_router_on_the_kernels_and_restored():
    """Llama 4's experts (``torch.bmm`` over each expert's rows) and router (``nn.Linear.forward``, then the sigmoid of
    the top k) run ``_bmm_experts_rows`` / ``_router_rows`` within skinny_experts and their own forwards after. On
    float32 rows their outputs are the kernels' bits, each row the same alone as beside others, and their own
    forwards' to float32 rounding."""
    from fastverify.hf import experts
    model = tiny("llama4_text")
    moe = [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"][0]
    ex, router = moe.experts, moe.router
    E = ex.gate_up_proj.shape[0]
    x = torch.randn(5, ex.hidden_size)
    routed = torch.randn(E * 5, ex.hidden_size)
    with torch.no_grad():
        want_scores, want_logits = router(x)
        want = ex(routed)
        with skinny_experts(model):
            assert ex.forward.__func__.__wrapped__ is experts._bmm_experts_rows
            assert router.forward.__func__.__wrapped__ is experts._router_rows
            scores, logits = router(x)
            got = ex(routed)
            one_scores, one_logits = router(x[3:4])
            one = ex(routed.view(E, 5, -1)[:, 3].contiguous())
        assert "forward" not in ex.__dict__ and "forward" not in router.__dict__
        ops = torch.ops.fastverify
        assert torch.equal(logits, ops.skinny_linear(x, router.weight, None))
        per_expert = []
        for e, rows in enumerate(routed.view(E, 5, -1)):
            gate, up = ops.skinny_linear_t(rows, ex.gate_up_proj[e], None).chunk(2, dim=-1)
            per_expert.append(ops.skinny_linear_t(up * ex.act_fn(gate), ex.down_proj[e], None))
    assert torch.equal(got, torch.cat(per_expert))
    assert torch.equal(one_logits, logits[3:4]) and torch.equal(one_scores, scores[3:4])
    assert torch.equal(one, got.view(E, 5, -1)[:, 3])
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kolibri_router_on_the_kernels_and_restored():
    """Kolibri's router (the sigmoid of its logits gathered at the top k, a tensor method on a new contiguous tensor)
    runs ``_gathered_router_rows`` within skinny_experts and its own forward after: its logits the kernel's bits, the
    same choices, its scores each row's alone, and its own forward's to float32 rounding."""
    from fastverify.hf import experts
    model = tiny("kolibri1")
    router = [m for m in model.modules() if type(m).__name__ == "Kolibri1TopKRouter"][0]
    torch.manual_seed(0)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.randn_like(router.e_score_correction_bias) * 0.1)
        x = torch.randn(1, 40, router.hidden_dim)  # [batch, tokens, hidden], as the MoE block hands it: 80 scores
        want_logits, want_scores, want_index = router(x)
        with skinny_experts(model):
            assert router.forward.__func__.__wrapped__ is experts._gathered_router_rows
            logits, scores, index = router(x)
            alone = [router(x[:, i:i + 1]) for i in range(40)]
        assert "forward" not in router.__dict__
    assert torch.equal(logits, torch.ops.fastverify.skinny_linear(x[0], router.weight, None))
    assert torch.equal(index, want_index)
    for i, (l, s, k) in enumerate(alone):
        assert torch.equal(l, logits[i:i + 1]) and torch.equal(s, scores[i:i + 1]) and torch.equal(k, index[i:i + 1])
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)


def test_aria_grouped_gemm_on_the_kernels_before_5_18():
    """Aria's experts before transformers 5.18 are its own code: ``AriaGroupedExpertsGemm``, each expert's rows
    (sorted by expert) through ``torch.matmul``. Within skinny_experts they run ``_grouped_gemm_rows``: each expert's
    rows the kernel's bits, each row the same alone as beside the others, the class's own forward to float32
    rounding, and more than MAX_ROWS rows for one expert back on the class's own forward; restored after."""
    from fastverify.hf import experts
    model = tiny("aria_text")
    gemm = _found([m for m in model.modules() if type(m).__name__ == "AriaGroupedExpertsGemm"], "aria_text",
                  "AriaGroupedExpertsGemm")[0]
    E = gemm.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5] + [2] * (E - 3))
    x = torch.randn(int(counts.sum()), gemm.weight.shape[1], generator=g)
    with torch.no_grad():
        want = gemm(x, counts)
        with skinny_experts(model):
            assert gemm.forward.__func__.__wrapped__ is experts._grouped_gemm_rows
            got = gemm(x, counts)
            alone = [gemm(x[i:i + 1], (torch.arange(E) == e).long()) for i, e in
                     enumerate(torch.repeat_interleave(torch.arange(E), counts).tolist())]
            many = torch.zeros(E, dtype=torch.long)
            many[1] = MAX_ROWS + 1
            big = torch.randn(MAX_ROWS + 1, gemm.weight.shape[1], generator=g)
            assert torch.equal(gemm(big, many), type(gemm).forward(gemm, big, many))
        assert "forward" not in gemm.__dict__
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            assert torch.equal(got[start:start + n],
                               torch.ops.fastverify.skinny_linear_t(x[start:start + n], gemm.weight[e], None))
        start += n
    for i, row in enumerate(alone):
        assert torch.equal(row, got[i:i + 1]), i
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
