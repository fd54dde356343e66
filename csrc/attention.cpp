// Schema of the masked attention (kernel: csrc/cpu/attention.cpp over csrc/attention.h; reference:
// fastverify/reference/attention.py; Python API: fastverify/ops/attention.py).
//
//   masked_attention(q float32 [B, Hq, n, D], k float32 [B, Hkv, S, D], v float32 [B, Hkv, S, D],
//                    mask float32 [B, 1 or Hq, n, S] or None, scale) -> float32 [B, Hq, n, D]
//       softmax(q k^T * scale + mask) v, query head h reading key / value head h / (Hq / Hkv): torch's
//       scaled_dot_product_attention with an additive mask and enable_gqa, for a few query rows (a verify
//       forward's), to float32 rounding. k and v may be views of a longer cache (rows of D contiguous values).
//       CPU only.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("masked_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
