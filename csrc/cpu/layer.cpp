// CPU kernels of fastverify::decoder_pre_attention / decoder_post_attention / decoder_stack (schema and semantics:
// csrc/layer.cpp): the steps of fastverify/hf/layers.py `_forward` on raw rows, each the arithmetic of the op the
// Python forward calls there (csrc/cpu/kernels.h: skinny_linear_packed's projection, rms_norm's rows,
// rotary_embedding's row, masked_attention's tasks; ATen's silu), so every result is the same bits. The residual
// additions and silu(gate) x up are one IEEE operation per element, as at::add and at::mul compute them. One
// workspace per call instead of a tensor and a dispatcher call per step: on a one-row step those were about half of a
// layer's time outside its projections. The two layer ops and the stack share pre_rows / post_rows; the stack runs
// them layer after layer on one workspace, with the rotated k and v rows put straight into the caches and the
// attention's rows written where o_proj reads them (no tensor, copy or transpose per layer), every layer checked and
// the mask read once before any cache is written, and the attention's (batch row, key / value head) tasks split
// across threads (append_attention keeps a decoding step's few rows on one).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
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

// A layer's weights before the attention (decoder_pre_attention's arguments), checked.
struct PreLayer {
  PackedLinear qkv;
  const float* w1;
  const float* wq;  // Qwen3's q_norm / k_norm weights [D], or nullptr
  const float* wk;
  double eps, q_eps, k_eps;
  int64_t n_q, n_kv, heads, D;
  at::Tensor keep_w, keep_q, keep_k;
};

PreLayer pre_layer(const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_q, const at::Tensor& qkv_d,
                   const at::Tensor& qkv_m, int64_t qkv_bits, const OptTensor& qkv_bias, int64_t n_q, int64_t n_kv,
                   const OptTensor& q_norm_weight, double q_norm_eps, const OptTensor& k_norm_weight,
                   double k_norm_eps, int64_t E, int64_t D) {
  PreLayer w{packed_linear(qkv_q, qkv_d, qkv_m, qkv_bits, qkv_bias, E, "qkv_"), nullptr, nullptr, nullptr, eps,
             q_norm_eps, k_norm_eps, n_q, n_kv, n_q + 2 * n_kv, D, {}, {}, {}};
  TORCH_CHECK(w.qkv.N == w.heads * D, "qkv_q: expected ", w.heads * D, " output rows ((n_q + 2 n_kv) x head dimension ",
              D, "), got ", qkv_q.sizes());
  w.w1 = norm_weight_ptr(norm_weight, "E", E, eps, "norm_weight", w.keep_w);
  if (q_norm_weight) w.wq = norm_weight_ptr(*q_norm_weight, "D", D, q_norm_eps, "q_norm_weight", w.keep_q);
  if (k_norm_weight) w.wk = norm_weight_ptr(*k_norm_weight, "D", D, k_norm_eps, "k_norm_weight", w.keep_k);
  return w;
}

// The workspace pieces of pre_rows (T rows, M of them live; ``indexed``: a live-row index is given), each starting on
// a 64-byte line (as a tensor of its own would: the projections load their x rows from them).
constexpr int64_t line(int64_t n) { return (n + 15) / 16 * 16; }
std::array<int64_t, 4> pre_pieces(const PreLayer& w, int64_t T, int64_t M, bool indexed, int64_t E) {
  const int64_t nqk = w.n_q + w.n_kv;
  return {line(indexed ? M * E : 0) + line(indexed ? M * w.qkv.N : 0), line(M * E), line(w.wq ? T * nqk * w.D : 0),
          line(w.wq ? T * std::max(w.n_q, w.n_kv) * w.D : 0)};
}
template <size_t N>
int64_t total(const std::array<int64_t, N>& pieces) {
  int64_t n = 0;
  for (int64_t p : pieces) n += p;
  return n;
}

// The heads the rotation reads: row t's head j (q heads, then k heads) of qkv [T, heads, D], or of the Qwen3-normed
// copies.
struct Heads {
  const float* qkv;
  const float* normed;  // [T, n_q, D] normed q heads, then [T, n_kv, D] k heads; or nullptr
  int64_t T, n_q, n_kv, heads, D;
  const float* operator()(int64_t t, int64_t j) const {
    if (!normed) return qkv + (t * heads + j) * D;
    return j < n_q ? normed + (t * n_q + j) * D : normed + T * n_q * D + (t * n_kv + j - n_q) * D;
  }
};

