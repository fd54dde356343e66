// Framework-free arithmetic of the tree ops (schemas and layouts: csrc/tree.cpp). Raw pointers, sizes and
// strides only; the bindings in csrc/cpu/tree.cpp check inputs and parallelise over requests / rows.
// Element types T only need a conversion to and from float (float, c10::Half, c10::BFloat16).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_features.h"

namespace fastverify::tree {

// Depth of each node of one request (a child of the root has depth 1). parents[j] < j, so one pass.
inline void node_depths(const int32_t* parents, int64_t nb, int32_t* depth) {
  for (int64_t j = 0; j < nb; ++j) {
    const int32_t p = parents[j];
    depth[j] = p < 0 ? 1 : depth[p] + 1;
  }
}

// Packed ancestor rows of one request: rows [n, W] uint32; row i = row parents[i] | bit i for real nodes,
// zero for padding rows i >= nb. Each row is one OR of its parent's W words, so the request costs n * W.
inline void packed_rows(const int32_t* parents, int64_t nb, int64_t n, int64_t W, uint32_t* rows) {
  std::memset(rows, 0, sizeof(uint32_t) * n * W);
  for (int64_t i = 0; i < nb; ++i) {
    uint32_t* row = rows + i * W;
    const int32_t p = parents[i];
    if (p >= 0) std::memcpy(row, rows + int64_t(p) * W, sizeof(uint32_t) * W);
    row[i >> 5] |= uint32_t(1) << (i & 31);
  }
}

// One row of the dense mask ([P + n] elements, `yes` where visible, `no` elsewhere) of query node i of a
// request with nb nodes and prefix length plen: the prefix, then i's ancestors and i itself, found by walking
// up the parent links (depth steps). Padding rows (i >= nb) see only the prefix.
template <typename T>
inline void dense_row(const int32_t* parents, int64_t nb, int64_t plen, int64_t P, int64_t n, int64_t i, T yes,
                      T no, T* row) {
  std::fill(row, row + plen, yes);
  std::fill(row + plen, row + P + n, no);
  if (i >= nb) return;
  for (int64_t j = i; j >= 0; j = parents[j]) row[P + j] = yes;
}

// Positions of one request's nodes: plen + depth - 1.
inline void positions(const int32_t* parents, int64_t nb, int64_t plen, int64_t* out) {
  // depth fits in the output buffer's role: compute depth in place as int64.
  for (int64_t j = 0; j < nb; ++j) {
    const int32_t p = parents[j];
    out[j] = p < 0 ? plen : out[p] + 1;
  }
}

// ------------------------------------------------------------------------------------------------------------
// Tree attention of bfloat16 / float16 inputs (float32 goes through the masked-attention kernel,
// tree_attention_f32 in csrc/cpu/tree.cpp): flash-attention style online softmax on the CPU, for one task =
// (request b, kv head, a chunk of query rows of its GQA group). The rows of a task share their keys, so each key tile
// is converted to float (and K transposed) once and used by every row (query head h = hkv * group + r / n, node
// i = r % n).
// Draft tiles start at multiples of 32 keys, so one 32-bit word of the packed mask is a row's visibility of a
// whole tile. The tile arithmetic is written as plain loops over a compile-time tile width; it is compiled twice,
// for the baseline ISA and for AVX2 + FMA (chosen at run time), and the compiler vectorises both.

struct AttnShape {
  int64_t Hq, Hkv, n, S, P, D, W;
  int64_t q_sb, q_sh, q_si;  // strides of q [B, Hq, n, D] (unit stride in D)
  int64_t k_sb, k_sh, k_ss;  // strides of k [B, Hkv, S, D]
  int64_t v_sb, v_sh, v_ss;  // strides of v
  float scale;
};

constexpr int64_t kAttnRows = 32;  // query rows per task
constexpr int64_t kAttnKeys = 32;  // keys per tile: one packed mask word

// Floats of scratch one task needs.
inline int64_t attn_scratch_floats(int64_t D) {
  return kAttnRows * D * 2 + kAttnKeys * D * 2 + kAttnRows * 2;
}

#if defined(__GNUC__)
#define FV_TREE_INLINE __attribute__((always_inline)) inline
#else
#define FV_TREE_INLINE inline
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FV_TREE_AVX2 1
#endif

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial, about 1 ulp; results below
// e^-87 are clamped to ~1.6e-38 rather than flushed, callers zero masked entries themselves). Branch-free, so
// loops over it vectorise.
FV_TREE_INLINE float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &e, sizeof(float));
  return y * pow2;
}

