// What the dense decoder layer ops (csrc/layer.cpp) call: the registered ops through the dispatcher (so that each
// step is the op the Python forward calls, the same bits), and the MLP's gate. (The packed ops' CPU kernels,
// csrc/cpu/layer.cpp, run the same arithmetic on raw rows: csrc/cpu/kernels.h.)
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace fastverify::layer {

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastverify::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

inline at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastverify::rotary_embedding", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(x, cos, sin);
}

inline bool cpu_float(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

// fastverify/hf/layers.py `_rms`: the rms_norm op where it takes h (the same bits as the expression), else
// transformers' RMSNorm with the float32 casts that are no-ops on a float32 input left out.
inline at::Tensor rms(const at::Tensor& h, const at::Tensor& weight, double eps) {
  if (cpu_float(h) && cpu_float(weight) && h.is_contiguous()) return rms_norm(h, weight, eps);
  const bool f32 = h.scalar_type() == at::kFloat;
  const at::Tensor x32 = f32 ? h : h.to(at::kFloat);
  const at::Tensor x = at::mul(x32, at::rsqrt(at::add(at::mean(at::pow(x32, 2), {-1}, /*keepdim=*/true), eps)));
  return at::mul(weight, f32 ? x : x.to(h.scalar_type()));
}

// q and k of qkv [B, S, heads, D] (the first n_q heads, then n_kv), as [B, n_q + n_kv, S, D] for the rotation; with
// Qwen3's q_norm / k_norm (RMSNorm over each head's dimensions) first when their weights are given
// (fastverify/hf/layers.py `_forward`: torch.cat((_rms(q heads), _rms(k heads)), -2).transpose(1, 2)).
inline at::Tensor qk_heads(const at::Tensor& qkv, int64_t n_q, int64_t n_kv, const std::optional<at::Tensor>& q_norm,
                           double q_eps, const std::optional<at::Tensor>& k_norm, double k_eps) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm_weight, k_norm_weight: expected both or neither");
  if (!q_norm.has_value()) return qkv.slice(2, 0, n_q + n_kv).transpose(1, 2);
  const int64_t D = qkv.size(3);
  for (const auto& [w, name] : {std::pair{&*q_norm, "q_norm_weight"}, {&*k_norm, "k_norm_weight"}})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == D, name, ": expected [D = ", D, "] (the head dimension), got ",
                w->sizes());
  return at::cat({rms(qkv.slice(2, 0, n_q), *q_norm, q_eps), rms(qkv.slice(2, n_q, n_q + n_kv), *k_norm, k_eps)}, -2)
      .transpose(1, 2);
}

// silu(gate) * up, with gate and up the first inter and the other columns of gu (fastverify/hf/layers.py
// `_forward`: act(gu[..., :inter]) * gu[..., inter:]).
inline at::Tensor silu_gate(const at::Tensor& gu, int64_t inter) {
  return at::mul(at::silu(gu.slice(-1, 0, inter)), gu.slice(-1, inter));
}

}  // namespace fastverify::layer
