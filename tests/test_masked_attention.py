"""fastverify.ops.attention.masked_attention: the cpp kernel (csrc/attention.h) against its reference, torch's
scaled_dot_product_attention with an additive mask and enable_gqa, on fresh random inputs: odd sizes, grouped and
plain heads, head dims on and off the AVX-512 path, masks per batch row or per head, views of a longer cache; a
query row's result independent of the other rows; clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

from fastverify import _ext
from fastverify.ops.attention import masked_attention

cpp = pytest.mark.skipif(not _ext.HAS_CPP, reason="cpp backend: fastverify._C is not built")
MIN = torch.finfo(torch.float32).min


def _case(B, Hkv, G, n, S, D, seed, per_head=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, n, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    visible = torch.rand(B, Hkv * G if per_head else 1, n, S, generator=g) < 0.6
    visible[..., 0] = True
    mask = torch.zeros(visible.shape).masked_fill(~visible, MIN)
    return q, k, v, mask


SHAPES = [(1, 3, 3, 1, 401, 64), (1, 3, 3, 5, 37, 64), (2, 2, 2, 7, 33, 16), (3, 1, 4, 16, 8, 32),
          (1, 2, 1, 3, 9, 80), (2, 3, 3, 2, 1000, 64), (1, 1, 1, 1, 1, 16), (2, 2, 3, 4, 50, 24), (1, 4, 2, 9, 130, 8),
          (2, 1, 1, 20, 19, 128), (1, 2, 5, 6, 17, 48)]


@cpp
@pytest.mark.parametrize("B,Hkv,G,n,S,D", SHAPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_cpp_matches_sdpa(B, Hkv, G, n, S, D, per_head):
    q, k, v, mask = _case(B, Hkv, G, n, S, D, seed=B * 7919 + n * 31 + S + D, per_head=per_head)
    for m in (mask, None):
        for scale in (None, 0.3):
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=True)
            got = masked_attention(q, k, v, m, scale=scale, backend="cpp")
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
            ref = masked_attention(q, k, v, m, scale=scale, backend="torch")
            assert torch.equal(ref, want)


@cpp
def test_cpp_reads_views_of_a_longer_cache_and_strided_queries():
    """The loop's keys and values are [B, H, length, D] views of longer buffers; its queries slices of q and k."""
    q, k, v, mask = _case(2, 3, 3, 4, 60, 64, seed=5)
    kbuf, vbuf = torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64)
    kbuf[:, :, :60], vbuf[:, :, :60] = k, v
    qk = torch.randn(2, 12, 4, 64)
    qk[:, :9] = q
    got = masked_attention(qk[:, :9], kbuf[:, :, :60], vbuf[:, :, :60], mask, backend="cpp")
    assert torch.equal(got, masked_attention(q, k, v, mask, backend="cpp"))
    # keys transposed in memory (not rows of D contiguous values): copied, same result
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(masked_attention(q, kt, v, mask, backend="cpp"), masked_attention(q, k, v, mask, backend="cpp"))


@cpp
@pytest.mark.parametrize("D", [64, 24])
def test_cpp_rows_do_not_depend_on_the_batch(D):
    """Each query row alone gives what it gives among the others, bit for bit (the loop's root row is computed the
    same whatever the draft's size)."""
    q, k, v, mask = _case(1, 3, 3, 11, 77, D, seed=11)
    together = masked_attention(q, k, v, mask, backend="cpp")
    for i in range(11):
        alone = masked_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], backend="cpp")
        assert torch.equal(alone, together[:, :, i:i + 1])


