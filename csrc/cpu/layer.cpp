// CPU kernels of fastverify::decoder_pre_attention / decoder_post_attention (schema and semantics: csrc/layer.cpp):
// the steps of fastverify/hf/layers.py `_forward` on raw rows, each the arithmetic of the op the Python forward
// calls there (csrc/cpu/kernels.h: skinny_linear_packed's projection, rms_norm's rows, rotary_embedding's row;
// ATen's silu), so every result is the same bits. The residual additions and silu(gate) x up are one IEEE
// operation per element, as at::add and at::mul compute them. One workspace per call instead of a tensor and a
// dispatcher call per step: on a one-row step those were about half of a layer's time outside its projections.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
using fastverify::cpu::packed_linear;
using fastverify::cpu::packed_rows;
using fastverify::cpu::PackedLinear;
using fastverify::cpu::rms_rows;

void check_hidden(const at::Tensor& h, const char* name) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 3, name,
              ": expected a float32 CPU tensor [B, S, E], got ", h.scalar_type(), " ", h.sizes(), " on ", h.device());
}

// A norm's weight [dim = D] (contiguous) and eps, checked.
const float* norm_weight_ptr(const at::Tensor& w, const char* dim, int64_t D, double eps, const char* name,
                             at::Tensor& keep) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == D, name,
              ": expected [", dim, " = ", D, "] float32 on the CPU, got ", w.scalar_type(), " ", w.sizes(), " on ",
              w.device());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, name, "'s eps: expected a finite number >= 0, got ", eps);
  keep = w.contiguous();
  return keep.data_ptr<float>();
}

// The live rows (``index``, checked: int64 [M] within [0, total)) as a contiguous tensor, or an undefined one.
at::Tensor live_index(const OptTensor& index, int64_t total) {
  if (!index.has_value()) return {};
  const at::Tensor& idx = *index;
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.dim() == 1, "index: expected an int64 "
              "CPU tensor [M], got ", idx.scalar_type(), " ", idx.sizes(), " on ", idx.device());
  at::Tensor c = idx.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (int64_t r = 0; r < c.numel(); ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < total, "index: row ", p[r], " is out of range [0, ", total, ") (B x S rows)");
  return c;
}

// One float32 allocation cut into pieces of the given sizes, each starting on a 64-byte line (as a tensor of its
// own would: the projections load their x rows from them); ws holds it.
std::vector<float*> carve(at::Tensor& ws, std::initializer_list<int64_t> sizes, const at::TensorOptions& options) {
  auto line = [](int64_t n) { return (n + 15) / 16 * 16; };
  int64_t total = 0;
  for (int64_t n : sizes) total += line(n);
  ws = at::empty({total}, options);
  std::vector<float*> out;
  float* p = ws.data_ptr<float>();
  for (int64_t n : sizes) {
    out.push_back(p);
    p += line(n);
  }
  return out;
}

// rows [M, W] of src [total, W]: src itself without an index, else the indexed rows copied into buf.
const float* gather(const float* src, int64_t W, const at::Tensor& idx, float* buf) {
  if (!idx.defined()) return src;
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < idx.numel(); ++r) std::copy(src + p[r] * W, src + (p[r] + 1) * W, buf + r * W);
  return buf;
}

// Row r of an [M, W] result goes to row index[r] (or r) of dst [total, W].
float* row_out(float* dst, int64_t W, const at::Tensor& idx, int64_t r) {
  return dst + (idx.defined() ? idx.data_ptr<int64_t>()[r] : r) * W;
}

