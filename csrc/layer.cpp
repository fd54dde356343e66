// Schema of the two halves of a Llama-style decoder layer around its attention, for the loop's forward (kernels:
// csrc/cpu/layer.cpp for the packed ops; the dense ops' composite below; reference: fastverify/hf/layers.py
// `_forward`, op for op).
//
//   decoder_pre_attention(h float32 [B, S, E], norm_weight [E], eps, qkv packed [N = (n_q + 2 n_kv) D] (q, d, m,
//                         bits as fastverify.ops.linear.PackedWeight), qkv_bias [N] or None, cos [B or 1, 1, S, D],
//                         sin (as cos), n_q, n_kv) -> (qk [B, n_q + n_kv, S, D], v [B, n_kv, S, D])
//       x = rms_norm(h); qkv = skinny_linear_packed(x) viewed [B, S, n_q + 2 n_kv, D]; q and k rotated together by
//       rotary_embedding (q = qk[:, :n_q], k = qk[:, n_q:]: two outputs of an op may not share memory), v a view
//       of qkv. CPU only, float32, packed projections (a GGUF model's).
//   decoder_post_attention(h [B, S, E], attn float32 [B, S, n_q, D] or [B, S, n_q D] (the attention's output),
//                          the output projection packed and its bias, norm_weight, eps, the stacked gate / up
//                          projections packed [2 I, E] and their bias, the down projection packed and its bias)
//                          -> h' [B, S, E]
//       h1 = h + o_proj(attn); h' = h1 + down_proj(silu(gate) * up) with [gate | up] = gate_up(rms_norm(h1)).
//   index (both; int64 [M] or None): the live rows of a batch's forward (fastverify.hf.layers.LiveRows: flat indices
//       into the B S rows): the norms, projections and MLP run on those rows only, and the rows between them come
//       out as zeros (q / k / v, and h'), as the Python forward's index_select / scatter_rows give them.
//   q_norm_weight, q_norm_eps, k_norm_weight, k_norm_eps (both pre-attention ops; the weights [D] or None, both or
//       neither): Qwen3's RMSNorm of each q head and each k head over its D dimensions, before the rotation.
//   decoder_stack(h, weights, ints, floats, cos, sin, k_caches, v_caches (mutated), start, mask, index) -> h'
//       L decoder layers in a row, each decoder_pre_attention, append_attention of its q, k, v into k_caches[l] /
//       v_caches[l] at row start (scale and mask as there), then decoder_post_attention: one call for a step's whole
//       stack (fastverify/hf/layers.py `_Stack`), bit for bit the layers' own calls. Per layer l, 20 entries of
//       weights: norm_weight, qkv_q, qkv_d, qkv_m, qkv_bias, q_norm_weight, k_norm_weight, o_q, o_d, o_m, o_bias,
//       post-attention norm_weight, gate_up_q, gate_up_d, gate_up_m, gate_up_bias, down_q, down_d, down_m,
//       down_bias (None where absent); 6 of ints: qkv_bits, o_bits, gate_up_bits, down_bits, n_q, n_kv; 5 of
//       floats: eps, q_norm_eps, k_norm_eps, the post-attention eps, the attention's scale. CPU only.
//
//   decoder_pre_attention_dense(h [B, S, E], norm_weight, eps, qkv_weight [W_q, W_k, W_v], qkv_bias [b_q, b_k,
//                               b_v] (each None or a tensor), cos [B or 1, 1, S, D], sin (as cos), sin_rolled
//                               ([-sin_lo, sin_hi], as cos), n_q, n_kv, skinny_rows) -> (qk, v)
//   decoder_post_attention_dense(h, attn, o_weight, o_bias, norm_weight, eps, gate_up_weight [W_gate, W_up],
//                                gate_up_bias, down_weight, down_bias, skinny_rows) -> h'
//       The same steps on unpacked weights in any dtype and on any device, as the Python forward takes them there:
//       each projection its own (q / k / v and gate / up concatenated): F.linear, or, for float32 inputs of at most
//       skinny_rows rows (> 0: the projections run fastverify.hf.linear.skinny_linears' forward), skinny_linear;
//       RMSNorm and the rotary embedding as the rms_norm / rotary_embedding ops on float32 CPU tensors, else as
//       torch's expressions (RMSNorm in float32, cast back; x cos + roll(x, D / 2) sin_rolled). A composite for every
//       dispatch key: on a GPU each op of the Python forward costs the host a Python call beside its launch, and
//       these calls leave the launches.
//
// Each step is the arithmetic of the registered op or the ATen op that the Python forward calls, so the results are
// the same bits: one call from Python where the Python forward makes about twenty (views, slices, norms,
// projections, the activation, residual additions), which on a small model's one-row step is most of a layer's
// time outside its kernels. The packed ops' CPU kernels (csrc/cpu/layer.cpp) go further: the projections, norms and
// rotation run on raw rows of one workspace (csrc/cpu/kernels.h), without a tensor or a dispatcher call per step
// (SmolLM2-135M, one row, 2-core AMD EPYC VM: a layer's two calls 132 against 158 us, its projections ~114 us).
// Inference only (no autograd); what the ops do not take runs the Python forward.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "layer.h"

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("decoder_pre_attention(Tensor h, Tensor norm_weight, float eps, Tensor qkv_q, Tensor qkv_d, Tensor qkv_m, "
        "int qkv_bits, Tensor? qkv_bias, Tensor cos, Tensor sin, int n_q, int n_kv, Tensor? index=None, "
        "Tensor? q_norm_weight=None, float q_norm_eps=0.0, Tensor? k_norm_weight=None, float k_norm_eps=0.0) "
        "-> (Tensor, Tensor)");
  m.def("decoder_post_attention(Tensor h, Tensor attn, Tensor o_q, Tensor o_d, Tensor o_m, int o_bits, "
        "Tensor? o_bias, Tensor norm_weight, float eps, Tensor gate_up_q, Tensor gate_up_d, Tensor gate_up_m, "
        "int gate_up_bits, Tensor? gate_up_bias, Tensor down_q, Tensor down_d, Tensor down_m, int down_bits, "
        "Tensor? down_bias, Tensor? index=None) -> Tensor");
  m.def("decoder_stack(Tensor h, Tensor?[] weights, int[] ints, float[] floats, Tensor cos, Tensor sin, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int start, Tensor mask, Tensor? index=None) -> Tensor");
  m.def("decoder_pre_attention_dense(Tensor h, Tensor norm_weight, float eps, Tensor[] qkv_weight, Tensor?[] qkv_bias, "
        "Tensor cos, Tensor sin, Tensor sin_rolled, int n_q, int n_kv, int skinny_rows=0, Tensor? q_norm_weight=None, "
        "float q_norm_eps=0.0, Tensor? k_norm_weight=None, float k_norm_eps=0.0) -> (Tensor, Tensor)");
  m.def("decoder_post_attention_dense(Tensor h, Tensor attn, Tensor o_weight, Tensor? o_bias, Tensor norm_weight, "
        "float eps, Tensor[] gate_up_weight, Tensor?[] gate_up_bias, Tensor down_weight, Tensor? down_bias, "
        "int skinny_rows=0) -> Tensor");
}