@cpp
@pytest.mark.parametrize("D", [64, 24])
@pytest.mark.parametrize("masked", [MIN, float("-inf")], ids=["finfo_min", "-inf"])
def test_cpp_row_depends_on_the_keys_it_sees_alone(D, masked):
    """A query row's result is a function of the keys it sees, in their order, bit for bit: masked keys between or
    after them (a verify forward's sibling and later draft rows) change nothing, so a draft row gives what the
    one-row forward over the committed path gives. Here each row against its visible keys gathered into a cache of
    their own."""
    g = torch.Generator().manual_seed(17)
    for S in (1, 7, 8, 9, 33, 300):
        q, k, v = torch.randn(1, 6, 5, D, generator=g), torch.randn(1, 2, S, D, generator=g) * 2, \
            torch.randn(1, 2, S, D, generator=g)
        visible = torch.rand(5, S, generator=g) < torch.tensor([1.0, 0.9, 0.5, 0.1, 0.02])[:, None]
        visible[:, 0] = True
        visible[4, max(1, S // 2):] = False  # a row whose keys end halfway (the rows after its own are masked)
        mask = torch.zeros(1, 1, 5, S).masked_fill(~visible, masked)
        together = masked_attention(q, k, v, mask, backend="cpp")
        for i in range(5):
            keep = visible[i].nonzero().flatten()
            alone = masked_attention(q[:, :, i:i + 1], k[:, :, keep], v[:, :, keep], None, backend="cpp")
            assert torch.equal(alone, together[:, :, i:i + 1]), (S, i)
            zeros = torch.zeros(1, 1, 1, keep.numel())  # an all-visible mask: the same as none
            assert torch.equal(masked_attention(q[:, :, i:i + 1], k[:, :, keep], v[:, :, keep], zeros,
                                                backend="cpp"), alone)


@cpp
@pytest.mark.parametrize("D", [64, 128, 48])
def test_cpp_long_rows_in_passes_of_bounded_scratch(D):
    """Many query rows over many keys run in passes of rows whose scores fit 1 MB (csrc/cpu/attention.cpp), and over
    more than 256 KB of keys the products go through the keys in chunks (csrc/attention.h): the same bits as each
    row alone (one pass, no chunks), and SDPA's result to float32 rounding."""
    q, k, v, mask = _case(1, 2, 3, 70, 1400, D, seed=29)
    got = masked_attention(q, k, v, mask, backend="cpp")
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                               rtol=1e-5, atol=3e-6)
    for i in (0, 61, 69):
        assert torch.equal(masked_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], backend="cpp"),
                           got[:, :, i:i + 1])


@cpp
def test_cpp_edge_rows():
    q, k, v, mask = _case(1, 2, 2, 3, 21, 16, seed=3)
    mask[0, 0, 1] = MIN  # a row that sees nothing (finfo.min everywhere): SDPA's uniform average
    mask[0, 0, 2, 5] = float("-inf")  # -inf next to finite entries: weight 0
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(masked_attention(q, k, v, mask, backend="cpp"), want, rtol=1e-5, atol=3e-6)
    q[0, 1, 0, 3] = float("nan")  # NaN propagates to that query head's row only, as in SDPA
    got = masked_attention(q, k, v, mask, backend="cpp")
    assert got[0, 1, 0].isnan().all() and not got[0, 0].isnan().any() and not got[0, 1, 1:].isnan().any()
    empty = masked_attention(q[:, :, :0], k, v, mask[:, :, :0], backend="cpp")
    assert empty.shape == (1, 4, 0, 16)


@cpp
@pytest.mark.parametrize("S", [5, 8, 21])
def test_cpp_rows_that_see_nothing_as_sdpa(S):
    """A query row masked by -inf at every key: SDPA gives it 0 (and its reference); so does the kernel, on each of
    its paths (scripts/test.sh runs this file under FASTVERIFY_NO_SIMD=1 and FASTVERIFY_NO_AVX512=1 too). A NaN in
    that row's query keeps it NaN; with a soft cap, eager attention's softmax gives the row NaN, as the reference."""
    q, k, v, mask = _case(2, 2, 3, 4, S, 16, seed=S)
    mask[0, 0, 1] = float("-inf")
    mask[1, 0, 3] = float("-inf")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(want[0, :, 1], torch.zeros(6, 16)) and torch.equal(want[1, :, 3], torch.zeros(6, 16))
    got = masked_attention(q, k, v, mask, backend="cpp")
    assert torch.equal(got[0, :, 1], want[0, :, 1]) and torch.equal(got[1, :, 3], want[1, :, 3])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    assert torch.equal(masked_attention(q, k, v, mask, backend="torch"), want)
    bad = q.clone()
    bad[0, 4, 1, 7] = float("nan")
    got = masked_attention(bad, k, v, mask, backend="cpp")
    ref = masked_attention(bad, k, v, mask, backend="torch")
    assert got[0, 4, 1].isnan().all() and torch.equal(got.isnan(), ref.isnan()) and got.isnan().sum() == 16
    for extra in ({"softcap": 20.0}, {"sinks": torch.randn(6)}):
        got = masked_attention(q, k, v, mask, backend="cpp", **extra)
        ref = masked_attention(q, k, v, mask, backend="torch", **extra)
        assert torch.equal(got.isnan(), ref.isnan()) and got[0, :, 1].isnan().all() == ("softcap" in extra)
        torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=3e-6)