std::tuple<at::Tensor, at::Tensor> decoder_pre_attention_cpu(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_q, const at::Tensor& qkv_d,
    const at::Tensor& qkv_m, int64_t qkv_bits, const OptTensor& qkv_bias, const at::Tensor& cos,
    const at::Tensor& sin, int64_t n_q, int64_t n_kv, const OptTensor& index, const OptTensor& q_norm_weight,
    double q_norm_eps, const OptTensor& k_norm_weight, double k_norm_eps) {
  check_hidden(h, "h");
  TORCH_CHECK(n_q >= 1 && n_kv >= 1, "n_q, n_kv: expected >= 1, got ", n_q, " and ", n_kv);
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(),
              "q_norm_weight, k_norm_weight: expected both or neither");
  const int64_t B = h.size(0), S = h.size(1), E = h.size(2), nqk = n_q + n_kv, heads = n_q + 2 * n_kv;
  const fastverify::cpu::RotaryTables tables(cos, sin, B, nqk, S, -1, "q and k's heads'");
  const int64_t D = tables.dim();
  const PackedLinear w = packed_linear(qkv_q, qkv_d, qkv_m, qkv_bits, qkv_bias, E, "qkv_");
  TORCH_CHECK(w.N == heads * D, "qkv_q: expected ", heads * D, " output rows ((n_q + 2 n_kv) x head dimension ", D,
              "), got ", qkv_q.sizes());
  at::Tensor keep_w, keep_q, keep_k;
  const float* w1 = norm_weight_ptr(norm_weight, "E", E, eps, "norm_weight", keep_w);
  const float* wq = q_norm_weight ? norm_weight_ptr(*q_norm_weight, "D", D, q_norm_eps, "q_norm_weight", keep_q)
                                  : nullptr;
  const float* wk = k_norm_weight ? norm_weight_ptr(*k_norm_weight, "D", D, k_norm_eps, "k_norm_weight", keep_k)
                                  : nullptr;
  const at::Tensor idx = live_index(index, B * S);
  const int64_t T = B * S, M = idx.defined() ? idx.numel() : T, N = w.N;
  const at::Tensor hc = h.contiguous();
  const int64_t G = wq ? T * std::max(n_q, n_kv) * D : 0;  // Qwen3: one kind of heads gathered
  at::Tensor qkv = idx.defined() ? at::zeros({B, S, heads, D}, h.options())
                                 : at::empty({B, S, heads, D}, h.options());
  at::Tensor ws;
  const int64_t live = idx.defined() ? M : 0;
  const std::vector<float*> piece = carve(ws, {live * E, live * N, M * E, wq ? T * nqk * D : 0, G}, h.options());
  float* rows = piece[0];     // the live rows of h [M, E]
  float* proj = piece[1];     // their projection [M, N]
  float* xn = piece[2];       // the normed rows [M, E]
  float* normed = piece[3];   // Qwen3: [T, n_q, D] normed q heads, then [T, n_kv, D] k heads
  float* qkv_p = qkv.data_ptr<float>();
  rms_rows(gather(hc.data_ptr<float>(), E, idx, rows), M, E, w1, eps, xn);
  packed_rows(xn, M, w, idx.defined() ? proj : qkv_p);
  if (idx.defined())
    for (int64_t r = 0; r < M; ++r) std::copy(proj + r * N, proj + (r + 1) * N, row_out(qkv_p, N, idx, r));
  if (wq) {  // every row's q heads, then its k heads, RMS-normed over their D values (padding rows too)
    float* gathered = piece[4];
    for (const auto& [first, n, weight, e] :
         {std::tuple{int64_t(0), n_q, wq, q_norm_eps}, {n_q, n_kv, wk, k_norm_eps}}) {
      for (int64_t t = 0; t < T; ++t)
        std::copy(qkv_p + (t * heads + first) * D, qkv_p + (t * heads + first + n) * D, gathered + t * n * D);
      rms_rows(gathered, T * n, D, weight, e, normed + T * first * D);
    }
  }
  // row t's head j (q heads, then k heads) before the rotation
  auto head = [&](int64_t t, int64_t j) -> const float* {
    if (!wq) return qkv_p + (t * heads + j) * D;
    return j < n_q ? normed + (t * n_q + j) * D : normed + T * n_q * D + (t * n_kv + j - n_q) * D;
  };
  at::Tensor qk = at::empty({B, nqk, S, D}, h.options());
  float* qk_p = qk.data_ptr<float>();
  at::parallel_for(0, B * nqk * S, std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       const int64_t b = r / (nqk * S), j = (r / S) % nqk, i = r % S;
                       tables.rotate(head(b * S + i, j), b, j, i, qk_p + r * D);
                     }
                   });
  return {qk, qkv.transpose(1, 2).slice(1, nqk)};
}

