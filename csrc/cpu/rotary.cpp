// CPU kernel of fastverify::rotary_embedding (schema and semantics: csrc/rotary.cpp). Per row of D values:
// out[d] = x[d] * cos[d] + (-x[d + D/2]) * sin[d] for d < D/2 and x[d] * cos[d] + x[d - D/2] * sin[d] above, each
// product rounded to float32 before the sum, as torch's three ops round them: contraction of a product and the sum
// into one fused multiply-add (GCC's default where the target has FMA, as AArch64 always does) is switched off
// for this file's functions (tests/test_rotary.py compares with torch bit for bit).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/kernels.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

at::Tensor rotary_embedding_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4, name,
                ": expected a 4-D float32 CPU tensor, got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  const int64_t D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "x: expected an even last dimension (the rotated pairs), got ", D);
  TORCH_CHECK(sin.sizes() == cos.sizes(), "cos, sin: expected the same shape, got ", cos.sizes(), " and ",
              sin.sizes());
  for (int64_t i = 0; i < 4; ++i)
    TORCH_CHECK(cos.size(i) == x.size(i) || (i < 3 && cos.size(i) == 1), "cos, sin: expected a shape that "
                "broadcasts to x's ", x.sizes(), " (dimensions 0-2 of size 1 or x's, the last x's), got ", cos.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return y;
  // each row's D values contiguous (a view of q / k keeps them so); cos / sin broadcast: stride 0 where size 1
  const at::Tensor xv = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor cv = cos.stride(3) == 1 ? cos : cos.contiguous();
  const at::Tensor sv = sin.stride(3) == 1 ? sin : sin.contiguous();
  int64_t xs[3], cs[3], ss[3];
  for (int i = 0; i < 3; ++i) {
    xs[i] = xv.stride(i);
    cs[i] = cv.size(i) == 1 ? 0 : cv.stride(i);
    ss[i] = sv.size(i) == 1 ? 0 : sv.stride(i);
  }
  const int64_t H = x.size(1), n = x.size(2), rows = x.size(0) * H * n;
  const float* xp = xv.data_ptr<float>();
  const float* cp = cv.data_ptr<float>();
  const float* sp = sv.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / D);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * n), h = (r / n) % H, i = r % n;
      const float* xr = xp + b * xs[0] + h * xs[1] + i * xs[2];
      const float* c = cp + b * cs[0] + h * cs[1] + i * cs[2];
      const float* s = sp + b * ss[0] + h * ss[1] + i * ss[2];
      fastverify::cpu::rotate_row(xr, c, s, D, yp + r * D);
    }
  });
  return y;
}

}  // namespace

namespace fastverify::cpu {

void rotate_row(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * cos[d], rot = -x[d + half] * sin[d];
    y[d] = a + rot;
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = x[d] * cos[d], rot = x[d - half] * sin[d];
    y[d] = a + rot;
  }
}

}  // namespace fastverify::cpu

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding_cpu);
}
