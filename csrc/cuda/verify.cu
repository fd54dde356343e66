// CUDA kernels of fastverify::verify (schema: csrc/verify.cpp; reference: fastverify/reference/verify.py).
//
// Kernels:
//   _verify_rows_kernel  one CTA per logits row (grid-stride over the N + B rows). Deterministic rules: one pass
//                        over V gives the row's max, argmax (lowest id), NaN / +inf flag, online log-sum-exp and
//                        entropy (typical, confidence) and the ranks of up to kGroup children's tokens at once
//                        (topk, gad; a row with more children takes one more pass per kGroup children); thread 0
//                        then decides cond(child) for each child scored at this row. Sampling rules: the row's warp
//                        is resolved (csrc/cuda/sampling.cuh) and the row's own step of the walk is taken: coupled
//                        draws t = F^-1(u_sample[row]) and picks the first child with token t; speculative tries the
//                        children in node order against the (residual) distribution, and samples the residual with
//                        u_sample[row] when every child is rejected. A row's step depends only on that row, so all
//                        rows run in parallel.
//   _verify_argmax_segments_kernel, _verify_argmax_combine_kernel
//                        the argmax-only rules (greedy, distance) when there are too few rows to fill the GPU with
//                        one CTA per row: each row is cut into S segments of seg_len tokens (a multiple of 8, so a
//                        segment starts 16-byte aligned whenever its row does; S from NR, V and the number of SMs,
//                        argmax_split below), one CTA per (row, segment) writes the segment's (max, lowest argmax,
//                        NaN / +inf flag) to a scratch array; then one thread per row and one per node fold the
//                        row's S partials in segment order with the block reduction's operator (ArgMaxOp: larger
//                        value, then lower id) and write what the one-CTA row pass writes (row_bad, row_next,
//                        row_child = -1; node_cond, node_logit of each node at its parent's row). The fold selects
//                        the same element as the block reduction (the lowest id among the maxima), so the result
//                        does not depend on S. S = 1 runs _verify_rows_kernel.
//   _verify_speculative_final_kernel
//                        FASTVERIFY_CUDA_SPECULATIVE=deferred (opt-in until run on a GPU): the rows kernel tests
//                        each speculative row's children without the draw (nor the residual after a row's last
//                        child), so it needs no scratch and runs one CTA per row; then one CTA per request follows
//                        the accepted children from the root and does in full, with the one-pass function, only its
//                        final row (the draw) and any row on the path the rows pass left unresolved (a child tested
//                        after two rejections). The one-pass kernel runs at most 128 CTAs (a float64 scratch row
//                        each) and draws at every row whose children it rejects.
//   _verify_walk_kernel  one thread per request: min_accept's forced path, accept(j) = accept(parent) and
//                        (cond or forced), the deepest accepted node (first in node order), or, for the sampling
//                        rules, the chain of per-row accepted children from the root; then accepted / accept_len /
//                        next_token.
// Speculative: draft_probs is read in its own dtype (float64, float32, bfloat16, float16; other floating dtypes are
// converted to float64 on the host) and widened to float64, which is exact, as the reference's .double(). After a
// row's first rejection the residual p1 = max(p - q_1, 0) / mass_1 is evaluated on the fly from the row and q_1, with
// the same roundings; from the second rejection on (several children of one row) the residual is materialised in a
// float64 scratch row per CTA of the rows kernel (the grid is capped so that this scratch stays bounded).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "sampling.cuh"

namespace fastverify {
namespace cuda {

// Indices into fastverify.ops.verify.RULES / fastverify.reference.verify.RULES.
enum VerifyRule : int {
  kGreedy = 0,
  kTopK = 1,
  kDistance = 2,
  kGad = 3,
  kTypical = 4,
  kConfidence = 5,
  kSpeculative = 6,
  kCoupled = 7,
};

constexpr int kVerifyBlock = 512;
constexpr int kGroup = 8;  // children whose ranks one pass over V computes

struct VerifyArgs {
  const void* logits;  // [NR, V], row stride row_stride
  int64_t row_stride;
  int64_t V;
  int64_t NR;  // N + B rows
  int B;
  const int64_t* draft_tokens;  // [N]
  const int32_t* cu_nodes;      // [B + 1]
  const int32_t* parents;       // [N]
  const float* rule_params;     // [B, 2]
  const float* warp;            // [B, 4]
  const void* draft_probs;      // [N, V] in dtype draft_probs_type, row stride draft_probs_stride; or null
  int64_t draft_probs_stride;
  int draft_probs_type;         // ProbType
  const float* u_sample;        // [NR] or null
  const float* u_accept;        // [N] or null
  const int64_t* root_tokens;   // [B] or null
  int rule;
  // per-row outputs
  int32_t* row_bad;    // [NR] 1 = no valid distribution
  int64_t* row_next;   // [NR] argmax (deterministic) / the row's drawn token (sampling rules)
  int32_t* row_child;  // [NR] sampling rules: local index of the accepted child, -1 if none
  // per-node outputs (the node is scored at its parent's row)
  uint8_t* node_cond;   // [N] deterministic cond(j)
  float* node_logit;    // [N] logit of the node's token at its parent's row (min_accept's most likely path)
  double* scratch;      // [gridDim.x, V] speculative residuals, or null
};

// Storage dtypes of draft_probs read by the kernel.
enum ProbType : int { kProbDouble = 0, kProbFloat = 1, kProbHalf = 2, kProbBFloat16 = 3 };

// q[i] of a draft_probs row in dtype `type`, widened to float64 (exact for each of these dtypes).
__device__ __forceinline__ double load_prob(const void* q, int type, int64_t i) {
  switch (type) {
    case kProbFloat: return static_cast<double>(static_cast<const float*>(q)[i]);
    case kProbHalf: return static_cast<double>(__half2float(static_cast<const __half*>(q)[i]));
    case kProbBFloat16: return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(q)[i]));
    default: return static_cast<const double*>(q)[i];
  }
}

