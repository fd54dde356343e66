// Framework-free arithmetic of the tree ops (schemas and layouts: csrc/tree.cpp). Raw pointers, sizes and
// strides only; the bindings in csrc/cpu/tree.cpp check inputs and parallelise over requests / rows.
// Element types T only need a conversion to and from float (float, c10::Half, c10::BFloat16).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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
// Tree attention: flash-attention style online softmax on the CPU, for one task = (request b, kv head, a
// chunk of query rows of its GQA group). The rows of a task share their keys, so each key tile is converted to
// float once and used by every row (query head h = hkv * group + r / n, node i = r % n).

struct AttnShape {
  int64_t Hq, Hkv, n, S, P, D, W;
  int64_t q_sb, q_sh, q_si;  // strides of q [B, Hq, n, D] (unit stride in D)
  int64_t k_sb, k_sh, k_ss;  // strides of k [B, Hkv, S, D]
  int64_t v_sb, v_sh, v_ss;  // strides of v
  float scale;
};

constexpr int64_t kAttnRows = 16;  // query rows per task
constexpr int64_t kAttnKeys = 32;  // keys per tile

// Floats of scratch one task needs.
inline int64_t attn_scratch_floats(int64_t D) {
  return kAttnRows * D * 2 + kAttnKeys * D * 2 + kAttnRows * kAttnKeys + kAttnRows * 2;
}

template <typename T>
void tree_attention_task(const AttnShape& s, const T* q, const T* k, const T* v, const int32_t* mask,
                         int64_t plen, T* out, int64_t b, int64_t hkv, int64_t r0, int64_t r1, float* scratch) {
  const int64_t D = s.D, n = s.n, W = s.W, group = s.Hq / s.Hkv;
  const int64_t R = r1 - r0;
  float* qf = scratch;                      // [R, D], pre-scaled
  float* acc = qf + kAttnRows * D;          // [R, D]
  float* kf = acc + kAttnRows * D;          // [KT, D]
  float* vf = kf + kAttnKeys * D;           // [KT, D]
  float* sc = vf + kAttnKeys * D;           // [R, KT]
  float* m = sc + kAttnRows * kAttnKeys;    // [R] running max
  float* l = m + kAttnRows;                 // [R] running sum
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t node[kAttnRows];
  const T* kb = k + b * s.k_sb + hkv * s.k_sh;
  const T* vb = v + b * s.v_sb + hkv * s.v_sh;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = hkv * group + (r0 + r) / n, i = (r0 + r) % n;
    node[r] = i;
    const T* qr = q + b * s.q_sb + h * s.q_sh + i * s.q_si;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * s.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    m[r] = ninf;
    l[r] = 0.f;
  }
  // One tile of keys [t0, t0 + KT) at key slots `slot0 + t`; `draft` tiles read visibility from the bits.
  auto tile = [&](int64_t slot0, int64_t KT, bool draft, int64_t j0) {
    for (int64_t t = 0; t < KT; ++t) {
      const T* kr = kb + (slot0 + t) * s.k_ss;
      const T* vr = vb + (slot0 + t) * s.v_ss;
      for (int64_t d = 0; d < D; ++d) kf[t * D + d] = static_cast<float>(kr[d]);
      for (int64_t d = 0; d < D; ++d) vf[t * D + d] = static_cast<float>(vr[d]);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = sc + r * kAttnKeys;
      const float* qr = qf + r * D;
      const int32_t* bits = mask + (b * n + node[r]) * W;
      float tmax = ninf;
      for (int64_t t = 0; t < KT; ++t) {
        if (draft) {
          const int64_t j = j0 + t;
          if (!((uint32_t(bits[j >> 5]) >> (j & 31)) & 1u)) {
            sr[t] = ninf;
            continue;
          }
        }
        const float* kt = kf + t * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
        sr[t] = dot;
        tmax = std::max(tmax, dot);
      }
      if (tmax == ninf) continue;  // nothing visible in this tile for this row
      const float mnew = std::max(m[r], tmax);
      const float corr = m[r] == ninf ? 0.f : std::exp(m[r] - mnew);
      float* ar = acc + r * D;
      if (corr != 1.f) {
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
      float lsum = l[r] * corr;
      for (int64_t t = 0; t < KT; ++t) {
        if (sr[t] == ninf) continue;
        const float p = std::exp(sr[t] - mnew);
        lsum += p;
        const float* vt = vf + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
      }
      l[r] = lsum;
      m[r] = mnew;
    }
  };
  for (int64_t t0 = 0; t0 < plen; t0 += kAttnKeys) tile(t0, std::min(kAttnKeys, plen - t0), false, 0);
  for (int64_t j0 = 0; j0 < n; j0 += kAttnKeys) tile(s.P + j0, std::min(kAttnKeys, n - j0), true, j0);
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