// decoder_pre_attention's steps up to the rotation on raw rows: h [T, E]'s live rows (idx, or all T) normed and
// projected into qkv [T, heads, D] (its other rows left as they are: the caller's zeros), then Qwen3's head norms
// over every row. ws: total(pre_pieces(...)) floats.
Heads pre_rows(const PreLayer& w, const float* h, const at::Tensor& idx, int64_t T, int64_t E, float* qkv,
               float* ws) {
  const bool indexed = idx.defined();
  const int64_t M = indexed ? idx.numel() : T, N = w.qkv.N, D = w.D;
  const auto pieces = pre_pieces(w, T, M, indexed, E);
  float* rows = ws;                              // the live rows of h [M, E]
  float* proj = rows + line(indexed ? M * E : 0);  // their projection [M, N]
  float* xn = ws + pieces[0];                    // the normed rows [M, E]
  float* normed = xn + pieces[1];                // Qwen3: [T, n_q, D] normed q heads, then [T, n_kv, D] k heads
  rms_rows(gather(h, E, idx, rows), M, E, w.w1, w.eps, xn);
  packed_rows(xn, M, w.qkv, indexed ? proj : qkv);
  if (indexed)
    for (int64_t r = 0; r < M; ++r) std::copy(proj + r * N, proj + (r + 1) * N, row_out(qkv, N, idx, r));
  if (!w.wq) return {qkv, nullptr, T, w.n_q, w.n_kv, w.heads, D};
  float* gathered = normed + pieces[2];  // every row's q heads, then its k heads, RMS-normed over their D values
  for (const auto& [first, n, weight, e] :
       {std::tuple{int64_t(0), w.n_q, w.wq, w.q_eps}, {w.n_q, w.n_kv, w.wk, w.k_eps}}) {
    for (int64_t t = 0; t < T; ++t)
      std::copy(qkv + (t * w.heads + first) * D, qkv + (t * w.heads + first + n) * D, gathered + t * n * D);
    rms_rows(gathered, T * n, D, weight, e, normed + T * first * D);
  }
  return {qkv, normed, T, w.n_q, w.n_kv, w.heads, D};
}

// Every row's q and k heads rotated (rotary_embedding's row) into dst(b, j, i): row i of batch row b, head j.
template <typename Dst>
void rotate_heads(const Heads& heads, const fastverify::cpu::RotaryTables& tables, int64_t B, int64_t S, Dst dst) {
  const int64_t nqk = heads.n_q + heads.n_kv, D = heads.D;
  at::parallel_for(0, B * nqk * S, std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       const int64_t b = r / (nqk * S), j = (r / S) % nqk, i = r % S;
                       tables.rotate(heads(b * S + i, j), b, j, i, dst(b, j, i));
                     }
                   });
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
  const int64_t B = h.size(0), S = h.size(1), E = h.size(2), nqk = n_q + n_kv, T = B * S;
  const fastverify::cpu::RotaryTables tables(cos, sin, B, nqk, S, -1, "q and k's heads'");
  const int64_t D = tables.dim();
  const PreLayer w = pre_layer(norm_weight, eps, qkv_q, qkv_d, qkv_m, qkv_bits, qkv_bias, n_q, n_kv, q_norm_weight,
                               q_norm_eps, k_norm_weight, k_norm_eps, E, D);
  const at::Tensor idx = live_index(index, T);
  const at::Tensor hc = h.contiguous();
  at::Tensor qkv = idx.defined() ? at::zeros({B, S, w.heads, D}, h.options())
                                 : at::empty({B, S, w.heads, D}, h.options());
  const int64_t M = idx.defined() ? idx.numel() : T;
  at::Tensor ws = at::empty({total(pre_pieces(w, T, M, idx.defined(), E))}, h.options());
  const Heads heads = pre_rows(w, hc.data_ptr<float>(), idx, T, E, qkv.data_ptr<float>(), ws.data_ptr<float>());
  at::Tensor qk = at::empty({B, nqk, S, D}, h.options());
  float* qk_p = qk.data_ptr<float>();
  rotate_heads(heads, tables, B, S,
               [&](int64_t b, int64_t j, int64_t i) { return qk_p + ((b * nqk + j) * S + i) * D; });
  return {qk, qkv.transpose(1, 2).slice(1, nqk)};
}