@cpp
@pytest.mark.parametrize("D", [64, 24])
@pytest.mark.parametrize("per_head", [False, True])
def test_cpp_skip_masked_prefix_is_bit_for_bit_and_matches_its_reference(D, per_head):
    """Keys masked in every query row of a batch row (a left-padded prompt's padding, here 0, 37, 90 and all but
    one row's 140 keys) are not read with skip_masked_prefix: the result is the unskipped one, bit for bit, where
    they are finite, and the reference's (SDPA over the keys from the 16-aligned start) where they are not."""
    from fastverify.reference.attention import masked_prefix

    q, k, v, mask = _case(4, 3, 3, 6, 140, D, seed=21, per_head=per_head)
    for b, pad in enumerate((0, 37, 90, 140)):
        mask[b, :, :, :pad] = MIN
    mask[3, :, 2, 120] = 0.0  # batch row 3: one query row sees a key, the others none: nothing skipped
    assert masked_prefix(mask) == [0, 32, 80, 0]
    want = masked_attention(q, k, v, mask, backend="cpp")
    got = masked_attention(q, k, v, mask, backend="cpp", skip_masked_prefix=True)
    assert torch.equal(got, want)
    ref = masked_attention(q, k, v, mask, backend="torch", skip_masked_prefix=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=3e-6)
    for t, value in ((v, float("nan")), (k, float("inf"))):
        for where, read in (((2, 1, 5, 0), False), ((2, 1, 85, 0), True)):  # before / after the aligned start 80
            bad = t.clone()
            bad[where] = value
            args = (q, bad, v) if t is k else (q, k, bad)
            got = masked_attention(*args, mask, backend="cpp", skip_masked_prefix=True)
            ref = masked_attention(*args, mask, backend="torch", skip_masked_prefix=True)
            assert got[2].isnan().any() == read and torch.equal(got.isnan(), ref.isnan())
            torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=3e-6)
    nan_mask = mask.clone()
    nan_mask[2, ..., 40] = float("nan")  # a NaN mask entry is not a masked key: nothing from it on is skipped
    assert masked_prefix(nan_mask)[2] == 32
    got = masked_attention(q, k, v, nan_mask, backend="cpp", skip_masked_prefix=True)
    ref = masked_attention(q, k, v, nan_mask, backend="torch", skip_masked_prefix=True)
    assert torch.equal(got.isnan(), ref.isnan())
    for backend in ("torch", "cpp"):  # an empty batch, no query rows
        empty = masked_attention(q[:0], k[:0], v[:0], mask[:0], skip_masked_prefix=True, backend=backend)
        none = masked_attention(q[:, :, :0], k, v, mask[:, :, :0], skip_masked_prefix=True, backend=backend)
        assert empty.shape == (0,) + q.shape[1:] and none.shape == q.shape[:2] + (0, D)
    with pytest.raises(TypeError, match="skip_masked_prefix: expected a bool"):
        masked_attention(q, k, v, mask, skip_masked_prefix=1)


@cpp
@pytest.mark.parametrize("B,Hkv,G,n,S,D,Dv", [(1, 2, 3, 5, 41, 32, 16), (2, 1, 4, 3, 130, 192, 128),
                                             (1, 3, 1, 9, 17, 48, 24), (2, 2, 2, 1, 7, 24, 8),
                                             (1, 1, 2, 4, 20, 16, 64)])