// Request owning logits row g: the largest b with cu_nodes[b] + b <= g.
__device__ __forceinline__ int request_of_row(const int32_t* cu_nodes, int B, int64_t g) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int64_t>(cu_nodes[mid]) + mid <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Online softmax statistics in float64: s = sum exp(l - m), t = sum exp(l - m) * (l - m).
struct SoftStats {
  double m, s, t;
};
__device__ __forceinline__ void soft_add(SoftStats& a, double l) {
  if (l == -INFINITY) return;
  if (l <= a.m) {
    const double e = exp(l - a.m);
    a.s += e;
    a.t += e * (l - a.m);
  } else {
    if (a.s > 0.0) {
      const double f = exp(a.m - l);
      a.t = (a.t + a.s * (a.m - l)) * f;
      a.s = a.s * f;
    } else {
      a.t = 0.0;
      a.s = 0.0;
    }
    a.s += 1.0;  // the new maximum itself: exp(0) = 1, times (l - l) = 0 for t
    a.m = l;
  }
}
struct SoftMergeOp {
  __device__ SoftStats operator()(const SoftStats& a, const SoftStats& b) const {
    const double M = fmax(a.m, b.m);
    SoftStats r{M, 0.0, 0.0};
    if (M == -INFINITY) return r;
    if (a.s > 0.0) {
      const double f = exp(a.m - M);
      r.s += a.s * f;
      r.t += (a.t + a.s * (a.m - M)) * f;
    }
    if (b.s > 0.0) {
      const double f = exp(b.m - M);
      r.s += b.s * f;
      r.t += (b.t + b.s * (b.m - M)) * f;
    }
    return r;
  }
};

// cond(j) of a deterministic rule (thread 0). x: the node's token; lx: its logit at the parent's row.
__device__ bool deterministic_cond(int rule, long long x, float lx, long long rank, long long argmax, float row_max,
                                   double lse, double entropy, double p0, double p1, bool has_parent_token,
                                   long long parent_token) {
  switch (rule) {
    case kGreedy: return x == argmax;
    case kTopK: return static_cast<double>(rank) < p0;
    case kDistance: return fabs(static_cast<double>(x - argmax)) <= p0;
    case kGad:
      return static_cast<double>(rank) < p0 &&
             __dsub_rn(static_cast<double>(row_max), static_cast<double>(lx)) <= p1;
    case kTypical: {
      const double px = exp(static_cast<double>(lx) - lse);
      return px > fmin(p0, p1 * exp(-entropy));
    }
    case kConfidence: {
      const double px = exp(static_cast<double>(lx) - lse);
      return px >= p0 && !(has_parent_token && x == parent_token);
    }
    default: return false;
  }
}

// Writes node_cond and node_logit of local node j (token x, logit lx at its parent's row; rank: its rank there,
// for topk and gad) from the statistics of the parent's row. One thread.
__device__ __forceinline__ void score_child(const VerifyArgs& a, int b, int32_t start, int j, long long x, float lx,
                                            long long rank, const RawRowStats& stats, double lse, double entropy,
                                            double p0, double p1) {
  const int par = a.parents[start + j];
  bool has_pt = false;
  long long pt = 0;
  if (par >= 0) {
    has_pt = true;
    pt = a.draft_tokens[start + par];
  } else if (a.root_tokens != nullptr) {
    has_pt = true;
    pt = a.root_tokens[b];
  }
  bool ok = false;
  if (x >= 0 && x < a.V && !isnan(lx)) {
    ok = deterministic_cond(a.rule, x, lx, rank, stats.argmax, stats.max, lse, entropy, p0, p1, has_pt, pt);
  }
  a.node_cond[start + j] = ok ? 1 : 0;
  a.node_logit[start + j] = lx;
}

// RANK: the rule needs the children's ranks (topk, gad); SOFT: the row's log-sum-exp and entropy (typical,
// confidence). Compile-time, so that greedy and distance carry neither the rank counters nor the float64 softmax
// state in registers.
template <typename T, int BLOCK, bool RANK, bool SOFT>
__device__ void verify_row_deterministic(const VerifyArgs& a, const T* row, int64_t g, int b, int r) {
  const int64_t V = a.V;
  const int32_t start = a.cu_nodes[b];
  const int n_b = a.cu_nodes[b + 1] - start;
  constexpr bool need_rank = RANK;
  constexpr bool need_soft = SOFT;
  const double p0 = a.rule_params[2 * b], p1 = a.rule_params[2 * b + 1];

  __shared__ int kid_id[kGroup];
  __shared__ long long kid_tok[kGroup];
  __shared__ float kid_logit[kGroup];
  __shared__ int kid_count;
  __shared__ int scan_pos;
  if (threadIdx.x == 0) scan_pos = 0;

  ArgMax best{-INFINITY, 0x7fffffffffffffffLL};
  long long bad = 0;
  SoftStats soft{-INFINITY, 0.0, 0.0};
  RawRowStats stats{false, -INFINITY, 0};
  double lse = 0.0, entropy = 0.0;
  bool first = true;
  while (true) {
    if (threadIdx.x == 0) {  // next group of this row's children, in node order
      int cnt = 0, pos = scan_pos;
      for (; pos < n_b && cnt < kGroup; ++pos) {
        if (a.parents[start + pos] != r - 1) continue;
        const long long x = a.draft_tokens[start + pos];
        kid_id[cnt] = pos;
        kid_tok[cnt] = x;
        kid_logit[cnt] = (x >= 0 && x < V) ? load_as_float(row + x) : __int_as_float(0x7fc00000);
        ++cnt;
      }
      scan_pos = pos;
      kid_count = cnt;
    }
    __syncthreads();
    const int m = kid_count;
    if (!first && m == 0) break;
    const bool do_rank = need_rank && m > 0;
    // per-thread counts in 32 bits (a thread owns about V / BLOCK tokens), summed over the block in 64: with 64-bit
    // counters the rank pass took 106-110 registers (one 512-thread CTA per SM), with these 64 (two)
    int cnt[kGroup];
    long long rank[kGroup];
#pragma unroll
    for (int c = 0; c < kGroup; ++c) {
      cnt[c] = 0;
      rank[c] = 0;
    }
    if (first || do_rank) {
      for_each_owned<BLOCK>(row, V, [&](int64_t v, float x) {
        if (first) {
          if (isnan(x) || x == INFINITY) {
            bad = 1;
          } else {
            if (x > best.v || (x == best.v && v < best.i)) best = ArgMax{x, v};
            if (need_soft) soft_add(soft, static_cast<double>(x));
          }
        }
        if (do_rank) {
#pragma unroll
          for (int c = 0; c < kGroup; ++c) {
            if (c < m) {
              const float lc = kid_logit[c];
              cnt[c] += (x > lc) || (x == lc && v < kid_tok[c]);
            }
          }
        }
      });
      if (first) {
        const ArgMax r2 = block_argmax<BLOCK>(best);
        stats.bad = block_sum_ll<BLOCK>(bad) > 0;
        stats.max = r2.v;
        stats.argmax = r2.i == 0x7fffffffffffffffLL ? 0 : r2.i;
        if (need_soft) {
          const SoftStats s = block_reduce<BLOCK>(soft, SoftMergeOp());
          if (s.s > 0.0) {
            lse = s.m + log(s.s);
            entropy = log(s.s) - s.t / s.s;
          }
        }
        if (threadIdx.x == 0) {
          a.row_bad[g] = (stats.bad || stats.max == -INFINITY) ? 1 : 0;
          a.row_next[g] = stats.argmax;
          a.row_child[g] = -1;
        }
      }
      if (do_rank) {
#pragma unroll
        for (int c = 0; c < kGroup; ++c) {
          if (c < m) rank[c] = block_sum_ll<BLOCK>(static_cast<long long>(cnt[c]));  // m is block-uniform
        }
      }
    }
    if (threadIdx.x == 0) {
      for (int c = 0; c < m; ++c) {
        score_child(a, b, start, kid_id[c], kid_tok[c], kid_logit[c], rank[c], stats, lse, entropy, p0, p1);
      }
    }
    first = false;
    __syncthreads();  // kid_* and scan_pos are rewritten by the next group
  }
}