// A layer's weights after the attention (decoder_post_attention's arguments), checked: attention rows of width A.
struct PostLayer {
  PackedLinear o, gu, dn;
  const float* w2;
  double eps;
  int64_t I, A;
  at::Tensor keep_w;
};

PostLayer post_layer(const at::Tensor& o_q, const at::Tensor& o_d, const at::Tensor& o_m, int64_t o_bits,
                     const OptTensor& o_bias, const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_q,
                     const at::Tensor& gate_up_d, const at::Tensor& gate_up_m, int64_t gate_up_bits,
                     const OptTensor& gate_up_bias, const at::Tensor& down_q, const at::Tensor& down_d,
                     const at::Tensor& down_m, int64_t down_bits, const OptTensor& down_bias, int64_t E, int64_t A) {
  TORCH_CHECK(gate_up_q.dim() == 2 && gate_up_q.size(0) % 2 == 0, "gate_up_q: expected [2 I, ...] (gate and up "
              "stacked), got ", gate_up_q.sizes());
  const int64_t I = gate_up_q.size(0) / 2;
  PostLayer w{packed_linear(o_q, o_d, o_m, o_bits, o_bias, A, "o_"),
              packed_linear(gate_up_q, gate_up_d, gate_up_m, gate_up_bits, gate_up_bias, E, "gate_up_"),
              packed_linear(down_q, down_d, down_m, down_bits, down_bias, I, "down_"), nullptr, eps, I, A, {}};
  TORCH_CHECK(w.o.N == E, "o_q: expected ", E, " output rows (h's E), got ", o_q.sizes());
  TORCH_CHECK(w.dn.N == E, "down_q: expected ", E, " output rows (h's E), got ", down_q.sizes());
  w.w2 = norm_weight_ptr(norm_weight, "E", E, eps, "norm_weight", w.keep_w);
  return w;
}

// The workspace of post_rows, as pre_pieces.
int64_t post_space(const PostLayer& w, int64_t M, bool indexed, int64_t E) {
  const int64_t live = indexed ? M : 0;
  return line(live * w.A) + line(live * E) + 3 * line(M * E) + line(2 * M * w.I) + line(M * w.I);
}

// decoder_post_attention's steps on raw rows: h [T, E] and attn [T, A]'s live rows (idx, or all T) into out [T, E]
// (its other rows left as they are: the caller's zeros). ws: post_space(...) floats.
void post_rows(const PostLayer& w, const float* h, const float* attn, const at::Tensor& idx, int64_t T, int64_t E,
               float* out, float* ws) {
  const bool indexed = idx.defined();
  const int64_t M = indexed ? idx.numel() : T, live = indexed ? M : 0, A = w.A, I = w.I;
  float* a_rows = ws;                          // the live rows of attn [M, A] and of h [M, E]
  float* h_rows = a_rows + line(live * A);
  float* h1 = h_rows + line(live * E);         // h + o_proj(attn) [M, E]
  float* xn = h1 + line(M * E);                // its norm [M, E]
  float* down = xn + line(M * E);              // [M, E]
  float* gate_up = down + line(M * E);         // [M, 2 I]
  float* act = gate_up + line(2 * M * I);      // silu(gate) x up [M, I]
  const float* hr = gather(h, E, idx, h_rows);
  packed_rows(gather(attn, A, idx, a_rows), M, w.o, h1);
  for (int64_t k = 0; k < M * E; ++k) h1[k] = hr[k] + h1[k];
  rms_rows(h1, M, E, w.w2, w.eps, xn);
  packed_rows(xn, M, w.gu, gate_up);
  // ATen's silu on the gate columns, as the Python forward calls it on gu[..., :I] (the same view), then x up
  at::Tensor act_t = at::from_blob(act, {M, I}, at::kFloat);
  at::silu_out(act_t, at::from_blob(gate_up, {M, I}, {2 * I, 1}, at::kFloat));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < I; ++j) act[r * I + j] = act[r * I + j] * gate_up[r * 2 * I + I + j];
  packed_rows(act, M, w.dn, down);
  for (int64_t r = 0; r < M; ++r) {
    float* y = row_out(out, E, idx, r);
    for (int64_t k = 0; k < E; ++k) y[k] = h1[r * E + k] + down[r * E + k];
  }
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
  int64_t A = 1;  // the attention's width per row
  for (int64_t i = 2; i < attn.dim(); ++i) A *= attn.size(i);
  const PostLayer w = post_layer(o_q, o_d, o_m, o_bits, o_bias, norm_weight, eps, gate_up_q, gate_up_d, gate_up_m,
                                 gate_up_bits, gate_up_bias, down_q, down_d, down_m, down_bits, down_bias, E, A);
  const at::Tensor idx = live_index(index, T);
  const int64_t M = idx.defined() ? idx.numel() : T;
  const at::Tensor hc = h.contiguous(), ac = attn.reshape({T, A}).contiguous();
  at::Tensor out = idx.defined() ? at::zeros({B, S, E}, h.options()) : at::empty({B, S, E}, h.options());
  at::Tensor ws = at::empty({post_space(w, M, idx.defined(), E)}, h.options());
  post_rows(w, hc.data_ptr<float>(), ac.data_ptr<float>(), idx, T, E, out.data_ptr<float>(), ws.data_ptr<float>());
  return out;
}

