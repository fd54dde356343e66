// What the decoder layer ops (csrc/cpu/layer.cpp, csrc/layer.cpp) share: the registered ops they call through the
// dispatcher (so that each step is the op the Python forward calls, the same bits), and the MLP's gate.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

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

// silu(gate) * up, with gate and up the first inter and the other columns of gu (fastverify/hf/layers.py
// `_forward`: act(gu[..., :inter]) * gu[..., inter:]).
inline at::Tensor silu_gate(const at::Tensor& gu, int64_t inter) {
  return at::mul(at::silu(gu.slice(-1, 0, inter)), gu.slice(-1, inter));
}

}  // namespace fastverify::layer