// Next child of local row r (parents == r - 1) at or after local index `from`; -1 if none. Thread 0 only.
__device__ __forceinline__ int next_child(const int32_t* parents_b, int n_b, int r, int from) {
  for (int j = from; j < n_b; ++j)
    if (parents_b[j] == r - 1) return j;
  return -1;
}

// row_next / row_child of a row whose work the deferred speculative rows pass leaves to the final pass.
constexpr long long kDeferredDraw = -3;  // row_next: every child rejected, the draw not taken
constexpr int kUnresolvedRow = -2;       // row_child: a later child's test needs the residual materialised

// Speculative step of one row (Leviathan et al. Alg. 1; SpecInfer Alg. 2): p = w / sum(w); children in node order.
// DEFER (the rows pass of the deferred draw, _verify_speculative_final_kernel): the same tests, but no draw (row_next
// = kDeferredDraw), no residual after the row's last child, and a row whose next test would need the residual
// materialised in the scratch row (two rejections with mass before it) is left as row_child = kUnresolvedRow. Whatever
// DEFER leaves is done by the final pass with DEFER = false, so every value the walk reads is this function's with
// DEFER = false.
template <typename T, int BLOCK, bool DEFER>
__device__ void verify_row_speculative(const VerifyArgs& a, const T* row, int64_t g, int b, int r, const RowWarp& w,
                                       double u_row) {
  const int64_t V = a.V;
  const int32_t start = a.cu_nodes[b];
  const int n_b = a.cu_nodes[b + 1] - start;
  const int32_t* par_b = a.parents + start;
  const int64_t* tok_b = a.draft_tokens + start;
  const char* dp = static_cast<const char*>(a.draft_probs);
  const int dp_type = a.draft_probs_type;
  const int64_t dp_row_bytes = a.draft_probs_stride * (dp_type == kProbDouble ? 8 : dp_type == kProbFloat ? 4 : 2);
  auto warped = [&](int64_t v) { return static_cast<double>(row_weight(row, v, w)); };
  // q_c(v) of child c with token x, c's draft_probs row q (null: one-hot at x)
  auto q_at = [&](const char* q, long long x, int64_t v) {
    return q != nullptr ? load_prob(q, dp_type, v) : (v == x ? 1.0 : 0.0);
  };
  auto q_row = [&](int c) { return dp != nullptr ? dp + static_cast<int64_t>(start + c) * dp_row_bytes : dp; };

  // DEFER: the row's draw left to the final pass (row_child -1, or kUnresolvedRow when its tests are too)
  auto defer_row = [&](int child) {
    if (threadIdx.x == 0) {
      a.row_bad[g] = 0;
      a.row_next[g] = kDeferredDraw;
      a.row_child[g] = child;
    }
  };
  if constexpr (DEFER) {  // a row without children: nothing to test, and its draw is deferred
    __shared__ int s_any;
    if (threadIdx.x == 0) s_any = next_child(par_b, n_b, r, 0) >= 0;
    __syncthreads();
    const int any = s_any;
    __syncthreads();
    if (!any) return defer_row(-1);
  }
  double zw = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += BLOCK) zw += warped(v);
  zw = block_sum<BLOCK>(zw);
  // p after `level` modifications: 0: w / zw; 1: max(p_0 - q_1, 0) / mass_1, evaluated on the fly (the first
  // rejected child's q_1); 2: two or more, materialised in S (the expression of each level is the one the next
  // level's residual is formed from, so every entry has the roundings of a step-by-step materialisation).
  double* S = DEFER ? nullptr : a.scratch + static_cast<int64_t>(blockIdx.x) * V;  // DEFER never materialises
  int level = 0;
  const char* q1 = nullptr;
  long long x1 = -1;
  double mass1 = 1.0;
  auto p_first = [&](int64_t v) { return __ddiv_rn(warped(v), zw); };
  auto cur = [&](int64_t v) {
    if (level == 0) return p_first(v);
    if (level == 1) return __ddiv_rn(fmax(__dsub_rn(p_first(v), q_at(q1, x1, v)), 0.0), mass1);
    return S[v];
  };
  __shared__ int s_kid;
  __shared__ int s_ok;
  __shared__ int s_more;
  int from = 0, hit = -1;
  bool unresolved = false;
  while (true) {
    if (threadIdx.x == 0) {
      const int c = next_child(par_b, n_b, r, from);
      int ok = 0;
      if (c >= 0) {
        const long long x = tok_b[c];
        if (x >= 0 && x < V) {
          const double px = cur(x);
          const double qx = dp != nullptr ? load_prob(q_row(c), dp_type, x) : 1.0;
          const double ua = a.u_accept != nullptr ? static_cast<double>(a.u_accept[start + c]) : 1.0;
          ok = qx > 0.0 ? (ua <= __ddiv_rn(px, qx)) : (px > 0.0);
        }
      }
      s_kid = c;
      s_ok = ok;
      s_more = DEFER && c >= 0 && !ok ? next_child(par_b, n_b, r, c + 1) >= 0 : 1;
    }
    __syncthreads();
    const int c = s_kid, ok = s_ok, more = s_more;
    __syncthreads();
    if (c < 0) break;
    if (ok) {
      hit = c;
      break;
    }
    if constexpr (DEFER) {
      if (!more) break;  // the residual after the last child serves only the draw
      if (level >= 1) {  // this rejection may need the residual materialised: the final pass redoes the row
        unresolved = true;
        break;
      }
    }
    // rejected: p <- normalise(max(p - q, 0)), kept unchanged when that has zero mass
    const long long x = tok_b[c];
    const char* q = q_row(c);
    auto residual = [&](int64_t v) { return fmax(__dsub_rn(cur(v), q_at(q, x, v)), 0.0); };
    double mass = 0.0;
    for (int64_t v = threadIdx.x; v < V; v += BLOCK) mass += residual(v);
    mass = block_sum<BLOCK>(mass);  // block-uniform, so is `level`
    if (mass > 0.0) {
      if (level == 0) {
        q1 = q;
        x1 = x;
        mass1 = mass;
        level = 1;
      } else {
        // each thread rewrites only the entries it reads, so the update is in place without a race
        for (int64_t v = threadIdx.x; v < V; v += BLOCK) S[v] = __ddiv_rn(residual(v), mass);
        level = 2;
        __syncthreads();  // S visible to thread 0's next p(x) and to the final draw's walk
      }
    }
    from = c + 1;
  }
  if constexpr (DEFER) {
    if (hit < 0) return defer_row(unresolved ? kUnresolvedRow : -1);
  }
  long long t = -2;  // not used when a child is accepted: the walk descends into it
  if (hit < 0) {
    // unmodified: the row's own weights, exactly cdf_sample(row, u_sample[row]); else the current residual
    t = inverse_cdf_sample<BLOCK>(V, [&](int64_t v) { return level == 0 ? warped(v) : cur(v); }, u_row);
  }
  if (threadIdx.x == 0) {
    a.row_bad[g] = 0;
    a.row_next[g] = t;
    a.row_child[g] = hit;
  }
}

