// CPU kernels of the sampling ops (schemas and semantics: csrc/sampling.cpp; arithmetic: csrc/sampling.h and
// csrc/philox.h; reference: fastverify/reference/sampling.py). Rows run in parallel (at::parallel_for), each
// thread with its own workspace; logits are read in their own dtype (fp32 / bf16 / fp16).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "philox.h"
#include "sampling.h"

namespace fastverify {
namespace {

namespace fs = fastverify::sampling;

void check_rows(const at::Tensor& logits, const at::Tensor& warp, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [R, V], got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              op, ": logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) == 0 || logits.stride(1) == 1, op, ": logits must have a contiguous last dimension");
  TORCH_CHECK(warp.dim() == 2 && warp.size(0) == logits.size(0) && warp.size(1) == 4, op,
              ": warp must be [R, 4] with R = logits.size(0) = ", logits.size(0), ", got ", warp.sizes());
  TORCH_CHECK(warp.scalar_type() == at::kFloat, op, ": warp must be float32, got ", warp.scalar_type());
  TORCH_CHECK(logits.device().is_cpu() && warp.device().is_cpu(), op, ": expected CPU tensors");
}

// Rows per parallel chunk: at least ~64k logits (~50 us of work), so that small calls stay on the calling thread
// (waking a second thread, and waiting for it at the barrier, costs far more than such a call when the cores are
// busy: ~10 ms instead of 10 us for 64 rows of V = 8 on the 2-core test machine under load).
int64_t row_grain(int64_t V) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(V, 1)); }

// The next row of this thread's chunk: warp_row's compute-bound pass prefetches it (RowWorkspace::prefetch).
// Rows that repeat (stride 0, e.g. an expanded row) are already in cache: no hint.
template <typename T>
void set_prefetch(fs::RowWorkspace& ws, const T* next, int64_t V) {
  ws.prefetch = next;
  ws.prefetch_bytes = V * static_cast<int64_t>(sizeof(T));
}

void check_vec(const at::Tensor& t, int64_t R, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == R, op, ": ", name, " must be 1-D [R] with R = ", R, ", got ",
              t.sizes());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
}

at::Tensor _uniform_kernel(const at::Tensor& seed, const at::Tensor& position, const at::Tensor& stream) {
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, {&position, "position"}, {&stream, "stream"}}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "uniform: ", name, " must be int64, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == position.sizes(), "uniform: ", name, " ", t->sizes(), " must have the shape of position ",
                position.sizes());
  }
  const at::Tensor s = seed.contiguous(), p = position.contiguous(), st = stream.contiguous();
  if (st.numel()) {
    const auto [lo, hi] = at::aminmax(st);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() <= 0xFFFFFFFFLL,
                "uniform: stream must be in [0, 2^32), got values in [", lo.item<int64_t>(), ", ",
                hi.item<int64_t>(), "]");
  }
  at::Tensor out = at::empty(p.sizes(), p.options().dtype(at::kFloat));
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, p.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[i] = philox_uniform(sp[i], pp[i], static_cast<uint32_t>(stp[i]));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> _verify_uniforms_kernel(const at::Tensor& seed, const at::Tensor& position,
                                                           const at::Tensor& request, const at::Tensor& offset,
                                                           const at::Tensor& stream, int64_t rows) {
  const int64_t B = position.numel(), M = request.numel();
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, {&position, "position"}, {&request, "request"},
                                {&offset, "offset"}, {&stream, "stream"}}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "verify_uniforms: ", name, " must be int64, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->device().is_cpu(), "verify_uniforms: ", name, " must be a 1-D CPU tensor, got ",
                t->sizes(), " on ", t->device());
  }
  TORCH_CHECK(seed.numel() == B || seed.numel() == 1, "verify_uniforms: seed must have B = ", B,
              " elements (position's) or 1, got ", seed.numel());
  TORCH_CHECK(offset.numel() == M && stream.numel() == M, "verify_uniforms: request, offset and stream must have "
              "one length, got ", M, ", ", offset.numel(), ", ", stream.numel());
  TORCH_CHECK(0 <= rows && rows <= M, "verify_uniforms: rows must be in [0, ", M, "], got ", rows);
  const at::Tensor s = seed.contiguous(), p = position.contiguous(), rq = request.contiguous(),
                   of = offset.contiguous(), st = stream.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  const int64_t* rp = rq.data_ptr<int64_t>();
  const int64_t* ofp = of.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  const int64_t seed_step = s.numel() == 1 ? 0 : 1;
  at::Tensor first = at::empty({rows}, p.options().dtype(at::kFloat));
  at::Tensor second = at::empty({M - rows}, p.options().dtype(at::kFloat));
  float* fp = first.data_ptr<float>();
  float* sp2 = second.data_ptr<float>();
  at::parallel_for(0, M, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = rp[i], x = stp[i];
      TORCH_CHECK(0 <= r && r < B, "verify_uniforms: request[", i, "] = ", r, " is not in [0, ", B, ")");
      TORCH_CHECK(0 <= x && x <= 0xFFFFFFFFLL, "verify_uniforms: stream[", i, "] = ", x, " is not in [0, 2^32)");
      const float u = philox_uniform(sp[r * seed_step], pp[r] + ofp[i], static_cast<uint32_t>(x));
      if (i < rows) fp[i] = u; else sp2[i - rows] = u;
    }
  });
  return {first, second};
}