at::Tensor decoder_post_attention_cpu(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o_q,
                                      const at::Tensor& o_d, const at::Tensor& o_m, int64_t o_bits,
                                      const OptTensor& o_bias, const at::Tensor& norm_weight, double eps,
                                      const at::Tensor& gate_up_q, const at::Tensor& gate_up_d,
                                      const at::Tensor& gate_up_m, int64_t gate_up_bits, const OptTensor& gate_up_bias,
                                      const at::Tensor& down_q, const at::Tensor& down_d, const at::Tensor& down_m,
                                      int64_t down_bits, const OptTensor& down_bias, const OptTensor& index) {
  check_hidden(h, "h");
  const int64_t B = h.size(0), S = h.size(1), E = h.size(2), T = B * S;
  TORCH_CHECK(attn.device().is_cpu() && attn.scalar_type() == at::kFloat && attn.dim() >= 3 && attn.size(0) == B &&
                  attn.size(1) == S,
              "attn: expected a float32 CPU tensor [", B, ", ", S, ", ...] (h's rows), got ", attn.scalar_type(), " ",
              attn.sizes(), " on ", attn.device());
  TORCH_CHECK(gate_up_q.dim() == 2 && gate_up_q.size(0) % 2 == 0, "gate_up_q: expected [2 I, ...] (gate and up "
              "stacked), got ", gate_up_q.sizes());
  const int64_t I = gate_up_q.size(0) / 2;
  int64_t A = 1;  // the attention's width per row
  for (int64_t i = 2; i < attn.dim(); ++i) A *= attn.size(i);
  const PackedLinear o = packed_linear(o_q, o_d, o_m, o_bits, o_bias, A, "o_");
  const PackedLinear gu =
      packed_linear(gate_up_q, gate_up_d, gate_up_m, gate_up_bits, gate_up_bias, E, "gate_up_");
  const PackedLinear dn = packed_linear(down_q, down_d, down_m, down_bits, down_bias, I, "down_");
  TORCH_CHECK(o.N == E, "o_q: expected ", E, " output rows (h's E), got ", o_q.sizes());
  TORCH_CHECK(dn.N == E, "down_q: expected ", E, " output rows (h's E), got ", down_q.sizes());
  at::Tensor keep_w;
  const float* w2 = norm_weight_ptr(norm_weight, "E", E, eps, "norm_weight", keep_w);
  const at::Tensor idx = live_index(index, T);
  const int64_t M = idx.defined() ? idx.numel() : T;
  const at::Tensor hc = h.contiguous(), ac = attn.reshape({T, A}).contiguous();
  at::Tensor out = idx.defined() ? at::zeros({B, S, E}, h.options()) : at::empty({B, S, E}, h.options());
  at::Tensor ws;
  const int64_t live = idx.defined() ? M : 0;
  const std::vector<float*> piece =
      carve(ws, {live * A, live * E, M * E, M * E, 2 * M * I, M * I, M * E}, h.options());
  float* a_rows = piece[0];   // the live rows of attn [M, A] and of h [M, E]
  float* h_rows = piece[1];
  float* h1 = piece[2];       // h + o_proj(attn) [M, E]
  float* xn = piece[3];       // its norm [M, E]
  float* gate_up = piece[4];  // [M, 2 I]
  float* act = piece[5];      // silu(gate) x up [M, I]
  float* down = piece[6];     // [M, E]
  const float* hr = gather(hc.data_ptr<float>(), E, idx, h_rows);
  packed_rows(gather(ac.data_ptr<float>(), A, idx, a_rows), M, o, h1);
  for (int64_t k = 0; k < M * E; ++k) h1[k] = hr[k] + h1[k];
  rms_rows(h1, M, E, w2, eps, xn);
  packed_rows(xn, M, gu, gate_up);
  // ATen's silu on the gate columns, as the Python forward calls it on gu[..., :I] (the same view), then x up
  at::Tensor act_t = at::from_blob(act, {M, I}, h.options());
  at::silu_out(act_t, at::from_blob(gate_up, {M, I}, {2 * I, 1}, h.options()));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < I; ++j) act[r * I + j] = act[r * I + j] * gate_up[r * 2 * I + I + j];
  packed_rows(act, M, dn, down);
  float* out_p = out.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    float* y = row_out(out_p, E, idx, r);
    for (int64_t k = 0; k < E; ++k) y[k] = h1[r * E + k] + down[r * E + k];
  }
  return out;
}

