// CPU kernel of fastverify::masked_attention (schema: csrc/attention.cpp; arithmetic: csrc/attention.h). One task
// per (batch row, key / value head): its group's query rows gathered into one block, then the kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "cpu/kernels.h"

namespace {

// A mask value at or below this excludes its key outright: with any score below 1e29 the key's weight is 0.
constexpr float kSkippedMask = -1e30f;

at::Tensor masked_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& mask, double scale, bool skip_masked_prefix,
                                double softcap, const std::optional<at::Tensor>& sinks) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4, name,
                ": expected a 4-D float32 CPU tensor, got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && Dv >= 1,
              "k, v: expected k [B = ", B, ", Hkv, S, D = ", D, "] and v [B, Hkv, S, Dv >= 1], got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "q, k: the query heads (", Hq, ") must be a multiple of the key / value "
              "heads (", Hkv, ")");
  fastverify::cpu::AttentionTasks a;
  a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.n = n, a.S = S, a.D = D, a.Dv = Dv, a.scale = static_cast<float>(scale);
  a.set_mask(mask, skip_masked_prefix);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap: expected a finite value >= 0 (0: none), got ",
              softcap);
  a.softcap = static_cast<float>(softcap);
  at::Tensor sink_rows;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == Hq,
                "sinks: expected a float32 CPU tensor [Hq = ", Hq, "], got ", sinks->scalar_type(), " ",
                sinks->sizes(), " on ", sinks->device());
    sink_rows = sinks->contiguous();
    a.sinks = sink_rows.data_ptr<float>();
  }
  at::Tensor out = at::empty({B, Hq, n, Dv}, q.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK(S > 0, "k, v: expected at least one key");
  a.q = q.data_ptr<float>(), a.q_b = q.stride(0), a.q_h = q.stride(1), a.q_i = q.stride(2), a.q_d = q.stride(3);
  a.set_keys(k, v);  // (a cache's view keeps each key's D values contiguous)
  a.out = out.data_ptr<float>(), a.o_b = Hq * n * Dv, a.o_h = n * Dv, a.o_i = Dv;
  // one thread for small calls (a decoding step's: waking the pool costs more than the work)
  const int64_t tasks = B * Hkv, R = (Hq / Hkv) * n;
  const int64_t grain = R * S * D * 2 >= (int64_t(1) << 18) ? 1 : tasks;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) { a.run(t0, t1); });
  return out;
}

at::Tensor append_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, int64_t start, const at::Tensor& mask, double scale) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&v, "v"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4, name,
                ": expected a 4-D float32 CPU tensor, got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  const int64_t n = k.size(2);
  TORCH_CHECK(v.sizes() == k.sizes(), "v: expected the shape of k ", k.sizes(), ", got ", v.sizes());
  fastverify::cpu::check_caches(k_cache, v_cache, k.size(0), k.size(1), k.size(3), start, n, "k_cache", "v_cache");
  k_cache.narrow(2, start, n).copy_(k);
  v_cache.narrow(2, start, n).copy_(v);
  const at::Tensor out = masked_attention_cpu(q, k_cache.narrow(2, 0, start + n), v_cache.narrow(2, 0, start + n),
                                              mask, scale, /*skip_masked_prefix=*/true, /*softcap=*/0.0,
                                              std::nullopt);
  return out.transpose(1, 2).contiguous();
}

}  // namespace