namespace {

using OptTensor = std::optional<at::Tensor>;
using OptTensorList = c10::List<OptTensor>;

using fastverify::layer::cpu_float;
using fastverify::layer::qk_heads;
using fastverify::layer::rms;

// A projection as its nn.Linear forward computes it: F.linear, or, under skinny_linears (skinny_rows > 0), the
// skinny_linear op for float32 inputs of at most skinny_rows rows (fastverify.hf.linear.takes_skinny).
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, int64_t skinny_rows) {
  if (skinny_rows > 0 && x.scalar_type() == at::kFloat && x.numel() <= skinny_rows * x.size(-1)) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fastverify::skinny_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
    return op.call(x, weight, bias);
  }
  return at::linear(x, weight, bias);
}

at::Tensor linears_cat(const at::Tensor& x, at::TensorList weights, const OptTensorList& biases,
                       int64_t skinny_rows) {
  TORCH_CHECK(weights.size() == biases.size(), "biases: expected one (or None) per weight, got ", biases.size(),
              " for ", weights.size());
  std::vector<at::Tensor> out;
  out.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) out.push_back(linear_dense(x, weights[i], biases.get(i), skinny_rows));
  return at::cat(out, -1);
}

void check_dense_hidden(const at::Tensor& h) {
  TORCH_CHECK(h.dim() == 3 && h.is_floating_point(), "h: expected a floating-point tensor [B, S, E], got ",
              h.scalar_type(), " ", h.sizes());
}