template <typename T, int BLOCK, bool DEFER>
__device__ void verify_row_sampling(const VerifyArgs& a, const T* row, int64_t g, int b, int r) {
  const int64_t V = a.V;
  const int32_t start = a.cu_nodes[b];
  const int n_b = a.cu_nodes[b + 1] - start;
  const int32_t* par_b = a.parents + start;
  const int64_t* tok_b = a.draft_tokens + start;
  const float* wp = a.warp + 4 * b;
  const RowWarp w = resolve_warp<BLOCK>(row, V, wp[0], wp[1], wp[2], wp[3]);
  if (!w.valid) {
    if (threadIdx.x == 0) {
      a.row_bad[g] = 1;
      a.row_next[g] = -1;
      a.row_child[g] = -1;
    }
    return;
  }
  const double u_row = a.u_sample != nullptr ? static_cast<double>(a.u_sample[g]) : 0.5;
  auto warped = [&](int64_t v) { return static_cast<double>(row_weight(row, v, w)); };

  if (w.greedy || a.rule == kCoupled) {
    // greedy: the argmax of the raw row; coupled: t = F^-1(u_sample[row]) (PTP §2.3)
    const long long t = w.greedy ? w.argmax : inverse_cdf_sample<BLOCK>(V, warped, u_row);
    if (threadIdx.x == 0) {
      int hit = -1;
      for (int j = 0; j < n_b && hit < 0; ++j)
        if (par_b[j] == r - 1 && tok_b[j] == t) hit = j;
      a.row_bad[g] = 0;
      a.row_next[g] = t;  // -1 only if the warped row kept no mass (the reference then returns -1 too)
      a.row_child[g] = hit;
    }
    return;
  }

  verify_row_speculative<T, BLOCK, DEFER>(a, row, g, b, r, w, u_row);
}

// Row passes by what the rule needs of a row (RowKind), one kernel instance each, so that no rule pays for the
// registers of another's state: with one kernel for every rule ptxas gave 122-124 registers per thread on sm_90a
// (one 512-thread CTA per SM), and greedy verify read rows at 36% of an H100's bandwidth.
enum RowKind : int { kRowArgmax = 0, kRowRank = 1, kRowSoft = 2, kRowSampling = 3, kRowSpeculativeDeferred = 4 };

inline RowKind row_kind(int64_t rule) {
  if (rule >= kSpeculative) return kRowSampling;
  if (rule == kTopK || rule == kGad) return kRowRank;
  if (rule == kTypical || rule == kConfidence) return kRowSoft;
  return kRowArgmax;  // greedy, distance
}

template <typename T, int BLOCK, int KIND>
__global__ void __launch_bounds__(BLOCK) _verify_rows_kernel(VerifyArgs a) {
  for (int64_t g = blockIdx.x; g < a.NR; g += gridDim.x) {
    const int b = request_of_row(a.cu_nodes, a.B, g);
    const int r = static_cast<int>(g - (static_cast<int64_t>(a.cu_nodes[b]) + b));
    const T* row = static_cast<const T*>(a.logits) + g * a.row_stride;
    if constexpr (KIND == kRowSampling || KIND == kRowSpeculativeDeferred) {
      verify_row_sampling<T, BLOCK, KIND == kRowSpeculativeDeferred>(a, row, g, b, r);
    } else {
      verify_row_deterministic<T, BLOCK, KIND == kRowRank, KIND == kRowSoft>(a, row, g, b, r);
    }
    __syncthreads();
  }
}

