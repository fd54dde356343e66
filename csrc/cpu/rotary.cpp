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
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4, "x: expected a 4-D float32 CPU "
              "tensor, got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const int64_t D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "x: expected an even last dimension (the rotated pairs), got ", D);
  const int64_t A = x.size(0), H = x.size(1), n = x.size(2), rows = A * H * n;
  const fastverify::cpu::RotaryTables tables(cos, sin, A, H, n, D, "x's");
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return y;
  const at::Tensor xv = x.stride(3) == 1 ? x : x.contiguous();  // each row's D values contiguous
  const int64_t xs[3] = {xv.stride(0), xv.stride(1), xv.stride(2)};
  const float* xp = xv.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / D);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t a = r / (H * n), h = (r / n) % H, i = r % n;
      tables.rotate(xp + a * xs[0] + h * xs[1] + i * xs[2], a, h, i, yp + r * D);
    }
  });
  return y;
}

}  // namespace

namespace fastverify::cpu {

RotaryTables::RotaryTables(const at::Tensor& cos, const at::Tensor& sin, int64_t A, int64_t H, int64_t n,
                           int64_t D, const char* rows) {
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4, name, ": expected a 4-D "
                "float32 CPU tensor (the tables of ", rows, " rows), got ", t->scalar_type(), " ", t->sizes(), " on ",
                t->device());
  TORCH_CHECK(sin.sizes() == cos.sizes(), "cos, sin: expected the same shape, got ", cos.sizes(), " and ",
              sin.sizes());
  if (D < 0) {
    D = cos.size(3);
    TORCH_CHECK(D % 2 == 0, "cos: expected an even last dimension (the rotated pairs), got ", D);
  }
  const int64_t want[4] = {A, H, n, D};
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK(cos.size(i) == want[i] || (i < 3 && cos.size(i) == 1), "cos, sin: expected a shape that "
                "broadcasts to [", A, ", ", H, ", ", n, ", ", D, "] (", rows, " rows: dimensions 0-2 of size 1 or "
                "theirs, the last theirs), got ", cos.sizes());
  cos_ = cos.stride(3) == 1 ? cos : cos.contiguous();
  sin_ = sin.stride(3) == 1 ? sin : sin.contiguous();
  c_ = cos_.data_ptr<float>();
  s_ = sin_.data_ptr<float>();
  D_ = D;
  for (int i = 0; i < 3; ++i) {  // broadcast: stride 0 where of size 1
    cs_[i] = cos_.size(i) == 1 ? 0 : cos_.stride(i);
    ss_[i] = sin_.size(i) == 1 ? 0 : sin_.stride(i);
  }
}

void RotaryTables::rotate(const float* x, int64_t a, int64_t h, int64_t i, float* y) const {
  const float* cos = c_ + a * cs_[0] + h * cs_[1] + i * cs_[2];
  const float* sin = s_ + a * ss_[0] + h * ss_[1] + i * ss_[2];
  const int64_t half = D_ / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float p = x[d] * cos[d], rot = -x[d + half] * sin[d];
    y[d] = p + rot;
  }
  for (int64_t d = half; d < D_; ++d) {
    const float p = x[d] * cos[d], rot = x[d - half] * sin[d];
    y[d] = p + rot;
  }
}

}  // namespace fastverify::cpu

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding_cpu);
}
