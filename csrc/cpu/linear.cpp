// CPU kernels of fastverify::skinny_linear and skinny_linear_t (schema: csrc/linear.cpp; arithmetic: csrc/linear.h):
// output columns split across threads, each thread streaming its share of the weight once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/kernels.h"
#include "linear.h"

namespace {

// The bias as a float32 pointer (nullptr when there is none), checked: a CPU float32 tensor [N]; b holds it.
const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& b,
                          const char* name = "") {
  if (!bias.has_value()) return nullptr;
  b = bias->contiguous();
  TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == N, name,
              "bias: expected a CPU float32 tensor of shape [", N, "], got ", b.scalar_type(), " ", b.sizes(), " on ",
              b.device());
  return b.data_ptr<float>();
}

// x's shape [..., K] with N in place of K.
std::vector<int64_t> output_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}

// skinny_linear's and skinny_linear_t's common part: the checks (the weight [N, K], or [K, N] when `transposed`; a
// float16 one only where `half` allows it), the output, its empty / K = 0 cases, and the contiguous rows and weight
// that `run(x [M, K], weight, bias or nullptr, y [M, N], M, K, N)` computes on.
template <typename Run>
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        bool transposed, bool half, Run run) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x, weight: expected CPU tensors, got ", x.device(),
              " and ", weight.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: expected float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || (half && weight.scalar_type() == at::kHalf),
              half ? "weight: expected float32 or float16, got " : "weight: expected float32, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "weight: expected ", transposed ? "[K, N]" : "[N, K]", ", got shape ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1, "x: expected [..., K], got a 0-d tensor");
  const int64_t N = weight.size(transposed ? 1 : 0), K = weight.size(transposed ? 0 : 1);
  TORCH_CHECK(x.size(-1) == K, "x: last dimension ", x.size(-1), " must equal weight's K = ", K);
  at::Tensor b;
  const float* bias_ptr = checked_bias(bias, N, b);
  const std::vector<int64_t> out_shape = output_shape(x, N);
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (y.numel() == 0) return y;
  if (K == 0) return bias_ptr ? y.copy_(b.expand(out_shape)) : y.zero_();
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  run(xc.data_ptr<float>(), weight.contiguous(), bias_ptr, y.data_ptr<float>(), M, K, N);
  return y;
}

// Output columns split across threads in blocks of 4 weight rows; each thread streams its share of the weight once.
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return dense_linear(x, weight, bias, /*transposed=*/false, /*half=*/true,
                      [](const float* xp, const at::Tensor& wc, const float* bias_ptr, float* yp, int64_t M,
                         int64_t K, int64_t N) {
    // a thread's share is at least ~64K weights so that small layers stay on one thread
    const int64_t blocks = (N + 3) / 4, grain = std::max<int64_t>(1, (int64_t(1) << 16) / (4 * K));
    auto run = [&](const auto* wp) {
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        fastverify::linear::skinny_rows(xp, wp, bias_ptr, yp, M, K, N, 4 * b0, std::min(N, 4 * b1));
      });
    };
    if (wc.scalar_type() == at::kHalf) run(wc.data_ptr<at::Half>());
    else run(wc.data_ptr<float>());
  });
}

// skinny_linear_t: the weight stored [K, N] (x @ weight + bias). Output columns split across threads in bands of 64.
at::Tensor skinny_linear_t_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return dense_linear(x, weight, bias, /*transposed=*/true, /*half=*/false,
                      [](const float* xp, const at::Tensor& wc, const float* bias_ptr, float* yp, int64_t M,
                         int64_t K, int64_t N) {
    const float* wp = wc.data_ptr<float>();
    const int64_t bands = (N + 63) / 64, grain = std::max<int64_t>(1, (int64_t(1) << 16) / (64 * K));
    at::parallel_for(0, bands, grain, [&](int64_t b0, int64_t b1) {
      fastverify::linear::skinny_rows_t(xp, wp, bias_ptr, yp, M, K, N, 64 * b0, std::min(N, 64 * b1));
    });
  });
}

at::Tensor skinny_linear_packed_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                                    int64_t bits, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "x: expected a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: expected float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x: expected [..., K], got a 0-d tensor");
  const int64_t K = x.size(-1);
  const fastverify::cpu::PackedLinear w = fastverify::cpu::packed_linear(q, d, m, bits, bias, K, "");
  const std::vector<int64_t> out_shape = output_shape(x, w.N);
  at::Tensor y = at::empty(out_shape, x.options());
  if (y.numel() == 0) return y;
  if (K == 0) return w.bias ? y.copy_(w.b.expand(out_shape)) : y.zero_();
  const int64_t M = x.numel() / K;
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  fastverify::cpu::packed_rows(xc.data_ptr<float>(), M, w, y.data_ptr<float>());
  return y;
}

