// CPU kernel of fastverify::skinny_linear (schema: csrc/linear.cpp; arithmetic: csrc/linear.h). Output columns are
// split across threads in blocks of 4 weight rows; each thread streams its share of the weight once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear.h"

namespace {

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x, weight: expected CPU tensors, got ", x.device(),
              " and ", weight.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: expected float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight: expected float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "weight: expected [N, K], got shape ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1, "x: expected [..., K], got a 0-d tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "x: last dimension ", x.size(-1), " must equal weight's K = ", K);
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == N,
                "bias: expected a CPU float32 tensor of shape [", N, "], got ", b.scalar_type(), " ", b.sizes(),
                " on ", b.device());
    bias_ptr = b.data_ptr<float>();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (y.numel() == 0) return y;
  if (K == 0) return bias_ptr ? y.copy_(b.expand(out_shape)) : y.zero_();
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Blocks of 4 weight rows; a thread's share is at least ~64K weights so that small layers stay on one thread.
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (4 * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    fastverify::linear::skinny_rows(xp, wp, bias_ptr, yp, M, K, N, 4 * b0, std::min(N, 4 * b1));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }
