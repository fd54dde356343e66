// CPU kernels of fastverify::decoder_pre_attention / decoder_post_attention (schema and semantics: csrc/layer.cpp):
// the registered ops rms_norm, skinny_linear_packed and rotary_embedding, and ATen's silu, mul and add, called in
// the order and on the tensors of fastverify/hf/layers.py `_forward`, so that every result is the same bits.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "layer.h"

namespace {

using fastverify::layer::qk_heads;
using fastverify::layer::rms_norm;
using fastverify::layer::rotary;
using fastverify::layer::silu_gate;

using OptTensor = std::optional<at::Tensor>;

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                         int64_t bits, const OptTensor& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastverify::skinny_linear_packed", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            const OptTensor&)>();
  return op.call(x, q, d, m, bits, bias);
}

// The live rows of h [B, S, E] (``index``), or h itself; checked.
at::Tensor live_rows(const at::Tensor& h, const OptTensor& index) {
  if (!index.has_value()) return h;
  const at::Tensor& idx = *index;
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.dim() == 1, "index: expected an int64 "
              "CPU tensor [M], got ", idx.scalar_type(), " ", idx.sizes(), " on ", idx.device());
  return h.reshape({-1, h.size(2)}).index_select(0, idx);  // index_select checks the range
}

// rows [M, N] back in the layout of h's B S rows, zeros between them (fastverify.hf.layers.scatter_rows).
at::Tensor scatter_rows(const at::Tensor& rows, const at::Tensor& index, int64_t total) {
  return at::zeros({total, rows.size(-1)}, rows.options()).index_copy_(0, index, rows);
}

void check_hidden(const at::Tensor& h, const char* name) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 3, name,
              ": expected a float32 CPU tensor [B, S, E], got ", h.scalar_type(), " ", h.sizes(), " on ", h.device());
}

std::tuple<at::Tensor, at::Tensor> decoder_pre_attention_cpu(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_q, const at::Tensor& qkv_d,
    const at::Tensor& qkv_m, int64_t qkv_bits, const OptTensor& qkv_bias, const at::Tensor& cos,
    const at::Tensor& sin, int64_t n_q, int64_t n_kv, const OptTensor& index, const OptTensor& q_norm_weight,
    double q_norm_eps, const OptTensor& k_norm_weight, double k_norm_eps) {
  check_hidden(h, "h");
  TORCH_CHECK(n_q >= 1 && n_kv >= 1, "n_q, n_kv: expected >= 1, got ", n_q, " and ", n_kv);
  TORCH_CHECK(cos.dim() == 4, "cos: expected [B or 1, 1, S, D], got ", cos.sizes());
  const int64_t D = cos.size(3), heads = n_q + 2 * n_kv;
  TORCH_CHECK(qkv_q.dim() == 2 && qkv_q.size(0) == heads * D, "qkv_q: expected ", heads * D,
              " output rows ((n_q + 2 n_kv) x head dimension ", D, "), got ", qkv_q.sizes());
  const int64_t B = h.size(0), S = h.size(1);
  at::Tensor qkv = linear_packed(rms_norm(live_rows(h, index), norm_weight, eps), qkv_q, qkv_d, qkv_m, qkv_bits,
                                 qkv_bias);
  if (index.has_value()) qkv = scatter_rows(qkv, *index, B * S);
  qkv = qkv.view({B, S, heads, D});
  const at::Tensor qk = rotary(qk_heads(qkv, n_q, n_kv, q_norm_weight, q_norm_eps, k_norm_weight, k_norm_eps), cos,
                               sin);
  return {qk, qkv.transpose(1, 2).slice(1, n_q + n_kv)};
}

at::Tensor decoder_post_attention_cpu(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o_q,
                                      const at::Tensor& o_d, const at::Tensor& o_m, int64_t o_bits,
                                      const OptTensor& o_bias, const at::Tensor& norm_weight, double eps,
                                      const at::Tensor& gate_up_q, const at::Tensor& gate_up_d,
                                      const at::Tensor& gate_up_m, int64_t gate_up_bits, const OptTensor& gate_up_bias,
                                      const at::Tensor& down_q, const at::Tensor& down_d, const at::Tensor& down_m,
                                      int64_t down_bits, const OptTensor& down_bias, const OptTensor& index) {
  check_hidden(h, "h");
  TORCH_CHECK(attn.dim() >= 3 && attn.size(0) == h.size(0) && attn.size(1) == h.size(1), "attn: expected [",
              h.size(0), ", ", h.size(1), ", ...] (h's rows), got ", attn.sizes());
  TORCH_CHECK(gate_up_q.dim() == 2 && gate_up_q.size(0) % 2 == 0, "gate_up_q: expected [2 I, ...] (gate and up "
              "stacked), got ", gate_up_q.sizes());
  const int64_t inter = gate_up_q.size(0) / 2;
  const int64_t B = h.size(0), S = h.size(1);
  const at::Tensor a = index.has_value() ? attn.reshape({B * S, -1}).index_select(0, *index)
                                         : attn.reshape({B, S, -1});
  const at::Tensor h1 = at::add(live_rows(h, index), linear_packed(a.contiguous(), o_q, o_d, o_m, o_bits, o_bias));
  const at::Tensor gu = linear_packed(rms_norm(h1, norm_weight, eps), gate_up_q, gate_up_d, gate_up_m,
                                      gate_up_bits, gate_up_bias);
  const at::Tensor out =
      at::add(h1, linear_packed(silu_gate(gu, inter), down_q, down_d, down_m, down_bits, down_bias));
  return index.has_value() ? scatter_rows(out, *index, B * S).view({B, S, -1}) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("decoder_pre_attention", &decoder_pre_attention_cpu);
  m.impl("decoder_post_attention", &decoder_post_attention_cpu);
}