namespace fastverify::cpu {

void AttentionTasks::set_mask(const std::optional<at::Tensor>& m, bool skip_masked_prefix) {
  mask = nullptr, m_b = m_h = m_i = 0;
  if (m.has_value()) {
    TORCH_CHECK(m->device().is_cpu() && m->scalar_type() == at::kFloat && m->dim() == 4 && m->size(0) == B &&
                    (m->size(1) == 1 || m->size(1) == Hq) && m->size(2) == n && m->size(3) == S,
                "mask: expected an additive float32 CPU mask [B = ", B, ", 1 or Hq = ", Hq, ", n = ", n, ", S = ", S,
                "], got ", m->scalar_type(), " ", m->sizes(), " on ", m->device());
    mask_ = m->stride(3) == 1 ? *m : m->contiguous();
    mask = mask_.data_ptr<float>();
    m_b = mask_.stride(0);
    m_h = mask_.size(1) == 1 ? 0 : mask_.stride(1);
    m_i = mask_.stride(2);
  }
  // skip_masked_prefix (csrc/attention.cpp): per batch row, the keys before `start` are not read. Their weight
  // would be exactly 0 (exp of less than -104 is 0 on every path), and `start` is a multiple of 16, so every other
  // key keeps its SIMD lane, its tile and its place in every sum: the same result, bit for bit.
  start.assign(B, 0);
  if (!mask || !skip_masked_prefix) return;
  const int64_t mask_heads = m_h ? Hq : 1;
  for (int64_t b = 0; b < B; ++b) {
    int64_t first = S;
    for (int64_t h = 0; h < mask_heads && first > 0; ++h)
      for (int64_t i = 0; i < n && first > 0; ++i) {
        const float* row = mask + b * m_b + h * m_h + i * m_i;
        int64_t j = 0;
        while (j < S && row[j] <= kSkippedMask) ++j;
        first = j == S ? 0 : std::min(first, j);  // a row masked everywhere: no key is skipped
      }
    start[b] = first / 16 * 16;
  }
}

void AttentionTasks::set_keys(const at::Tensor& keys, const at::Tensor& values) {
  auto rows = [](const at::Tensor& c, int64_t width) {
    return width == 0 || (c.stride(3) == 1 && c.stride(2) == width);
  };
  k_ = rows(keys, D) ? keys : keys.contiguous();
  v_ = rows(values, Dv) ? values : values.contiguous();
  k = k_.data_ptr<float>(), k_b = k_.stride(0), k_h = k_.stride(1);
  v = v_.data_ptr<float>(), v_b = v_.stride(0), v_h = v_.stride(1);
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t B, int64_t Hkv, int64_t D,
                  int64_t start, int64_t n, const std::string& k_name, const std::string& v_name) {
  for (const auto& [t, name] : {std::pair{&k_cache, &k_name}, {&v_cache, &v_name}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4, *name,
                ": expected a 4-D float32 CPU tensor, got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == B && k_cache.size(1) == Hkv &&
                  k_cache.size(3) == D,
              k_name, ", ", v_name, ": expected [B, Hkv, C, D] = [", B, ", ", Hkv, ", C, ", D, "] each, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(start >= 0 && start + n <= k_cache.size(2), "start: expected 0 <= start and start + n <= C = ",
              k_cache.size(2), " (", k_name, "'s rows), got start ", start, " for n = ", n);
}

void AttentionTasks::run(int64_t t0, int64_t t1) const {
  const int64_t G = Hq / Hkv;
  // query rows per head in one pass: all n, unless the scores [G * rows, S] would pass 1 MB (a long prompt's chunk
  // over many keys); a row's result does not depend on the others, so the tiling changes no bit
  const int64_t tile = std::clamp<int64_t>((int64_t(1) << 18) / (G * S), 1, n), RT = G * tile;
  std::vector<float> qrows(RT * D), scores(RT * S), orows(RT * Dv);
  std::vector<const float*> mrows(mask ? RT : 0);
  std::vector<float> srows(sinks ? RT : 0);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / Hkv, h = t % Hkv, s0 = start[b];
    const float* kh = k + b * k_b + h * k_h;
    const float* vh = v + b * v_b + h * v_h;
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
      const int64_t m = std::min(tile, n - i0);  // rows per head in this pass; row (g, i) at g * m + i - i0
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = i0; i < i0 + m; ++i) {
          const int64_t hq = h * G + g, r = g * m + i - i0;
          const float* src = q + b * q_b + hq * q_h + i * q_i;
          if (q_d == 1) std::copy(src, src + D, qrows.data() + r * D);
          else for (int64_t d = 0; d < D; ++d) qrows[r * D + d] = src[d * q_d];
          if (mask) mrows[r] = mask + b * m_b + hq * m_h + i * m_i + s0;
          if (sinks) srows[r] = sinks[hq];
        }
      fastverify::attention::group(qrows.data(), G * m, D, kh + s0 * D, vh + s0 * Dv, Dv, S - s0,
                                   mask ? mrows.data() : nullptr, scale, scores.data(), orows.data(), softcap,
                                   sinks ? srows.data() : nullptr);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = i0; i < i0 + m; ++i) {
          const float* src = orows.data() + (g * m + i - i0) * Dv;
          std::copy(src, src + Dv, out + b * o_b + (h * G + g) * o_h + i * o_i);
        }
    }
  }
}

}  // namespace fastverify::cpu

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("masked_attention", &masked_attention_cpu);
  m.impl("append_attention", &append_attention_cpu);
}