// Per layer: the entries of decoder_stack's weights, ints and floats (csrc/layer.cpp).
constexpr int64_t kWeights = 20, kInts = 6, kFloats = 5;

at::Tensor decoder_stack_cpu(const at::Tensor& h, const c10::List<OptTensor>& weights, at::IntArrayRef ints,
                             at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                             at::TensorList k_caches, at::TensorList v_caches, int64_t start, const at::Tensor& mask,
                             const OptTensor& index) {
  // the layers' tensors (workspaces, views of q / k / v) are the op's own: made below autograd's dispatch keys,
  // without its view tracking (on a 30-layer model of width 64, 667 against 603 us a call on one thread)
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L, "v_caches: expected one per layer (", L,
              " as k_caches), got ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * L && static_cast<int64_t>(ints.size()) == kInts * L &&
                  static_cast<int64_t>(floats.size()) == kFloats * L,
              "weights, ints, floats: expected ", kWeights, ", ", kInts, " and ", kFloats, " entries per layer (", L,
              " layers: k_caches), got ", weights.size(), ", ", ints.size(), " and ", floats.size());
  auto required = [&](int64_t i, const char* name) -> at::Tensor {
    const OptTensor w = weights.get(i);
    TORCH_CHECK(w.has_value(), "weights: entry ", i, " (layer ", i / kWeights, "'s ", name, ") is None");
    return *w;
  };
  at::Tensor x = h;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = kWeights * l;
    const int64_t* n = ints.data() + kInts * l;
    const double* f = floats.data() + kFloats * l;
    const auto [qk, v] = decoder_pre_attention_cpu(
        x, required(w, "norm_weight"), f[0], required(w + 1, "qkv_q"), required(w + 2, "qkv_d"),
        required(w + 3, "qkv_m"), n[0], weights.get(w + 4), cos, sin, n[4], n[5], index, weights.get(w + 5), f[1],
        weights.get(w + 6), f[2]);
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    const at::Tensor attn = fastverify::cpu::append_attention(qk.narrow(1, 0, n[4]), qk.narrow(1, n[4], n[5]), v, kc,
                                                              vc, start, mask, f[4]);
    x = decoder_post_attention_cpu(x, attn, required(w + 7, "o_q"), required(w + 8, "o_d"), required(w + 9, "o_m"),
                                   n[1], weights.get(w + 10), required(w + 11, "post-attention norm_weight"), f[3],
                                   required(w + 12, "gate_up_q"), required(w + 13, "gate_up_d"),
                                   required(w + 14, "gate_up_m"), n[2], weights.get(w + 15),
                                   required(w + 16, "down_q"), required(w + 17, "down_d"), required(w + 18, "down_m"),
                                   n[3], weights.get(w + 19), index);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("decoder_pre_attention", &decoder_pre_attention_cpu);
  m.impl("decoder_post_attention", &decoder_post_attention_cpu);
  m.impl("decoder_stack", &decoder_stack_cpu);
}
