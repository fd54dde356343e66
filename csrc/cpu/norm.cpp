// CPU kernel of fastverify::rms_norm (schema and semantics: csrc/norm.cpp). Each step is the one torch's
// expression takes, in float32: x * x (what x.pow(2) computes), at::sum over the last dimension (what mean
// calls), / D and + eps (mean's division by the count; the scalar rounded to float32 as torch rounds it), 1 /
// sqrt (rsqrt: a correctly rounded root, then a correctly rounded quotient), then x * r and weight * (x * r).
// No step is a multiply followed by an add, so no contraction to a fused multiply-add can change a result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu/kernels.h"

namespace {

// Rows per task: below ~64K elements one thread does the whole call (a decode step's few rows).
int64_t grain_rows(int64_t D) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(D, 1)); }

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "x: expected a float32 CPU tensor [..., D], got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == D,
              "weight: expected a float32 CPU tensor of shape [", D, "] (x's last dimension), got ",
              weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps: expected a finite number >= 0, got ", eps);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() > 0) fastverify::cpu::rms_rows(xc.data_ptr<float>(), xc.numel() / D, D, wc.data_ptr<float>(), eps,
                                                y.data_ptr<float>());
  return y;
}

}  // namespace

namespace fastverify::cpu {

void rms_rows(const float* x, int64_t rows, int64_t D, const float* weight, double eps, float* y) {
  if (rows == 0 || D == 0) return;
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) {  // y: first the squares
    for (int64_t i = r0 * D; i < r1 * D; ++i) y[i] = x[i] * x[i];
  });
  const at::Tensor ss = at::sum(at::from_blob(y, {rows, D}, at::kFloat), {-1});  // torch's reduction, its order
  const float* sum = ss.data_ptr<float>();
  const float count = static_cast<float>(D), e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float mean = sum[r] / count;
      const float r_inv = 1.0f / std::sqrt(mean + e);
      const float* xr = x + r * D;
      float* yr = y + r * D;
      for (int64_t k = 0; k < D; ++k) yr[k] = weight[k] * (xr[k] * r_inv);
    }
  });
}

}  // namespace fastverify::cpu

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
}
