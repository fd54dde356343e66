// What the CPU ops share with each other beyond their schemas: the checked packed projection of skinny_linear_packed,
// the rows of rms_norm, the checked tables and rows of rotary_embedding, masked_attention's tasks and
// append_attention's cache checks, each defined beside its own op (csrc/cpu/linear.cpp, norm.cpp, rotary.cpp,
// attention.cpp) and called by the decoder layer ops (csrc/cpu/layer.cpp) on raw rows, so that a layer's steps are
// those ops' own arithmetic without a dispatcher call or a tensor per step.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "linear.h"

namespace fastverify::cpu {

// A packed projection [N, K] (fastverify.ops.linear.PackedWeight: q, d, m, bits) and its bias, checked as
// skinny_linear_packed checks them, the messages naming the arguments with ``name`` before them ("o_": o_q, o_bias,
// ...); holds contiguous copies of what it points to.
struct PackedLinear {
  linear::Packed p;
  int64_t N;
  const float* bias;
  at::Tensor q, d, m, b;
};
PackedLinear packed_linear(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                           const std::optional<at::Tensor>& bias, int64_t K, const char* name);

// y [M, N] = x [M, K] W^T (+ bias), skinny_linear_packed's result bit for bit; the columns split across threads.
void packed_rows(const float* x, int64_t M, const PackedLinear& w, float* y);

// rms_norm's result for rows [rows, D] of x into y (may not alias x): torch's sum of squares (at::sum), then the
// elementwise steps of csrc/cpu/norm.cpp.
void rms_rows(const float* x, int64_t rows, int64_t D, const float* weight, double eps, float* y);

// rotary_embedding's tables: cos / sin [A or 1, H or 1, n or 1, D] for rows [A, H, n] of D values each, checked
// (4-D float32 CPU tensors of one shape that broadcasts to [A, H, n, D]; D < 0: cos's last dimension, which must
// be even; ``rows`` names the rows in the messages) and read with each row's D values contiguous (copies where
// the last dimension is strided).
class RotaryTables {
 public:
  RotaryTables(const at::Tensor& cos, const at::Tensor& sin, int64_t A, int64_t H, int64_t n, int64_t D,
               const char* rows);
  int64_t dim() const { return D_; }
  // rotary_embedding's result for row (a, h, i) of x's D values: y = x cos + rotate_half(x) sin, each product
  // rounded before the sum.
  void rotate(const float* x, int64_t a, int64_t h, int64_t i, float* y) const;

 private:
  at::Tensor cos_, sin_;  // what c_ / s_ point into
  const float* c_;
  const float* s_;
  int64_t D_, cs_[3], ss_[3];
};

// masked_attention's work on raw pointers and strides: one task per (batch row, key / value head), its group's
// query rows gathered into one block, then csrc/attention.h's kernel. q [B, Hq, n, D] (any strides), k and v
// [B, Hkv, S, D] (each key's D values contiguous), out [B, Hq, n, D] (strides o_b, o_h, o_i; D values contiguous).
// A row's result does not depend on the other rows nor on how the tasks are split across threads.
struct AttentionTasks {
  int64_t B = 0, Hq = 0, Hkv = 0, n = 0, S = 0, D = 0, Dv = 0;  // Dv: the values' width (latent attention: < D)
  float scale = 1.0f;
  float softcap = 0.0f;            // the scores' soft cap (0: none; csrc/attention.h)
  const float* sinks = nullptr;    // [Hq]: each query head's sink logit, or none
  const float* q = nullptr;
  int64_t q_b = 0, q_h = 0, q_i = 0, q_d = 1;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_b = 0, k_h = 0, v_b = 0, v_h = 0;
  float* out = nullptr;
  int64_t o_b = 0, o_h = 0, o_i = 0;
  const float* mask = nullptr;  // additive [B, 1 or Hq, n, S] (m_h 0: one row for every head), or none
  int64_t m_b = 0, m_h = 0, m_i = 0;
  std::vector<int64_t> start;  // per batch row, the first key read
  // The mask (checked against B, Hq, n and S, which must be set) and each batch row's first key: with
  // skip_masked_prefix, the keys before the first one any of its rows sees, rounded down to 16 (csrc/attention.cpp).
  void set_mask(const std::optional<at::Tensor>& mask, bool skip_masked_prefix);
  // k [B, Hkv, S, D] and v [B, Hkv, S, Dv] (checked by the caller): views where each key's D values and each
  // value's Dv are contiguous, else copies.
  void set_keys(const at::Tensor& k, const at::Tensor& v);
  void run(int64_t t0, int64_t t1) const;  // tasks [t0, t1) of B x Hkv

 private:
  at::Tensor mask_, k_, v_;  // what mask, k and v point into
};

// append_attention's checks of the caches k_cache / v_cache [B, Hkv, C, D] that n rows go into at row start (the
// messages name them k_name / v_name).
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t B, int64_t Hkv, int64_t D,
                  int64_t start, int64_t n, const std::string& k_name, const std::string& v_name);

}  // namespace fastverify::cpu