def test_cpp_values_of_another_width(B, Hkv, G, n, S, D, Dv):
    """Latent attention's values are narrower than its keys (DeepSeek V2 / V3: 128 against 192): SDPA's result
    [B, Hq, n, Dv], each row still a function of its own mask row, and opcheck's schema and fake agree."""
    q, k, _, mask = _case(B, Hkv, G, n, S, D, seed=S + Dv)
    v = torch.randn(B, Hkv, S, Dv, generator=torch.Generator().manual_seed(Dv))
    for m in (mask, None):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        got = masked_attention(q, k, v, m, backend="cpp")
        assert got.shape == (B, Hkv * G, n, Dv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
        assert torch.equal(masked_attention(q, k, v, m, backend="torch"), want)
    together = masked_attention(q, k, v, mask, backend="cpp")
    for i in range(n):
        alone = masked_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], backend="cpp")
        assert torch.equal(alone, together[:, :, i:i + 1])
    vbuf = torch.randn(B, Hkv, S + 5, Dv)
    vbuf[:, :, :S] = v
    assert torch.equal(masked_attention(q, k, vbuf[:, :, :S], mask, backend="cpp"), together)
    torch.library.opcheck(torch.ops.fastverify.masked_attention.default, (q, k, v, mask, 0.25, True),
                          test_utils=("test_schema", "test_faketensor"))


@cpp
@pytest.mark.parametrize("B,Hkv,G,n,S,D", [(1, 2, 2, 5, 41, 32), (2, 1, 3, 1, 300, 64), (1, 3, 1, 7, 17, 24),
                                         (2, 2, 2, 3, 9, 16)])
@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (None, True), (2.5, True)])
@pytest.mark.parametrize("per_head", [False, True])
def test_cpp_soft_cap_and_sinks(B, Hkv, G, n, S, D, softcap, with_sinks, per_head):
    """Eager attention's two variants: Gemma 2's soft cap on the scores and gpt-oss's sink logit per head, against
    the reference's eager steps; each row a function of its own mask row, a masked prefix skipped bit for bit."""
    q, k, v, mask = _case(B, Hkv, G, n, S, D, seed=S * 3 + n, per_head=per_head)
    q = q * 4  # scores past the cap
    sinks = torch.randn(Hkv * G, generator=torch.Generator().manual_seed(S)) * 2 + 6 if with_sinks else None
    mask[..., : S // 3] = MIN  # a prefix every row masks
    for m in (mask, None):
        for skip in ((False, True) if m is not None else (False,)):
            got = masked_attention(q, k, v, m, backend="cpp", softcap=softcap, sinks=sinks, skip_masked_prefix=skip)
            want = masked_attention(q, k, v, m, backend="torch", softcap=softcap, sinks=sinks,
                                    skip_masked_prefix=skip)
            assert got.shape == want.shape == (B, Hkv * G, n, D)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    plain = masked_attention(q, k, v, mask, backend="cpp")
    together = masked_attention(q, k, v, mask, backend="cpp", softcap=softcap, sinks=sinks)
    assert not torch.allclose(together, plain, rtol=1e-2, atol=1e-2)  # the variants change the result
    assert torch.equal(together, masked_attention(q, k, v, mask, backend="cpp", softcap=softcap, sinks=sinks,
                                                  skip_masked_prefix=True))
    for i in range(n):
        alone = masked_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], backend="cpp", softcap=softcap,
                                 sinks=sinks)
        assert torch.equal(alone, together[:, :, i:i + 1])
    torch.library.opcheck(torch.ops.fastverify.masked_attention.default,
                          (q, k, v, mask, 0.25, True, softcap or 0.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))


