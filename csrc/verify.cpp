// Schema of fastverify::verify (declared once; kernels: csrc/cpu/verify.cpp, csrc/cuda/verify.cu,
// kernels/verify.py; reference: fastverify/reference/verify.py; Python API: fastverify/ops/verify.py).
//
// Normalised arguments (the Python wrapper validates and normalises user input into these):
//   logits       [N + B, V] fp32/bf16/fp16, last dim contiguous. Request b owns rows cu_nodes[b] + b ..
//                cu_nodes[b + 1] + b: its root row, then one row per draft node.
//   draft_tokens int64 [N]       token of each draft node
//   cu_nodes     int32 [B + 1]   node offsets
//   parents      int32 [N]       local parent index, -1 = child of the root; parents[j] < j
//   rule_params  float32 [B, 2]  per-request rule parameters: topk (k, -), distance (eps, -), gad (beta, tau),
//                                typical (eps, delta), confidence (beta, -); unused otherwise
//   warp         float32 [B, 4]  (temperature, top_k, top_p, min_p) for the sampling rules; top_k 0 = off,
//                                top_p 1 = off, min_p 0 = off, temperature 0 = greedy
//   draft_probs  [N, V] float or None: the drafter's distribution each node was drawn from (speculative)
//   u_sample     float32 [N + B] or None: per logits row, the uniform that samples at that row (speculative,
//                coupled)
//   u_accept     float32 [N] or None: per node, the uniform of its acceptance test (speculative)
//   root_tokens  int64 [B] or None: the last committed token of each request (confidence's repetition stop)
//   rule         index into fastverify.ops.verify.RULES: greedy, topk, distance, gad, typical, confidence,
//                speculative, coupled
//   min_accept   force this many nodes along the most likely path (deterministic rules only)
//   max_depth    width of `accepted` (the deepest tree in the batch)
// Returns accept_len int32 [B], accepted int32 [B, max_depth] (local node indices, -1 padded),
// next_token int64 [B]. A request whose rows hold NaN or +inf, or a row that is entirely -inf, gets
// accept_len = -1 (and next_token = -1): the Python wrapper turns that into an error naming `logits`.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fastverify, m) {
  m.def(
      "verify(Tensor logits, Tensor draft_tokens, Tensor cu_nodes, Tensor parents, Tensor rule_params, "
      "Tensor warp, Tensor? draft_probs, Tensor? u_sample, Tensor? u_accept, Tensor? root_tokens, "
      "int rule, int min_accept, int max_depth) -> (Tensor accept_len, Tensor accepted, Tensor next_token)");
}
