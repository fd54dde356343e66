// Schema of the skinny linear (kernel: csrc/cpu/linear.cpp over csrc/linear.h; reference: torch.nn.functional.linear;
// Python API: fastverify/ops/linear.py).
//
//   skinny_linear(x float32 [..., K], weight float32 or float16 [N, K], bias float32 [N] or None) -> float32 [..., N]
//       x @ weight^T + bias, for a few rows (a verify forward): the weight is streamed once whatever the number
//       of rows. A float16 weight is read as its exact float32 values (half the bytes; the result of its float32
//       copy, bit for bit). CPU only: on a GPU, cuBLAS already keeps small-M GEMMs bandwidth-bound.
//
//   skinny_linear_t(x float32 [..., K], weight float32 [K, N], bias float32 [N] or None) -> float32 [..., N]
//       x @ weight + bias: skinny_linear for a weight stored transposed, as transformers' Conv1D (GPT-2) holds it,
//       read in place. Each output one chain of fused multiply-adds over k in order (csrc/linear.h), so a row's
//       result does not depend on the other rows. CPU only.
//
//   skinny_linear_packed(x float32 [..., K], q uint8 [N, K * bits / 8], d float32 [N, K / 32], m float32 [N, K / 32],
//                        bits, bias float32 [N] or None) -> float32 [..., N]
//       skinny_linear with the weight w[n, k] = d[n, k / 32] * q[n, k] + m[n, k / 32] in its packed form
//       (csrc/linear.h, "Block-packed weights"; bits 4 or 8, K a multiple of 32; fastverify.ops.linear.pack_blocks
//       makes the tensors from a float32 weight of that form, and keeps none of another): the result of
//       skinny_linear on the float32 weight, bit for bit, streaming 0.75 (4 bits) or 1.25 (8 bits) bytes per weight
//       instead of 4.
//
//   pack_blocks(weight float32 [N, K]) -> (q uint8, d float32 [N, K / 32], m float32 [N, K / 32], bits)
//       the packed form of a weight that is exactly 4- or 8-bit blocks (fastverify.reference.linear.pack_blocks,
//       the specification: each block's scale and minimum found as a GGUF quantiser sets them, every weight
//       checked exactly); bits 0 and empty tensors for a weight of any other form (a non-finite value included).
//       K a multiple of 32. One pass over the weight (two for 8-bit blocks), instead of the reference's dozen
//       tensor passes.
//
//   gated_lora_add_(y float32 [R, N] (mutated), x float32 [R, K], index int64 [n], A float32 [r, K],
//                   B float32 [N, r], scale) -> ()
//       y[index[i]] += scale * (x[index[i]] @ A^T) @ B^T for i < n, every other row of y untouched: a gated LoRA
//       adapter's update of its slot rows (fastverify/lora.py) in one call instead of a dozen small torch ops.
//       Inference only (no autograd); CPU only, like skinny_linear. Rounding differs from torch's matmuls; the
//       rows it touches are drafts, never verified outputs.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("skinny_linear_t(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("skinny_linear_packed(Tensor x, Tensor q, Tensor d, Tensor m, int bits, Tensor? bias) -> Tensor");
  m.def("pack_blocks(Tensor weight) -> (Tensor, Tensor, Tensor, int)");
  m.def("gated_lora_add_(Tensor(a!) y, Tensor x, Tensor index, Tensor A, Tensor B, float scale) -> ()");
}
