// Schema of the rotary embedding of the loop's decoder layers (kernel: csrc/cpu/rotary.cpp; reference: transformers'
// apply_rotary_pos_emb, one tensor at a time: fastverify/hf/layers.py).
//
//   rotary_embedding(x float32 [B, H, n, D], cos float32 [B or 1, H or 1, n or 1, D], sin (as cos)) -> float32
//                    [B, H, n, D]
//       x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]) (D even), bit for bit:
//       the two products rounded, then their sum (a negation is exact). One call instead of the five of the
//       expression (the lean layers' four, with roll), for q and k of a layer together. x may be a view (any
//       strides); the result is contiguous. Inference only (no autograd); CPU only: on a GPU the layer's own
//       ops run.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}