void gated_lora_add_cpu(at::Tensor& y, const at::Tensor& x, const at::Tensor& index, const at::Tensor& A,
                        const at::Tensor& B, double scale) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"y", y}, {"x", x}, {"A", A}, {"B", B}}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), name,
                ": expected a contiguous 2-D float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ",
                t.device());
  }
  const int64_t R = y.size(0), N = y.size(1), K = x.size(1), r = A.size(0);
  TORCH_CHECK(x.size(0) == R, "x: expected ", R, " rows (as y), got ", x.size(0));
  TORCH_CHECK(A.size(1) == K, "A: expected shape [r, K = ", K, "], got ", A.sizes());
  TORCH_CHECK(B.size(0) == N && B.size(1) == r, "B: expected shape [N = ", N, ", r = ", r, "], got ", B.sizes());
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1,
              "index: expected an int64 CPU tensor [n], got ", index.scalar_type(), " ", index.sizes());
  const at::Tensor idx_t = index.contiguous();
  const int64_t n = idx_t.numel();
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < R, "index: row ", idx[i], " is outside [0, ", R, ")");
  if (n == 0 || N == 0) return;
  std::vector<float> rows(n * K), t(n * r), d(n * N);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::copy(xp + idx[i] * K, xp + (idx[i] + 1) * K, rows.data() + i * K);
  if (r > 0 && K > 0)
    fastverify::linear::skinny_rows(rows.data(), A.data_ptr<float>(), nullptr, t.data(), n, K, r, 0, r);
  const float s = static_cast<float>(scale);
  for (float& v : t) v *= s;
  if (r > 0) fastverify::linear::skinny_rows(t.data(), B.data_ptr<float>(), nullptr, d.data(), n, r, N, 0, N);
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* yr = yp + idx[i] * N;
    const float* dr = d.data() + i * N;
    for (int64_t o = 0; o < N; ++o) yr[o] += dr[o];
  }
}

// One block's 32 weights as d * q + lo with 0 <= q < levels (q = round((w - lo) / d), half to even, as torch.round),
// checked exactly (d * q is exact in float32: d has a float16's 11 significant bits and q at most 8); q written to
// out. d == 0 fits a constant block (q = 0); d == inf fits nothing. No branch and no libm call per weight: a
// quotient of 256.5 or more cannot fit and is clamped first, and below 2^22, adding and subtracting 1.5 * 2^23 rounds
// it half to even (the default rounding mode), as std::nearbyint would.
bool fit_block(const float* w, float lo, float d, int levels, uint8_t* out) {
  const float inv_ok = d > 0.0f ? 1.0f : 0.0f, safe = d > 0.0f ? d : 1.0f, top = static_cast<float>(levels);
  bool ok = true;
  for (int i = 0; i < 32; ++i) {
    const float v = std::min((w[i] - lo) / safe * inv_ok, 256.5f);
    const float q = (v + 12582912.0f) - 12582912.0f;
    ok &= (q >= 0.0f) & (q < top) & (lo + q * d == w[i]);
    out[i] = static_cast<uint8_t>(std::min(q, 255.0f));
  }
  return ok;
}

// A float32 value rounded to float16 and back (round to nearest even; overflow to inf), as torch's .half().float().
float via_half(float v) { return static_cast<float>(c10::Half(v)); }