// One tile of 32 keys for R rows: qf [R, D] (pre-scaled), kT [D, 32] (transposed, zero-padded), vf [32, D],
// vis[r] the row's visibility bits of the tile; updates the running max m, sum l and output acc [R, D].
// DC > 0: the head dimension as a compile-time constant (64, 128: loops fully unrolled, a row of acc held in
// registers); DC = 0: any D.
template <int64_t DC>
FV_TREE_INLINE void attn_tile_math(const float* qf, const float* kT, const float* vf, const uint32_t* vis,
                                   float* m, float* l, float* acc, int64_t R, int64_t Drt) {
  const int64_t D = DC > 0 ? DC : Drt;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t w = vis[r];
    if (w == 0) continue;
    float s[kAttnKeys];
    for (int64_t t = 0; t < kAttnKeys; ++t) s[t] = 0.f;
    const float* qr = qf + r * D;
    for (int64_t d = 0; d < D; ++d) {
      const float qd = qr[d];
      const float* kd = kT + d * kAttnKeys;
      for (int64_t t = 0; t < kAttnKeys; ++t) s[t] += qd * kd[t];
    }
    float tmax = ninf;
    for (int64_t t = 0; t < kAttnKeys; ++t) {
      s[t] = ((w >> t) & 1u) ? s[t] : ninf;
      tmax = s[t] > tmax ? s[t] : tmax;
    }
    const float mnew = m[r] > tmax ? m[r] : tmax;
    const float corr = m[r] == ninf ? 0.f : exp_nonpositive(m[r] - mnew);
    float p[kAttnKeys];
    float psum = 0.f;
    for (int64_t t = 0; t < kAttnKeys; ++t) {
      p[t] = ((w >> t) & 1u) ? exp_nonpositive(s[t] - mnew) : 0.f;
      psum += p[t];
    }
    float* ar = acc + r * D;
    if constexpr (DC > 0) {
      float a[DC];
      for (int64_t d = 0; d < DC; ++d) a[d] = ar[d] * corr;
      for (int64_t t = 0; t < kAttnKeys; ++t) {
        const float pt = p[t];
        const float* vt = vf + t * DC;
        for (int64_t d = 0; d < DC; ++d) a[d] += pt * vt[d];
      }
      for (int64_t d = 0; d < DC; ++d) ar[d] = a[d];
    } else {
      if (corr != 1.f) {
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
      for (int64_t t = 0; t < kAttnKeys; ++t) {
        const float pt = p[t];
        if (pt == 0.f) continue;
        const float* vt = vf + t * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += pt * vt[d];
      }
    }
    l[r] = l[r] * corr + psum;
    m[r] = mnew;
  }
}

inline void attn_tile_default(const float* qf, const float* kT, const float* vf, const uint32_t* vis, float* m,
                              float* l, float* acc, int64_t R, int64_t D) {
  attn_tile_math<0>(qf, kT, vf, vis, m, l, acc, R, D);
}

#if defined(FV_TREE_AVX2)
__attribute__((target("avx2,fma"))) inline void attn_tile_avx2(const float* qf, const float* kT, const float* vf,
                                                                const uint32_t* vis, float* m, float* l,
                                                                float* acc, int64_t R, int64_t D) {
  if (D == 64) return attn_tile_math<64>(qf, kT, vf, vis, m, l, acc, R, D);
  if (D == 128) return attn_tile_math<128>(qf, kT, vf, vis, m, l, acc, R, D);
  attn_tile_math<0>(qf, kT, vf, vis, m, l, acc, R, D);
}
#endif