template <typename T>
void launch_verify_rows(const VerifyArgs& a, RowKind kind, int64_t grid, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(grid);
  switch (kind) {
    case kRowArgmax: _verify_rows_kernel<T, kVerifyBlock, kRowArgmax><<<blocks, kVerifyBlock, 0, stream>>>(a); break;
    case kRowRank: _verify_rows_kernel<T, kVerifyBlock, kRowRank><<<blocks, kVerifyBlock, 0, stream>>>(a); break;
    case kRowSoft: _verify_rows_kernel<T, kVerifyBlock, kRowSoft><<<blocks, kVerifyBlock, 0, stream>>>(a); break;
    case kRowSpeculativeDeferred:
      _verify_rows_kernel<T, kVerifyBlock, kRowSpeculativeDeferred><<<blocks, kVerifyBlock, 0, stream>>>(a);
      break;
    default: _verify_rows_kernel<T, kVerifyBlock, kRowSampling><<<blocks, kVerifyBlock, 0, stream>>>(a); break;
  }
}

// The speculative rule's final pass after the deferred rows pass: one CTA per request (grid-stride; the grid is
// capped like the one-pass kernel's, one float64 scratch row per CTA). Thread 0 follows the children the rows pass
// accepted from the root row, as the walk kernel will, to the first row the rows pass left: a row whose draw it
// deferred (the request's final row) or one it left unresolved. That row is done in full by verify_row_sampling
// (DEFER = false: the one-pass kernel's function, so it writes that kernel's values), and the search goes on from it
// (below an unresolved row whose child is now accepted). Only rows on the accepted path are read twice.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) _verify_speculative_final_kernel(VerifyArgs a) {
  __shared__ int s_row;
  for (int b = blockIdx.x; b < a.B; b += gridDim.x) {
    const int32_t start = a.cu_nodes[b];
    const int n_b = a.cu_nodes[b + 1] - start;
    const int64_t row0 = static_cast<int64_t>(start) + b;
    int r = 0;
    for (int steps = 0; steps <= n_b; ++steps) {  // each step completes one row of the path
      if (threadIdx.x == 0) {
        int found = -1;
        for (int rr = r; rr <= n_b;) {  // rr grows at every step: children come after their parent's row
          const int c = a.row_child[row0 + rr];
          if (c == kUnresolvedRow || (c == -1 && a.row_next[row0 + rr] == kDeferredDraw)) {
            found = rr;
            break;
          }
          if (c < 0 || c < rr || c >= n_b) break;  // the walk kernel's guard
          rr = c + 1;
        }
        s_row = found;
      }
      __syncthreads();
      const int rr = s_row;
      __syncthreads();
      if (rr < 0) break;
      const int64_t g = row0 + rr;
      verify_row_sampling<T, BLOCK, false>(a, static_cast<const T*>(a.logits) + g * a.row_stride, g, b, rr);
      __syncthreads();
      r = rr;  // row_child of rr is now a child or -1 with row_next the drawn token
    }
  }
}

// FASTVERIFY_CUDA_SPECULATIVE=deferred: the speculative rule in two passes (the rows pass tests every row's children
// without drawing; the final pass draws at each request's final row). Opt-in until its GPU tests have run; read at
// every call, so a process may switch.
inline bool speculative_deferred() {
  const char* s = std::getenv("FASTVERIFY_CUDA_SPECULATIVE");
  return s != nullptr && std::strcmp(s, "deferred") == 0;
}

// ---- argmax-only rows split over several CTAs ----------------------------------------------------------------

// One segment's share of a row's argmax pass. argmax: lowest id holding max, kNoArgmax when no entry of the segment
// is free of NaN / +inf (max is -inf then).
struct ArgmaxPartial {
  float max;
  int32_t bad;  // NaN or +inf in the segment
  long long argmax;
};
static_assert(sizeof(ArgmaxPartial) == 16, "ArgmaxPartial: two int64 per partial in the host's scratch");
constexpr long long kNoArgmax = 0x7fffffffffffffffLL;

// One CTA per (row g, segment s) item = g * nseg + s: tokens [s * seg_len, min((s + 1) * seg_len, V)).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _verify_argmax_segments_kernel(VerifyArgs a, int nseg, int64_t seg_len, ArgmaxPartial* __restrict__ part) {
  const int64_t items = a.NR * nseg;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t g = item / nseg;
    const int64_t lo = (item - g * nseg) * seg_len;
    const int64_t n = a.V - lo < seg_len ? a.V - lo : seg_len;
    const T* seg = static_cast<const T*>(a.logits) + g * a.row_stride + lo;
    ArgMax best{-INFINITY, kNoArgmax};
    long long bad = 0;
    for_each_owned<BLOCK>(seg, n, [&](int64_t v, float x) {  // v: id within the segment
      if (isnan(x) || x == INFINITY) {
        bad = 1;
      } else if (x > best.v || (x == best.v && v < best.i)) {
        best = ArgMax{x, v};
      }
    });
    const ArgMax r = block_argmax<BLOCK>(best);
    const long long nbad = block_sum_ll<BLOCK>(bad);
    if (threadIdx.x == 0) part[item] = ArgmaxPartial{r.v, nbad > 0 ? 1 : 0, r.i == kNoArgmax ? kNoArgmax : lo + r.i};
  }
}

// The statistics of row g from its partials, folded in segment order.
__device__ __forceinline__ RawRowStats fold_partials(const ArgmaxPartial* part, int nseg, int64_t g) {
  ArgMax best{-INFINITY, kNoArgmax};
  bool bad = false;
  for (int s = 0; s < nseg; ++s) {
    const ArgmaxPartial p = part[g * nseg + s];
    best = ArgMaxOp()(best, ArgMax{p.max, p.argmax});
    bad |= p.bad != 0;
  }
  RawRowStats stats;
  stats.bad = bad;
  stats.max = best.v;
  stats.argmax = best.i == kNoArgmax ? 0 : best.i;
  return stats;
}

