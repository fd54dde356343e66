// Schemas of the tree ops (kernels: csrc/cpu/tree.cpp, csrc/cuda/tree.cu, kernels/tree.py;
// reference: fastverify/reference/tree.py; Python API: fastverify/ops/tree.py).
//
// Trees use the batch layout of verify: cu_nodes int32 [B + 1], parents int32 [N] (local, -1 = root child,
// parents[j] < j); n = max nodes per request. Key layout: request b's prefix occupies key slots
// [0, prefix_len[b]) of a prefix of P = max(prefix_len) slots; draft node j of every request sits at key P + j.
//
//   tree_mask_bool(parents, cu_nodes, prefix_len int32 [B], n, P) -> bool [B, n, P + n]
//       True where query node i may attend: prefix keys [0, prefix_len[b]), its ancestors and itself.
//       Rows and columns of padding nodes (j >= n_b) see nothing but the prefix.
//   tree_mask_additive(parents, cu_nodes, prefix_len, n, P, dtype) -> [B, 1, n, P + n], 0 / -inf in dtype
//   tree_mask_packed(parents, cu_nodes, n) -> int32 [B, n, ceil(n / 32)]: bit (j % 32) of word j / 32
//       (little-endian within a word) of row i set iff draft node j is an ancestor of i or i itself.
//   tree_positions(parents, cu_nodes, prefix_len) -> int64 [N]: prefix_len[b] + depth(j) - 1, where a child
//       of the root has depth 1.
//   tree_attention(q [B, Hq, n, D], k [B, Hkv, P + n, D], v [B, Hkv, P + n, D], packed_mask, prefix_len, scale)
//       -> [B, Hq, n, D]: softmax(q k^T * scale) v over the visible keys; Hq a multiple of Hkv (GQA).
//   compact_cache(k [B, H, S, D], v [B, H, S, D], prefix_len int32 [B], draft_start int, accepted int32
//       [B, max_depth], accept_len int32 [B]) -> (): in place, moves slot draft_start + accepted[b, i] to
//       slot prefix_len[b] + i for i < accept_len[b].
//   compact_cache_layers(k [L] of [B, H_l, S, D_l], v [L] of the same, prefix_len, draft_start, accepted, accept_len)
//       -> (): compact_cache on each layer's (k[l], v[l]), the arguments checked once (one call for a whole cache).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def("tree_mask_bool(Tensor parents, Tensor cu_nodes, Tensor prefix_len, int n, int P) -> Tensor");
  m.def("tree_mask_additive(Tensor parents, Tensor cu_nodes, Tensor prefix_len, int n, int P, ScalarType dtype) "
        "-> Tensor");
  m.def("tree_mask_packed(Tensor parents, Tensor cu_nodes, int n) -> Tensor");
  m.def("tree_positions(Tensor parents, Tensor cu_nodes, Tensor prefix_len) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor packed_mask, Tensor prefix_len, float scale) -> Tensor");
  m.def("compact_cache(Tensor(a!) k, Tensor(b!) v, Tensor prefix_len, int draft_start, Tensor accepted, "
        "Tensor accept_len) -> ()");
  m.def("compact_cache_layers(Tensor(a!)[] k, Tensor(b!)[] v, Tensor prefix_len, int draft_start, Tensor accepted, "
        "Tensor accept_len) -> ()");
}
