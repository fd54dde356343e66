// Schema of the skinny linear (kernel: csrc/cpu/linear.cpp over csrc/linear.h; reference: torch.nn.functional.linear;
// Python API: fastverify/ops/linear.py).
//
//   skinny_linear(x float32 [..., K], weight float32 [N, K], bias float32 [N] or None) -> float32 [..., N]
//       x @ weight^T + bias, for a few rows (a verify forward): the weight is streamed once whatever the number
//       of rows. CPU only: on a GPU, cuBLAS already keeps small-M GEMMs bandwidth-bound.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}