// Warps each row of logits [R, V] (parallel over rows, the next row prefetched on the way) and hands it to
// fn(row, dist, workspace, r): the one loop cdf_sample and cdf_invert share, so both see identical arithmetic.
template <typename Fn>
void for_each_warped_row(const at::Tensor& logits, const float* wq, const Fn& fn) {
  const int64_t R = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "for_each_warped_row", [&] {
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, R, row_grain(V), [&](int64_t b, int64_t e) {
      fs::RowWorkspace ws;
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* row = lp + r * row_stride;
        if (r + 1 < e && row_stride != 0) set_prefetch(ws, row + row_stride, V);
        const fs::RowDist d = fs::warp_row(row, V, fs::load_warp(wq + 4 * r), ws);
        fn(row, d, ws, r);
      }
    });
  });
}

at::Tensor _cdf_sample_kernel(const at::Tensor& logits, const at::Tensor& u, const at::Tensor& warp) {
  check_rows(logits, warp, "cdf_sample");
  const int64_t R = logits.size(0), V = logits.size(1);
  check_vec(u, R, "cdf_sample", "u");
  TORCH_CHECK(u.scalar_type() == at::kFloat || u.scalar_type() == at::kDouble,
              "cdf_sample: u must be float32 or float64, got ", u.scalar_type());
  const at::Tensor ud = u.to(at::kDouble).contiguous(), wp = warp.contiguous();
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  if (R == 0) return out;
  TORCH_CHECK(V > 0, "cdf_sample: logits must have V >= 1 columns");
  const double* up = ud.data_ptr<double>();
  const float* wq = wp.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_each_warped_row(logits, wq, [&](const auto* row, const fs::RowDist& d, fs::RowWorkspace& ws, int64_t r) {
    op[r] = fs::sample_row(row, d, ws, up[r]);
  });
  return out;
}

at::Tensor _cdf_invert_kernel(const at::Tensor& logits, const at::Tensor& token, const at::Tensor& v,
                              const at::Tensor& warp) {
  check_rows(logits, warp, "cdf_invert");
  const int64_t R = logits.size(0), V = logits.size(1);
  check_vec(token, R, "cdf_invert", "token");
  check_vec(v, R, "cdf_invert", "v");
  TORCH_CHECK(token.scalar_type() == at::kLong, "cdf_invert: token must be int64, got ", token.scalar_type());
  TORCH_CHECK(v.scalar_type() == at::kFloat || v.scalar_type() == at::kDouble,
              "cdf_invert: v must be float32 or float64, got ", v.scalar_type());
  const at::Tensor vd = v.to(at::kDouble).contiguous(), tk = token.contiguous(), wp = warp.contiguous();
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kDouble));
  if (R == 0) return out;
  TORCH_CHECK(V > 0, "cdf_invert: logits must have V >= 1 columns");
  const double* vp = vd.data_ptr<double>();
  const int64_t* tp = tk.data_ptr<int64_t>();
  const float* wq = wp.data_ptr<float>();
  double* op = out.data_ptr<double>();
  for_each_warped_row(logits, wq, [&](const auto* row, const fs::RowDist& d, fs::RowWorkspace& ws, int64_t r) {
    op[r] = fs::invert_row(row, d, ws, tp[r], vp[r]);
  });
  return out;
}

at::Tensor _aux_bits_kernel(const at::Tensor& u) {
  TORCH_CHECK(u.scalar_type() == at::kFloat, "aux_bits: u must be float32, got ", u.scalar_type());
  TORCH_CHECK(u.device().is_cpu(), "aux_bits: expected a CPU tensor");
  const at::Tensor uc = u.contiguous();
  std::vector<int64_t> shape(uc.sizes().begin(), uc.sizes().end());
  shape.push_back(32);
  at::Tensor out = at::empty(shape, uc.options());
  const uint32_t* in = reinterpret_cast<const uint32_t*>(uc.data_ptr<float>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, uc.numel(), 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int j = 0; j < 32; ++j) op[32 * i + j] = static_cast<float>((in[i] >> (31 - j)) & 1u);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("uniform", &_uniform_kernel);
  m.impl("verify_uniforms", &_verify_uniforms_kernel);
  m.impl("cdf_sample", &_cdf_sample_kernel);
  m.impl("cdf_invert", &_cdf_invert_kernel);
  m.impl("aux_bits", &_aux_bits_kernel);
}

}  // namespace fastverify
