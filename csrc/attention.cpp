// Schema of the masked attention (kernel: csrc/cpu/attention.cpp over csrc/attention.h; reference:
// fastverify/reference/attention.py; Python API: fastverify/ops/attention.py).
//
//   masked_attention(q float32 [B, Hq, n, D], k float32 [B, Hkv, S, D], v float32 [B, Hkv, S, Dv],
//                    mask float32 [B, 1 or Hq, n, S] or None, scale) -> float32 [B, Hq, n, Dv]
//       softmax(q k^T * scale + mask) v, query head h reading key / value head h / (Hq / Hkv): torch's
//       scaled_dot_product_attention with an additive mask and enable_gqa, for the query rows of a verify forward
//       or a prompt's chunk, to float32 rounding; each row's result a function of the keys it sees alone (masked
//       keys change no bit; csrc/attention.h). k and v may be views of a longer cache (rows of D, Dv contiguous
//       values). Dv is D but for latent attention (DeepSeek V2 / V3's values narrower than their keys).
//       skip_masked_prefix: per batch row, the keys [0, 16 * floor(f / 16)) are not read, f the first key that
//       any of its query rows sees (mask above -1e30; none skipped if a row sees no key): a left-padded prompt's
//       padding. Their weight would be 0, so the result is the same bit for bit, unless they hold NaN or inf
//       (which SDPA's result would show). CPU only.
//       softcap (> 0; 0: none): the scores q k^T * scale become softcap * tanh(q k^T * scale / softcap) before the
//       mask (Gemma 2's eager attention). sinks float32 [Hq] (or None): query head h's softmax has one more logit,
//       sinks[h], in its maximum and its sum, with no value row (gpt-oss's attention sinks).
//
//   append_attention(q [B, Hq, n, D], k, v [B, Hkv, n, D], k_cache, v_cache [B, Hkv, C, D] (mutated), start, mask
//                    [B, 1 or Hq, n, start + n], scale) -> float32 [B, n, Hq, D]
//       A decoder layer's cache append and attention in one call (fastverify/hf/layers.py `_attend` on the loop's
//       buffered cache, fastverify/hf/attention.py): k and v written to rows [start, start + n) of the caches, then
//       masked_attention of q over their rows [0, start + n) with skip_masked_prefix, in the layout transformers'
//       attention functions return (transposed, contiguous). start + n <= C. CPU only, float32.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("masked_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool skip_masked_prefix=False, "
        "float softcap=0., Tensor? sinks=None) -> Tensor");
  m.def("append_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int start, "
        "Tensor mask, float scale) -> Tensor");
}