@cpp
def test_cpp_sink_of_a_fully_masked_row_and_a_dominant_sink():
    """A row that sees no key (finfo.min everywhere) gives zeros beside a sink, as eager attention does; a sink far
    above the scores takes nearly all the weight."""
    q, k, v, mask = _case(1, 1, 2, 2, 10, 16, seed=3)
    mask[:, :, 0] = MIN
    sinks = torch.tensor([0.0, 80.0])
    got = masked_attention(q, k, v, mask, backend="cpp", sinks=sinks)
    want = masked_attention(q, k, v, mask, backend="torch", sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    assert torch.equal(got[0, :, 0], torch.zeros(2, 16)) and float(got[0, 1].abs().max()) < 1e-20


def test_bad_input_is_refused():
    q, k, v, mask = _case(1, 2, 2, 3, 10, 16, seed=1)
    with pytest.raises(ValueError, match="multiple of the key / value heads"):
        masked_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="k, v: expected"):
        masked_attention(q, k, v[:, :, :9])
    with pytest.raises(ValueError, match="k, v: expected"):
        masked_attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="k, v: expected"):
        masked_attention(q, k, v[..., :0])
    with pytest.raises(ValueError, match="mask: expected"):
        masked_attention(q, k, v, mask[..., :9])
    with pytest.raises(ValueError, match="mask: expected"):
        masked_attention(q, k, v, mask.expand(1, 3, 3, 10))
    with pytest.raises(ValueError, match="at least one key"):
        masked_attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(TypeError, match="one dtype"):
        masked_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="4-D"):
        masked_attention(q[0], k, v)
    for cap in (0.0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="softcap: expected"):
            masked_attention(q, k, v, softcap=cap)
    with pytest.raises(ValueError, match=r"sinks: expected \[Hq = 4\]"):
        masked_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks: expected a tensor"):
        masked_attention(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(TypeError, match="one dtype"):
        masked_attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))
    if _ext.HAS_CPP:
        with pytest.raises(TypeError, match="float32 CPU"):
            masked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="cpp")
        with pytest.raises(RuntimeError, match="multiple of the key / value heads"):
            torch.ops.fastverify.masked_attention(q[:, :3], k, v, None, 0.25)
        with pytest.raises(RuntimeError, match="k, v: expected"):
            torch.ops.fastverify.masked_attention(q, k, v[:, :, :9], None, 0.25)
        with pytest.raises(RuntimeError, match="sinks: expected a float32 CPU tensor"):
            torch.ops.fastverify.masked_attention(q, k, v, None, 0.25, False, 0.0, torch.zeros(3))
        with pytest.raises(RuntimeError, match="softcap: expected"):
            torch.ops.fastverify.masked_attention(q, k, v, None, 0.25, False, -2.0, None)


needs_append = pytest.mark.skipif(_ext.compiled_op("append_attention") is None,
                                  reason="fastverify._C has no append_attention")


@needs_append
@pytest.mark.parametrize("B, Hkv, G, n, start, cap", [(1, 3, 3, 1, 40, 64), (2, 2, 2, 5, 17, 30), (1, 1, 4, 16, 0, 16)])
def test_append_attention_is_the_append_then_masked_attention_bit_for_bit(B, Hkv, G, n, start, cap):
    """k / v written to rows [start, start + n) of the caches (the other rows untouched), then masked_attention over
    the first start + n rows with skip_masked_prefix, transposed to [B, n, Hq, D] as transformers' attention returns."""
    g = torch.Generator().manual_seed(B * 100 + n + start)
    D = 16
    q = torch.randn(B, Hkv * G, n, D, generator=g)
    k, v = torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    kc, vc = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
    mask = torch.zeros(B, 1, n, start + n)
    mask[..., :start // 2] = torch.finfo(torch.float32).min  # a masked prefix, as a left-padded prompt's
    mask[..., start:] = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, :, start:start + n], want_v[:, :, start:start + n] = k, v
    want = torch.ops.fastverify.masked_attention(q, want_k[:, :, :start + n], want_v[:, :, :start + n], mask, 0.25,
                                                 True).transpose(1, 2).contiguous()
    got = torch.ops.fastverify.append_attention(q, k, v, kc, vc, start, mask, 0.25)
    assert got.shape == (B, n, Hkv * G, D) and got.is_contiguous()
    assert torch.equal(got, want) and torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.library.opcheck(torch.ops.fastverify.append_attention.default, (q, k, v, kc, vc, start, mask, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


@needs_append
def test_append_attention_bad_input_names_the_argument():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    kc, vc = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    op = torch.ops.fastverify.append_attention
    with pytest.raises(RuntimeError, match="start: expected 0 <= start and start \\+ n <= C = 4"):
        op(q, k, v, kc, vc, 4, torch.zeros(1, 1, 1, 5), 1.0)
    with pytest.raises(RuntimeError, match="k_cache, v_cache: expected"):
        op(q, k, v, kc, torch.zeros(1, 1, 5, 8), 0, torch.zeros(1, 1, 1, 1), 1.0)
    with pytest.raises(RuntimeError, match="k: expected a 4-D float32 CPU tensor"):
        op(q, k.double(), v, kc, vc, 0, torch.zeros(1, 1, 1, 1), 1.0)
    with pytest.raises(RuntimeError, match="mask: expected"):
        op(q, k, v, kc, vc, 0, torch.zeros(1, 1, 1, 3), 1.0)