std::tuple<at::Tensor, at::Tensor> decoder_pre_attention_dense(const at::Tensor& h, const at::Tensor& norm_weight,
                                                               double eps, at::TensorList qkv_weight,
                                                               const OptTensorList& qkv_bias, const at::Tensor& cos,
                                                               const at::Tensor& sin, const at::Tensor& sin_rolled,
                                                               int64_t n_q, int64_t n_kv, int64_t skinny_rows,
                                                               const OptTensor& q_norm_weight, double q_norm_eps,
                                                               const OptTensor& k_norm_weight, double k_norm_eps) {
  check_dense_hidden(h);
  TORCH_CHECK(n_q >= 1 && n_kv >= 1, "n_q, n_kv: expected >= 1, got ", n_q, " and ", n_kv);
  TORCH_CHECK(qkv_weight.size() == 3, "qkv_weight: expected [W_q, W_k, W_v], got ", qkv_weight.size(), " tensors");
  TORCH_CHECK(cos.dim() == 4 && sin.sizes() == cos.sizes() && sin_rolled.sizes() == cos.sizes(), "cos, sin, "
              "sin_rolled: expected [B or 1, 1, S, D] each, got ", cos.sizes(), ", ", sin.sizes(), " and ",
              sin_rolled.sizes());
  const int64_t D = cos.size(3), heads = n_q + 2 * n_kv;
  const at::Tensor qkv = linears_cat(rms(h, norm_weight, eps), qkv_weight, qkv_bias, skinny_rows);
  TORCH_CHECK(qkv.size(-1) == heads * D, "qkv_weight: expected ", heads * D, " output rows in all ((n_q + 2 n_kv) "
              "x head dimension ", D, "), got ", qkv.size(-1));
  const at::Tensor heads_view = qkv.view({h.size(0), h.size(1), heads, D});
  const at::Tensor qk = qk_heads(heads_view, n_q, n_kv, q_norm_weight, q_norm_eps, k_norm_weight, k_norm_eps);
  // as `_forward`: the rotary_embedding op on float32 CPU tensors (the expression's bits), else the expression
  const at::Tensor rotated = cpu_float(qk) && cos.scalar_type() == at::kFloat
                                 ? fastverify::layer::rotary(qk, cos, sin)
                                 : at::add(at::mul(qk, cos), at::mul(at::roll(qk, {D / 2}, {-1}), sin_rolled));
  return {rotated, heads_view.transpose(1, 2).slice(1, n_q + n_kv)};
}

at::Tensor decoder_post_attention_dense(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o_weight,
                                        const OptTensor& o_bias, const at::Tensor& norm_weight, double eps,
                                        at::TensorList gate_up_weight, const OptTensorList& gate_up_bias,
                                        const at::Tensor& down_weight, const OptTensor& down_bias,
                                        int64_t skinny_rows) {
  check_dense_hidden(h);
  TORCH_CHECK(attn.dim() >= 3 && attn.size(0) == h.size(0) && attn.size(1) == h.size(1), "attn: expected [",
              h.size(0), ", ", h.size(1), ", ...] (h's rows), got ", attn.sizes());
  TORCH_CHECK(gate_up_weight.size() == 2, "gate_up_weight: expected [W_gate, W_up], got ", gate_up_weight.size(),
              " tensors");
  const int64_t inter = gate_up_weight[0].size(0);
  const at::Tensor a = attn.reshape({h.size(0), h.size(1), -1}).contiguous();
  const at::Tensor h1 = at::add(h, linear_dense(a, o_weight, o_bias, skinny_rows));
  const at::Tensor gu = linears_cat(rms(h1, norm_weight, eps), gate_up_weight, gate_up_bias, skinny_rows);
  const at::Tensor act = fastverify::layer::silu_gate(gu, inter);
  return at::add(h1, linear_dense(act, down_weight, down_bias, skinny_rows));
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CompositeExplicitAutograd, m) {
  m.impl("decoder_pre_attention_dense", &decoder_pre_attention_dense);
  m.impl("decoder_post_attention_dense", &decoder_post_attention_dense);
}