// Items i < NR: row i's outputs; items NR + n: node n's cond and logit at its parent's row, i.e. at the row r of its
// request with parents[n] == r - 1 (r in 0 .. n_b), which is where verify_row_deterministic's thread 0 scores it.
// One thread per item, so no thread walks a row's children one after the other.
template <typename T>
__global__ void _verify_argmax_combine_kernel(VerifyArgs a, int64_t N, int nseg,
                                              const ArgmaxPartial* __restrict__ part) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.NR + N;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < a.NR) {
      const RawRowStats stats = fold_partials(part, nseg, i);
      a.row_bad[i] = (stats.bad || stats.max == -INFINITY) ? 1 : 0;
      a.row_next[i] = stats.argmax;
      a.row_child[i] = -1;
      continue;
    }
    const int64_t n = i - a.NR;
    const int b = request_of_node(a.cu_nodes, a.B, n);
    if (b < 0) continue;
    const int32_t start = a.cu_nodes[b];
    const int n_b = a.cu_nodes[b + 1] - start;
    const int par = a.parents[n];
    if (par < -1 || par >= n_b) continue;  // no row of the request scores it
    const int64_t g = static_cast<int64_t>(start) + b + par + 1;
    const RawRowStats stats = fold_partials(part, nseg, g);
    const T* row = static_cast<const T*>(a.logits) + g * a.row_stride;
    const long long x = a.draft_tokens[n];
    const float lx = (x >= 0 && x < a.V) ? load_as_float(row + x) : __int_as_float(0x7fc00000);
    const double p0 = a.rule_params[2 * b], p1 = a.rule_params[2 * b + 1];
    score_child(a, b, start, static_cast<int>(n - start), x, lx, 0, stats, 0.0, 0.0, p0, p1);
  }
}

// Segments per row for the argmax-only rules: about kWaves rounds of the CTAs the GPU holds at once (512 threads
// and 32 registers each, kCtasPerSm fit an SM), segments of at least kMinSegment tokens; seg_len a multiple of 8 (16
// bytes of bf16 / fp16, 32 of fp32). nseg = 1: one CTA per row (_verify_rows_kernel). Several rounds, so that the
// last, partly filled one is a small part of the time: with one CTA per row, 544 rows on an H100's 528 CTA slots
// (1.03 rounds) read at 57% of the read ceiling (third GPU run), about what a second round of 16 CTAs after a full
// one leaves. The e2e's steps (a few to a few dozen rows of V = 49152) split as before, into 12 segments.
struct ArgmaxSplit {
  int nseg;
  int64_t seg_len;
};
inline ArgmaxSplit argmax_split(int64_t NR, int64_t V, int sms) {
  constexpr int64_t kCtasPerSm = 4, kWaves = 8, kMinSegment = 4096;
  const int64_t slots = kCtasPerSm * sms, rows = std::max<int64_t>(NR, 1);
  const int64_t s = std::min((kWaves * slots + rows - 1) / rows, V / kMinSegment);
  if (s <= 1) return {1, V};
  const int64_t seg_len = ((V + s - 1) / s + 7) / 8 * 8;
  return {static_cast<int>((V + seg_len - 1) / seg_len), seg_len};
}

