// Framework-free arithmetic of the tree ops (schemas and layouts: csrc/tree.cpp). Raw pointers, sizes and
// strides only; the bindings in csrc/cpu/tree.cpp check inputs and parallelise over requests / rows.
// Element types T of the dense mask rows: bool and the floating types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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