// fastverify.reference.linear.pack_blocks, block by block: the scales in the reference's order, the first that fits
// a block kept for it; 4 bits when every block fits one of the 4-bit scales, else 8 when every block fits one of the
// 8-bit ones, else bits 0 (and empty tensors). A weight with a non-finite value gives bits 0 as well.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> pack_blocks_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight: expected a 2-D float32 CPU tensor, got ", weight.scalar_type(), " ", weight.sizes(), " on ",
              weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 32 == 0, "weight: expected K (its second dimension) a multiple of 32, got ", K);
  const at::Tensor w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  const int64_t nb = K / 32;
  at::Tensor d = at::empty({N, nb}, w.options()), m = at::empty({N, nb}, w.options());
  at::Tensor q8 = at::empty({N, K}, w.options().dtype(at::kByte));
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  uint8_t* qp = q8.data_ptr<uint8_t>();
  auto empty = [&]() {
    const auto none = w.options();
    return std::make_tuple(at::empty({0}, none.dtype(at::kByte)), at::empty({0}, none), at::empty({0}, none),
                           int64_t(0));
  };
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(K, 1));
  for (const int bits : {4, 8}) {
    std::atomic<bool> failed{false};
    const int levels = 1 << bits;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1 && !failed.load(std::memory_order_relaxed); ++n) {
        for (int64_t j = 0; j < nb; ++j) {
          const float* b = wp + n * K + 32 * j;
          float lo = b[0], hi = b[0], amax = std::fabs(b[0]), nan_if_not_finite = 0.0f;
          for (int i = 0; i < 32; ++i) {
            nan_if_not_finite += b[i] * 0.0f;  // inf * 0 and NaN * 0 are NaN
            lo = std::min(lo, b[i]);
            hi = std::max(hi, b[i]);
            amax = std::max(amax, std::fabs(b[i]));
          }
          const bool finite = nan_if_not_finite == 0.0f;
          const float scales[2] = {bits == 4 ? via_half((hi - lo) / 15.0f) : via_half(amax / 127.0f),
                                   bits == 4 ? via_half(amax / 8.0f) : via_half((hi - lo) / 255.0f)};
          uint8_t* out = qp + n * K + 32 * j;
          int hit = -1;
          for (int c = 0; c < 2 && finite && hit < 0; ++c)
            if (fit_block(b, lo, scales[c], levels, out)) hit = c;
          if (hit < 0) {
            failed.store(true, std::memory_order_relaxed);
            return;
          }
          dp[n * nb + j] = scales[hit];
          mp[n * nb + j] = lo;
        }
      }
    });
    if (failed.load()) continue;
    if (bits == 8) return std::make_tuple(q8, d, m, int64_t(8));
    // 4 bits: per block of 32, byte l holds q[l] in its low nibble and q[16 + l] in its high one
    at::Tensor q4 = at::empty({N, K / 2}, q8.options());
    uint8_t* q4p = q4.data_ptr<uint8_t>();
    at::parallel_for(0, N * nb, 1024, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk)
        for (int l = 0; l < 16; ++l)
          q4p[16 * blk + l] = static_cast<uint8_t>(qp[32 * blk + l] | (qp[32 * blk + 16 + l] << 4));
    });
    return std::make_tuple(q4, d, m, int64_t(4));
  }
  return empty();
}

}  // namespace

namespace fastverify::cpu {

PackedLinear packed_linear(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                           const std::optional<at::Tensor>& bias, int64_t K, const char* name) {
  TORCH_CHECK(bits == 4 || bits == 8, name, "bits: expected 4 or 8, got ", bits);
  TORCH_CHECK(q.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu(), name, "q, ", name, "d, ", name,
              "m: expected CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2, name, "q: expected a uint8 tensor [N, K * bits / 8], got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0);
  TORCH_CHECK(K % 32 == 0 && q.size(1) * 8 == K * bits, name, "q: expected shape [N, K * bits / 8] = [", N, ", ",
              K * bits / 8, "] for x's K = ", K, " (a multiple of 32), got ", q.sizes());
  for (const auto& [t, what] : {std::pair{&d, "d"}, {&m, "m"}})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == N && t->size(1) == K / 32, name,
                what, ": expected float32 [N, K / 32] = [", N, ", ", K / 32, "], got ", t->scalar_type(), " ",
                t->sizes());
  PackedLinear w{{}, N, nullptr, q.contiguous(), d.contiguous(), m.contiguous(), {}};
  w.bias = checked_bias(bias, N, w.b, name);
  w.p = {w.q.data_ptr<uint8_t>(), w.d.data_ptr<float>(), w.m.data_ptr<float>(), static_cast<int>(bits), K};
  return w;
}

void packed_rows(const float* x, int64_t M, const PackedLinear& w, float* y) {
  const int64_t N = w.N, K = w.p.K;
  if (M == 0 || N == 0) return;
  // Blocks of 4 weight rows; a thread's share is at least ~64K weights so that small layers stay on one thread.
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (4 * std::max<int64_t>(K, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    fastverify::linear::skinny_rows_packed(x, w.p, w.bias, y, M, N, 4 * b0, std::min(N, 4 * b1));
  });
}

}  // namespace fastverify::cpu

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("skinny_linear", &skinny_linear_cpu);
  m.impl("skinny_linear_packed", &skinny_linear_packed_cpu);
  m.impl("skinny_linear_t", &skinny_linear_t_cpu);
  m.impl("gated_lora_add_", &gated_lora_add_cpu);
  m.impl("pack_blocks", &pack_blocks_cpu);
}