// Per layer: the entries of decoder_stack's weights, ints and floats (csrc/layer.cpp).
constexpr int64_t kWeights = 20, kInts = 6, kFloats = 5;

// Row (b, h, r) of a cache [B, Hkv, C, D] (its D values at the cache's stride(3)).
float* cache_row(const at::Tensor& c, int64_t b, int64_t h, int64_t r) {
  return c.data_ptr<float>() + b * c.stride(0) + h * c.stride(1) + r * c.stride(2);
}
void put_row(const float* x, int64_t D, float* dst, int64_t stride) {
  if (stride == 1) std::copy(x, x + D, dst);
  else for (int64_t d = 0; d < D; ++d) dst[d * stride] = x[d];
}

at::Tensor decoder_stack_cpu(const at::Tensor& h, const c10::List<OptTensor>& weights, at::IntArrayRef ints,
                             at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                             at::TensorList k_caches, at::TensorList v_caches, int64_t start, const at::Tensor& mask,
                             const OptTensor& index) {
  // the stack's own tensors (views of the caches, ATen's silu on its rows) made below autograd's dispatch keys,
  // without its view tracking
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L, "v_caches: expected one per layer (", L,
              " as k_caches), got ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * L && static_cast<int64_t>(ints.size()) == kInts * L &&
                  static_cast<int64_t>(floats.size()) == kFloats * L,
              "weights, ints, floats: expected ", kWeights, ", ", kInts, " and ", kFloats, " entries per layer (", L,
              " layers: k_caches), got ", weights.size(), ", ", ints.size(), " and ", floats.size());
  check_hidden(h, "h");
  if (L == 0) return h;
  const int64_t B = h.size(0), S = h.size(1), E = h.size(2), T = B * S;
  const int64_t n_q = ints[4], n_kv = ints[5], nqk = n_q + n_kv;
  TORCH_CHECK(n_q >= 1 && n_kv >= 1 && n_q % n_kv == 0, "ints: layer 0's n_q, n_kv: expected >= 1, n_q a multiple "
              "of n_kv, got ", n_q, " and ", n_kv);
  const fastverify::cpu::RotaryTables tables(cos, sin, B, nqk, S, -1, "q and k's heads'");
  const int64_t D = tables.dim(), A = n_q * D;
  auto required = [&](int64_t i, const char* name) -> at::Tensor {
    const OptTensor w = weights.get(i);
    TORCH_CHECK(w.has_value(), "weights: entry ", i, " (layer ", i / kWeights, "'s ", name, ") is None");
    return *w;
  };
  // every layer checked before any runs (the caches are written in place)
  std::vector<PreLayer> pre;
  std::vector<PostLayer> post;
  pre.reserve(L), post.reserve(L);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = kWeights * l;
    const int64_t* n = ints.data() + kInts * l;
    const double* f = floats.data() + kFloats * l;
    TORCH_CHECK(n[4] == n_q && n[5] == n_kv, "ints: layer ", l, "'s n_q, n_kv: expected layer 0's ", n_q, " and ",
                n_kv, ", got ", n[4], " and ", n[5]);
    const OptTensor qn = weights.get(w + 5), kn = weights.get(w + 6);
    TORCH_CHECK(qn.has_value() == kn.has_value(), "weights: layer ", l,
                "'s q_norm_weight, k_norm_weight: expected both or neither");
    pre.push_back(pre_layer(required(w, "norm_weight"), f[0], required(w + 1, "qkv_q"), required(w + 2, "qkv_d"),
                            required(w + 3, "qkv_m"), n[0], weights.get(w + 4), n_q, n_kv, qn, f[1], kn, f[2], E, D));
    post.push_back(post_layer(required(w + 7, "o_q"), required(w + 8, "o_d"), required(w + 9, "o_m"), n[1],
                              weights.get(w + 10), required(w + 11, "post-attention norm_weight"), f[3],
                              required(w + 12, "gate_up_q"), required(w + 13, "gate_up_d"),
                              required(w + 14, "gate_up_m"), n[2], weights.get(w + 15), required(w + 16, "down_q"),
                              required(w + 17, "down_d"), required(w + 18, "down_m"), n[3], weights.get(w + 19), E,
                              A));
    fastverify::cpu::check_caches(k_caches[l], v_caches[l], B, n_kv, D, start, S,
                                  "k_caches[" + std::to_string(l) + "]", "v_caches[" + std::to_string(l) + "]");
  }
  const at::Tensor idx = live_index(index, T);
  const bool indexed = idx.defined();
  const int64_t M = indexed ? idx.numel() : T, keys = start + S;
  fastverify::cpu::AttentionTasks att;  // the mask and its skipped prefix: the same for every layer
  att.B = B, att.Hq = n_q, att.Hkv = n_kv, att.n = S, att.S = keys, att.D = att.Dv = D;
  att.set_mask(mask, /*skip_masked_prefix=*/true);
  at::Tensor out = indexed ? at::zeros({B, S, E}, h.options()) : at::empty({B, S, E}, h.options());
  if (T == 0) return out;
  // one workspace: the hidden rows between layers, qkv, the rotated q heads, the attention's rows, then the larger of
  // pre_rows' and post_rows' pieces (zeros where rows are not live: pre_rows and post_rows write the live ones only)
  int64_t scratch = 0;
  for (int64_t l = 0; l < L; ++l)
    scratch = std::max({scratch, total(pre_pieces(pre[l], T, M, indexed, E)), post_space(post[l], M, indexed, E)});
  const int64_t heads = n_q + 2 * n_kv;
  const int64_t size = 2 * line(T * E) + line(T * heads * D) + line(T * nqk * D) + line(T * A) + scratch;
  at::Tensor ws = indexed ? at::zeros({size}, h.options()) : at::empty({size}, h.options());
  float* hidden[2] = {ws.data_ptr<float>(), ws.data_ptr<float>() + line(T * E)};  // between layers, in turn
  float* qkv = hidden[1] + line(T * E);
  float* qk_rot = qkv + line(T * heads * D);  // [T, n_q + n_kv, D]: the rotated q heads, then k heads
  float* attn = qk_rot + line(T * nqk * D);   // [T, n_q x D]: [B, S, Hq, D], what o_proj reads
  float* scratch_p = attn + line(T * A);
  const at::Tensor hc = h.contiguous();
  att.q = qk_rot, att.q_b = S * nqk * D, att.q_h = D, att.q_i = nqk * D, att.q_d = 1;
  att.out = attn, att.o_b = S * A, att.o_h = D, att.o_i = A;
  const float* x = hc.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    const Heads hv = pre_rows(pre[l], x, idx, T, E, qkv, scratch_p);
    rotate_heads(hv, tables, B, S,
                 [&](int64_t b, int64_t j, int64_t i) { return qk_rot + ((b * S + i) * nqk + j) * D; });
    for (int64_t b = 0; b < B; ++b)  // append_attention's copies of k and v into rows [start, start + S)
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < n_kv; ++j) {
          const int64_t t = b * S + i;
          put_row(qk_rot + (t * nqk + n_q + j) * D, D, cache_row(kc, b, j, start + i), kc.stride(3));
          put_row(qkv + (t * heads + nqk + j) * D, D, cache_row(vc, b, j, start + i), vc.stride(3));
        }
    att.set_keys(kc.narrow(2, 0, keys), vc.narrow(2, 0, keys));  // the keys of rows [0, start + S)
    att.scale = static_cast<float>(floats[kFloats * l + 4]);
    at::parallel_for(0, B * n_kv, 1, [&](int64_t t0, int64_t t1) { att.run(t0, t1); });
    float* y = l + 1 == L ? out.data_ptr<float>() : hidden[l % 2];
    post_rows(post[l], x, attn, idx, T, E, y, scratch_p);
    x = y;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("decoder_pre_attention", &decoder_pre_attention_cpu);
  m.impl("decoder_post_attention", &decoder_post_attention_cpu);
  m.impl("decoder_stack", &decoder_stack_cpu);
}
