// CPU kernel of fastverify::rms_norm (schema and semantics: csrc/norm.cpp). Each step is the one torch's
// expression takes, in float32: x * x (what x.pow(2) computes), at::sum over the last dimension (what mean
// calls), / D and + eps (mean's division by the count; the scalar rounded to float32 as torch rounds it), 1 /
// sqrt (rsqrt: a correctly rounded root, then a correctly rounded quotient), then x * r and weight * (x * r).
// No step is a multiply followed by an add, so no contraction to a fused multiply-add can change a result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

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
  if (xc.numel() == 0) return y;
  const int64_t rows = xc.numel() / D;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();  // first the squares, then (row by row, after the sums) the result
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * D; i < r1 * D; ++i) yp[i] = xp[i] * xp[i];
  });
  const at::Tensor ss = at::sum(y, {-1}, /*keepdim=*/true);  // torch's reduction, torch's order
  const float* sum = ss.data_ptr<float>();
  const float count = static_cast<float>(D), e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float mean = sum[r] / count;
      const float r_inv = 1.0f / std::sqrt(mean + e);
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      for (int64_t k = 0; k < D; ++k) yr[k] = wp[k] * (xr[k] * r_inv);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
}
