// Schemas of the sampling ops (kernels: csrc/cpu/sampling.cpp, csrc/cuda/sampling.cu, kernels/sampling.py;
// reference: fastverify/reference/sampling.py; Python API: fastverify/ops/sampling.py).
//
//   uniform(seed int64 [R], position int64 [R], stream int64 [R]) -> float32 [R]
//       Philox 4x32-10, key = (seed low 32 bits, seed high 32 bits), counter = (position low, position high,
//       stream, 0); output word 0 -> ((x >> 9) + 0.5) * 2^-23, exact in float32, in [2^-24, 1 - 2^-24].
//       Streams must lie in [0, 2^32) (the CPU kernel checks; fastverify.uniform validates for every backend).
//       One stream per element lets verify draw every node's acceptance uniform (stream 1 + j) in one call.
//   verify_uniforms(seed int64 [B] or [1], position int64 [B], request int64 [M], offset int64 [M],
//                   stream int64 [M], rows) -> (float32 [rows], float32 [M - rows])
//       u[i] = uniform(seed[request[i]], position[request[i]] + offset[i], stream[i]), split after ``rows``:
//       verify's seeded draws (every logits row's u_sample, then every node's u_accept) in one call, from the
//       requests' seeds and positions and a layout that depends on the tree alone. A seed of one element is
//       every request's. The CPU kernel checks request in [0, B) and stream in [0, 2^32); the CUDA kernel
//       (which must not synchronise) clamps request into [0, B) and takes a stream's low 32 bits.
//   cdf_sample(logits [R, V], u float32/float64 [R], warp float32 [R, 4]) -> int64 [R]
//       smallest t with C(t) > u * Z, C the float64 prefix sum in token-id order of the warped weights
//       w = exp(l / T - m) over the kept tokens (warp = temperature, top_k, top_p, min_p as in verify).
//   cdf_invert(logits [R, V], token int64 [R], v float [R], warp float32 [R, 4]) -> float64 [R]
//       u = (C(t - 1) + v * w(t)) / Z, nudged by ulps so that cdf_sample(u) == t exactly; NaN where w(t) = 0.
//   aux_bits(u float32 [R]) -> float32 [R, 32]: the IEEE-754 bits of u, most significant first.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("uniform(Tensor seed, Tensor position, Tensor stream) -> Tensor");
  m.def("verify_uniforms(Tensor seed, Tensor position, Tensor request, Tensor offset, Tensor stream, int rows) "
        "-> (Tensor, Tensor)");
  m.def("cdf_sample(Tensor logits, Tensor u, Tensor warp) -> Tensor");
  m.def("cdf_invert(Tensor logits, Tensor token, Tensor v, Tensor warp) -> Tensor");
  m.def("aux_bits(Tensor u) -> Tensor");
}