// One thread per request: the acceptance walk. node_ok / node_forced / node_depth: scratch [N].
__global__ void _verify_walk_kernel(VerifyArgs a, int min_accept, int max_depth, uint8_t* __restrict__ node_ok,
                                    uint8_t* __restrict__ node_forced, int32_t* __restrict__ node_depth,
                                    int32_t* __restrict__ accept_len, int32_t* __restrict__ accepted,
                                    int64_t* __restrict__ next_token) {
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < a.B; b += gridDim.x * blockDim.x) {
    const int32_t start = a.cu_nodes[b];
    const int n_b = a.cu_nodes[b + 1] - start;
    const int64_t row0 = static_cast<int64_t>(start) + b;
    const int32_t* par = a.parents + start;
    int32_t* acc_b = accepted + static_cast<int64_t>(b) * max_depth;
    for (int i = 0; i < max_depth; ++i) acc_b[i] = -1;

    bool bad = false;
    for (int r = 0; r <= n_b; ++r) bad |= a.row_bad[row0 + r] != 0;
    if (bad) {
      accept_len[b] = -1;
      next_token[b] = -1;
      continue;
    }

    int node = -1;
    int64_t nxt;
    if (a.rule < kSpeculative) {
      for (int j = 0; j < n_b; ++j) {
        node_forced[start + j] = 0;
        const int p = par[j];
        node_depth[start + j] = (p >= 0 && p < j) ? node_depth[start + p] + 1 : 1;
      }
      // min_accept (Stern et al. §5.3): from the root row, the child with the highest logit (first in node order)
      int r = 0;
      for (int step = 0; step < min_accept; ++step) {
        int best = -1;
        for (int j = 0; j < n_b; ++j) {
          const long long x = a.draft_tokens[start + j];
          if (par[j] != r - 1 || x < 0 || x >= a.V) continue;  // a token outside the vocabulary is never forced
          if (best < 0 || a.node_logit[start + j] > a.node_logit[start + best]) best = j;
        }
        if (best < 0) break;
        node_forced[start + best] = 1;
        r = best + 1;
      }
      for (int j = 0; j < n_b; ++j) {
        const int p = par[j];
        const bool parent_ok = p < 0 || (p < j && node_ok[start + p]);
        const bool ok = parent_ok && (node_forced[start + j] || a.node_cond[start + j]);
        node_ok[start + j] = ok ? 1 : 0;
        if (ok && (node < 0 || node_depth[start + j] > node_depth[start + node])) node = j;
      }
      nxt = a.row_next[row0 + node + 1];
    } else {
      int r = 0;
      for (int steps = 0; steps <= n_b; ++steps) {
        const int c = a.row_child[row0 + r];
        if (c < 0 || c < r || c >= n_b) break;  // children come after their parent's row (c >= r)
        node = c;
        r = c + 1;
      }
      nxt = a.row_next[row0 + node + 1];
    }

    int len = 0;
    for (int cur = node; cur >= 0 && len <= n_b; cur = (par[cur] < cur ? par[cur] : -1)) ++len;
    for (int cur = node, i = len - 1; cur >= 0 && i >= 0; cur = (par[cur] < cur ? par[cur] : -1), --i)
      if (i < max_depth) acc_b[i] = cur;
    accept_len[b] = len;
    next_token[b] = nxt;
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_cuda(
    const at::Tensor& logits, const at::Tensor& draft_tokens, const at::Tensor& cu_nodes, const at::Tensor& parents,
    const at::Tensor& rule_params, const at::Tensor& warp, const c10::optional<at::Tensor>& draft_probs,
    const c10::optional<at::Tensor>& u_sample, const c10::optional<at::Tensor>& u_accept,
    const c10::optional<at::Tensor>& root_tokens, int64_t rule, int64_t min_accept, int64_t max_depth) {
  check_cuda(logits, "logits");
  check_logits_dtype(logits, "logits");
  check_dim(logits, 2, "logits");
  TORCH_CHECK(logits.size(1) >= 1, "logits: expected V >= 1 columns, got shape ", logits.sizes());
  TORCH_CHECK(rule >= 0 && rule <= kCoupled, "rule: expected an index in [0, 7], got ", rule);
  TORCH_CHECK(min_accept >= 0 && min_accept <= INT32_MAX, "min_accept: expected >= 0, got ", min_accept);
  TORCH_CHECK(max_depth >= 0 && max_depth <= INT32_MAX, "max_depth: expected >= 0, got ", max_depth);
  const struct {
    const at::Tensor* t;
    const char* name;
    at::ScalarType dt;
  } ints[] = {{&draft_tokens, "draft_tokens", at::kLong},
              {&cu_nodes, "cu_nodes", at::kInt},
              {&parents, "parents", at::kInt},
              {&rule_params, "rule_params", at::kFloat},
              {&warp, "warp", at::kFloat}};
  for (const auto& e : ints) {
    check_cuda(*e.t, e.name);
    check_same_device(*e.t, logits, e.name, "logits");
    check_dtype(*e.t, e.dt, e.name);
  }
  check_dim(cu_nodes, 1, "cu_nodes");
  TORCH_CHECK(cu_nodes.numel() >= 1, "cu_nodes: expected shape [B + 1], got ", cu_nodes.sizes());
  const int64_t B = cu_nodes.numel() - 1;
  const int64_t N = draft_tokens.numel();
  const int64_t V = logits.size(1);
  TORCH_CHECK(draft_tokens.dim() == 1, "draft_tokens: expected shape [N], got ", draft_tokens.sizes());
  TORCH_CHECK(parents.dim() == 1 && parents.numel() == N, "parents: expected shape [", N, "], got ", parents.sizes());
  TORCH_CHECK(logits.size(0) == N + B, "logits: expected N + B = ", N + B, " rows, got shape ", logits.sizes());
  TORCH_CHECK(rule_params.dim() == 2 && rule_params.size(0) == B && rule_params.size(1) == 2,
              "rule_params: expected shape [", B, ", 2], got ", rule_params.sizes());
  TORCH_CHECK(warp.dim() == 2 && warp.size(0) == B && warp.size(1) == 4, "warp: expected shape [", B, ", 4], got ",
              warp.sizes());
  TORCH_CHECK(B <= INT32_MAX && N <= INT32_MAX, "cu_nodes: too many requests or nodes");
  const bool sampling_rule = rule >= kSpeculative;

  at::Tensor dp, us, ua, rt;
  if (draft_probs.has_value() && draft_probs->defined() && rule == kSpeculative) {
    check_cuda(*draft_probs, "draft_probs");
    check_same_device(*draft_probs, logits, "draft_probs", "logits");
    TORCH_CHECK(at::isFloatingType(draft_probs->scalar_type()), "draft_probs: expected a floating dtype, got ",
                draft_probs->scalar_type());
    TORCH_CHECK(draft_probs->dim() == 2 && draft_probs->size(0) == N && draft_probs->size(1) == V,
                "draft_probs: expected shape [", N, ", ", V, "], got ", draft_probs->sizes());
    // Read in its own dtype and widened in the kernel (exact, as the reference's float64 reading); dtypes without a
    // loader are converted to float64 here.
    dp = *draft_probs;
    const auto dt = dp.scalar_type();
    if (dt != at::kDouble && dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) dp = dp.to(at::kDouble);
    if (dp.stride(1) != 1) dp = dp.contiguous();
  }
  if (u_sample.has_value() && u_sample->defined()) {
    check_cuda(*u_sample, "u_sample");
    check_same_device(*u_sample, logits, "u_sample", "logits");
    check_dtype(*u_sample, at::kFloat, "u_sample");
    TORCH_CHECK(u_sample->dim() == 1 && u_sample->size(0) == N + B, "u_sample: expected shape [", N + B, "], got ",
                u_sample->sizes());
    us = u_sample->contiguous();
  }
  if (u_accept.has_value() && u_accept->defined()) {
    check_cuda(*u_accept, "u_accept");
    check_same_device(*u_accept, logits, "u_accept", "logits");
    check_dtype(*u_accept, at::kFloat, "u_accept");
    TORCH_CHECK(u_accept->dim() == 1 && u_accept->size(0) == N, "u_accept: expected shape [", N, "], got ",
                u_accept->sizes());
    ua = u_accept->contiguous();
  }
  if (root_tokens.has_value() && root_tokens->defined()) {
    check_cuda(*root_tokens, "root_tokens");
    check_same_device(*root_tokens, logits, "root_tokens", "logits");
    check_dtype(*root_tokens, at::kLong, "root_tokens");
    TORCH_CHECK(root_tokens->dim() == 1 && root_tokens->size(0) == B, "root_tokens: expected shape [", B, "], got ",
                root_tokens->sizes());
    rt = root_tokens->contiguous();
  }
  if (sampling_rule) {
    // Rows of non-greedy requests draw with u_sample, and speculative's acceptance tests use u_accept; the Python
    // layer always supplies both for the sampling rules.
    TORCH_CHECK(us.defined(), "u_sample: required by the sampling rules (speculative, coupled)");
    TORCH_CHECK(rule != kSpeculative || N == 0 || ua.defined(), "u_accept: required by the speculative rule");
  }

  const c10::cuda::CUDAGuard guard(logits.device());
  auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  auto tok = draft_tokens.contiguous();
  auto cu = cu_nodes.contiguous();
  auto par = parents.contiguous();
  auto rp = rule_params.contiguous();
  auto wp = warp.contiguous();
  auto opts_i = cu.options();
  auto accept_len = at::empty({B}, opts_i.dtype(at::kInt));
  auto accepted = at::empty({B, max_depth}, opts_i.dtype(at::kInt));
  auto next_token = at::empty({B}, opts_i.dtype(at::kLong));
  if (B == 0) return {accept_len, accepted, next_token};

  const int64_t NR = N + B;
  auto row_bad = at::empty({NR}, opts_i.dtype(at::kInt));
  auto row_next = at::empty({NR}, opts_i.dtype(at::kLong));
  auto row_child = at::empty({NR}, opts_i.dtype(at::kInt));
  auto node_cond = at::zeros({std::max<int64_t>(N, 1)}, opts_i.dtype(at::kByte));
  auto node_logit = at::empty({std::max<int64_t>(N, 1)}, opts_i.dtype(at::kFloat));
  // Speculative residual rows: one per CTA; the grid is capped to keep this scratch bounded. With the deferred
  // draw the rows pass needs none and only the final pass's CTAs (one per request, capped) have a row each.
  const bool deferred = rule == kSpeculative && speculative_deferred();
  const int64_t grid = std::min<int64_t>(NR, rule == kSpeculative && !deferred ? 128 : 65535);
  const int64_t final_grid = std::min<int64_t>(B, 128);
  at::Tensor scratch;
  if (rule == kSpeculative) scratch = at::empty({deferred ? final_grid : grid, V}, opts_i.dtype(at::kDouble));
  const RowKind kind = deferred ? kRowSpeculativeDeferred : row_kind(rule);
  const ArgmaxSplit split = kind == kRowArgmax
                                ? argmax_split(NR, V, at::cuda::getCurrentDeviceProperties()->multiProcessorCount)
                                : ArgmaxSplit{1, V};
  at::Tensor partials;  // ArgmaxPartial [NR * nseg]
  if (split.nseg > 1) partials = at::empty({NR * split.nseg, 2}, opts_i.dtype(at::kLong));

  VerifyArgs a;
  a.logits = x.data_ptr();
  a.row_stride = x.stride(0);
  a.V = V;
  a.NR = NR;
  a.B = static_cast<int>(B);
  a.draft_tokens = tok.data_ptr<int64_t>();
  a.cu_nodes = cu.data_ptr<int32_t>();
  a.parents = par.data_ptr<int32_t>();
  a.rule_params = rp.data_ptr<float>();
  a.warp = wp.data_ptr<float>();
  a.draft_probs = dp.defined() ? dp.data_ptr() : nullptr;
  a.draft_probs_stride = dp.defined() ? dp.stride(0) : 0;
  a.draft_probs_type = !dp.defined()                         ? kProbDouble
                       : dp.scalar_type() == at::kFloat    ? kProbFloat
                       : dp.scalar_type() == at::kHalf     ? kProbHalf
                       : dp.scalar_type() == at::kBFloat16 ? kProbBFloat16
                                                           : kProbDouble;
  a.u_sample = us.defined() ? us.data_ptr<float>() : nullptr;
  a.u_accept = ua.defined() ? ua.data_ptr<float>() : nullptr;
  a.root_tokens = rt.defined() ? rt.data_ptr<int64_t>() : nullptr;
  a.rule = static_cast<int>(rule);
  a.row_bad = row_bad.data_ptr<int32_t>();
  a.row_next = row_next.data_ptr<int64_t>();
  a.row_child = row_child.data_ptr<int32_t>();
  a.node_cond = node_cond.data_ptr<uint8_t>();
  a.node_logit = node_logit.data_ptr<float>();
  a.scratch = scratch.defined() ? scratch.data_ptr<double>() : nullptr;

  auto stream = at::cuda::getCurrentCUDAStream();
  FASTVERIFY_DISPATCH_FLOATING(x.scalar_type(), "logits", [&] {
    if (split.nseg > 1) {
      auto* part = reinterpret_cast<ArgmaxPartial*>(partials.data_ptr<int64_t>());
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(NR * split.nseg, 65535));
      _verify_argmax_segments_kernel<scalar_t, kVerifyBlock>
          <<<blocks, kVerifyBlock, 0, stream>>>(a, split.nseg, split.seg_len, part);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      constexpr int kCombineThreads = 128;
      _verify_argmax_combine_kernel<scalar_t>
          <<<grid_for(NR + N, kCombineThreads), kCombineThreads, 0, stream>>>(a, N, split.nseg, part);
    } else {
      launch_verify_rows<scalar_t>(a, kind, grid, stream);
      if (deferred) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        _verify_speculative_final_kernel<scalar_t, kVerifyBlock>
            <<<static_cast<unsigned>(final_grid), kVerifyBlock, 0, stream>>>(a);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  auto node_ok = at::empty({std::max<int64_t>(N, 1)}, opts_i.dtype(at::kByte));
  auto node_forced = at::empty({std::max<int64_t>(N, 1)}, opts_i.dtype(at::kByte));
  auto node_depth = at::empty({std::max<int64_t>(N, 1)}, opts_i.dtype(at::kInt));
  constexpr int kWalkThreads = 128;
  _verify_walk_kernel<<<grid_for(B, kWalkThreads), kWalkThreads, 0, stream>>>(
      a, static_cast<int>(min_accept), static_cast<int>(max_depth), node_ok.data_ptr<uint8_t>(),
      node_forced.data_ptr<uint8_t>(), node_depth.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(),
      accepted.data_ptr<int32_t>(), next_token.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_len, accepted, next_token};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CUDA, m) { m.impl("verify", &verify_cuda); }

}  // namespace cuda
}  // namespace fastverify