inline bool attn_use_avx2() {
#if defined(FV_TREE_AVX2)
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

template <typename T>
void tree_attention_task(const AttnShape& s, const T* q, const T* k, const T* v, const int32_t* mask,
                         int64_t plen, T* out, int64_t b, int64_t hkv, int64_t r0, int64_t r1, float* scratch) {
  const int64_t D = s.D, n = s.n, W = s.W, group = s.Hq / s.Hkv;
  const int64_t R = r1 - r0;
  float* qf = scratch;              // [R, D], pre-scaled
  float* acc = qf + kAttnRows * D;  // [R, D]
  float* kT = acc + kAttnRows * D;  // [D, KT]
  float* vf = kT + kAttnKeys * D;   // [KT, D]
  float* m = vf + kAttnKeys * D;    // [R] running max
  float* l = m + kAttnRows;         // [R] running sum
  int64_t node[kAttnRows];
  uint32_t vis[kAttnRows];
  const bool avx2 = attn_use_avx2();
  const T* kb = k + b * s.k_sb + hkv * s.k_sh;
  const T* vb = v + b * s.v_sb + hkv * s.v_sh;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = hkv * group + (r0 + r) / n, i = (r0 + r) % n;
    node[r] = i;
    const T* qr = q + b * s.q_sb + h * s.q_sh + i * s.q_si;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * s.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  // Keys [slot0, slot0 + KT) into kT / vf (zero-padded to 32), then the tile arithmetic.
  auto tile = [&](int64_t slot0, int64_t KT) {
    for (int64_t t = 0; t < KT; ++t) {
      const T* kr = kb + (slot0 + t) * s.k_ss;
      const T* vr = vb + (slot0 + t) * s.v_ss;
      for (int64_t d = 0; d < D; ++d) kT[d * kAttnKeys + t] = static_cast<float>(kr[d]);
      for (int64_t d = 0; d < D; ++d) vf[t * D + d] = static_cast<float>(vr[d]);
    }
    for (int64_t t = KT; t < kAttnKeys; ++t) {
      for (int64_t d = 0; d < D; ++d) kT[d * kAttnKeys + t] = 0.f;
      for (int64_t d = 0; d < D; ++d) vf[t * D + d] = 0.f;
    }
#if defined(FV_TREE_AVX2)
    if (avx2) return attn_tile_avx2(qf, kT, vf, vis, m, l, acc, R, D);
#endif
    attn_tile_default(qf, kT, vf, vis, m, l, acc, R, D);
  };
  for (int64_t t0 = 0; t0 < plen; t0 += kAttnKeys) {
    const int64_t KT = std::min(kAttnKeys, plen - t0);
    const uint32_t all = KT == 32 ? ~uint32_t(0) : ((uint32_t(1) << KT) - 1u);
    for (int64_t r = 0; r < R; ++r) vis[r] = all;
    tile(t0, KT);
  }
  for (int64_t j0 = 0; j0 < n; j0 += kAttnKeys) {
    const int64_t KT = std::min(kAttnKeys, n - j0);
    const uint32_t valid = KT == 32 ? ~uint32_t(0) : ((uint32_t(1) << KT) - 1u);  // ignore stray bits past n
    uint32_t any = 0;
    for (int64_t r = 0; r < R; ++r) any |= vis[r] = uint32_t(mask[(b * n + node[r]) * W + (j0 >> 5)]) & valid;
    if (any) tile(s.P + j0, KT);
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = hkv * group + (r0 + r) / n, i = node[r];
    T* o = out + ((b * s.Hq + h) * n + i) * D;  // out is contiguous [B, Hq, n, D]
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no visible key: zeros
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv);
  }
}

// ------------------------------------------------------------------------------------------------------------
// Cache compaction for one (request, head) plane of a [B, H, S, D] tensor, as bytes: gathers the L accepted
// rows (slot src[i]) into `buf` first, then writes them to slots dst0 + i, so overlapping ranges are safe.
inline void compact_plane(char* plane, int64_t slot_stride_bytes, int64_t d_stride_bytes, int64_t D,
                          int64_t elem_bytes, const int64_t* src, int64_t L, int64_t dst0, char* buf) {
  const int64_t row_bytes = D * elem_bytes;
  const bool dense = d_stride_bytes == elem_bytes;
  for (int64_t i = 0; i < L; ++i) {
    const char* from = plane + src[i] * slot_stride_bytes;
    if (dense) {
      std::memcpy(buf + i * row_bytes, from, row_bytes);
    } else {
      for (int64_t d = 0; d < D; ++d) std::memcpy(buf + i * row_bytes + d * elem_bytes, from + d * d_stride_bytes,
                                                  elem_bytes);
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    char* to = plane + (dst0 + i) * slot_stride_bytes;
    if (dense) {
      std::memcpy(to, buf + i * row_bytes, row_bytes);
    } else {
      for (int64_t d = 0; d < D; ++d) std::memcpy(to + d * d_stride_bytes, buf + i * row_bytes + d * elem_bytes,
                                                  elem_bytes);
    }
  }
}

}  // namespace fastverify::tree
