// CPU kernel of fastverify::verify (schema and argument conventions: csrc/verify.cpp; specification:
// fastverify/reference/verify.py).
//
// Two phases:
//   1. _verify_rows_kernel, parallel over the N + B logits rows: one pass over each row (csrc/verify.h) gives its
//      max / argmax / validity and, as the rule needs, the ranks of its children's tokens, S = sum exp(l - max)
//      and the entropy. The sampling rules use this pass for validity and argmax only.
//   2. _verify_walk_kernel, parallel over requests: the acceptance walk over the request's tree, which touches
//      only the per-row / per-node statistics (deterministic rules) or, for the sampling rules, the warped rows
//      on the path (csrc/sampling.h, the same row functions as cdf_sample).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "sampling.h"
#include "verify.h"

namespace {

using namespace fastverify::verify_detail;

enum Rule : int64_t { kGreedy, kTopk, kDistance, kGad, kTypical, kConfidence, kSpeculative, kCoupled, kNumRules };

// The request layout after validation: children of each row in node order (CSR), depth of each node.
struct Layout {
  int64_t B, N, R, V;
  const int32_t* cu;
  const int64_t* tokens;
  const int32_t* parents;
  std::vector<int64_t> row_start;  // [R + 1]: children of row r are csr_node[row_start[r] .. row_start[r + 1])
  std::vector<int64_t> csr_node;   // [N] global node ids
  std::vector<int64_t> csr_token;  // [N] their tokens
  std::vector<int64_t> node_pos;   // [N] position of node g in the CSR arrays
  std::vector<int32_t> depth;      // [N]
};

Layout make_layout(const at::Tensor& cu_nodes, const at::Tensor& draft_tokens, const at::Tensor& parents, int64_t V,
                   int64_t rows, int64_t max_depth) {
  Layout L;
  L.B = cu_nodes.size(0) - 1;
  L.N = draft_tokens.size(0);
  L.R = L.N + L.B;
  L.V = V;
  L.cu = cu_nodes.data_ptr<int32_t>();
  L.tokens = draft_tokens.data_ptr<int64_t>();
  L.parents = parents.data_ptr<int32_t>();
  TORCH_CHECK(rows == L.R, "verify: logits: expected N + B = ", L.R, " rows, got ", rows);
  TORCH_CHECK(L.cu[0] == 0 && L.cu[L.B] == L.N, "verify: cu_nodes: expected offsets from 0 to N = ", L.N, ", got ",
              L.cu[0], " .. ", L.cu[L.B]);
  for (int64_t b = 0; b < L.B; ++b)  // before any indexing: offsets stay inside [0, N]
    TORCH_CHECK(L.cu[b + 1] >= L.cu[b] && L.cu[b + 1] <= L.N,
                "verify: cu_nodes: expected non-decreasing offsets in [0, N = ", L.N, "], got cu_nodes[", b,
                "] = ", L.cu[b], ", cu_nodes[", b + 1, "] = ", L.cu[b + 1]);
  L.depth.assign(L.N, 0);
  std::vector<int64_t> count(L.R + 1, 0);
  std::vector<int64_t> parent_row(L.N);
  for (int64_t b = 0; b < L.B; ++b) {
    for (int64_t g = L.cu[b]; g < L.cu[b + 1]; ++g) {
      const int64_t j = g - L.cu[b];
      const int64_t p = L.parents[g];
      TORCH_CHECK(p >= -1 && p < j, "verify: parents: request ", b, " node ", j, " has parent ", p,
                  "; expected -1 or a preceding node of the same request");
      TORCH_CHECK(L.tokens[g] >= 0 && L.tokens[g] < V, "verify: draft_tokens: token ", L.tokens[g], " of node ", g,
                  " is outside the vocabulary [0, ", V, ")");
      L.depth[g] = p < 0 ? 1 : L.depth[L.cu[b] + p] + 1;  // deeper than max_depth: `accepted` keeps the first
      parent_row[g] = L.cu[b] + b + p + 1;
      ++count[parent_row[g] + 1];
    }
  }
  L.row_start.assign(L.R + 1, 0);
  for (int64_t r = 0; r < L.R; ++r) L.row_start[r + 1] = L.row_start[r] + count[r + 1];
  L.csr_node.resize(L.N);
  L.csr_token.resize(L.N);
  L.node_pos.resize(L.N);
  std::vector<int64_t> fill(L.row_start.begin(), L.row_start.end() - 1);
  for (int64_t g = 0; g < L.N; ++g) {  // global order = node order within each row
    const int64_t k = fill[parent_row[g]]++;
    L.csr_node[k] = g;
    L.csr_token[k] = L.tokens[g];
    L.node_pos[g] = k;
  }
  return L;
}

// Phase 1: statistics of every row.
template <typename T>
void _verify_rows_kernel(const typename T::raw* logits, int64_t row_stride, const Layout& L, RowNeeds needs,
                         std::vector<RowStats>& stats, std::vector<float>& csr_logit, std::vector<int64_t>& csr_rank) {
  // Rows are the unit of work; small vocabularies batch several rows per task.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(L.V, 1));
  at::parallel_for(0, L.R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const typename T::raw* row = logits + r * row_stride;
      const int64_t k0 = L.row_start[r], k1 = L.row_start[r + 1];
      for (int64_t k = k0; k < k1; ++k) csr_logit[k] = to_float<T>(row[L.csr_token[k]]);
      RowChildren ch{int(k1 - k0), L.csr_token.data() + k0, csr_logit.data() + k0, csr_rank.data() + k0};
      RowNeeds nd = needs;
      if (ch.n == 0) nd = RowNeeds{false, false, false};  // a leaf row only gives the argmax (next token)
      row_stats<T>(row, L.V, nd, ch, stats[r]);
    }
  });
}

// Phase 2 (deterministic rules): the acceptance walk of one request. Returns the last accepted local node or -1.
int64_t walk_deterministic(const Layout& L, int64_t b, int64_t rule, const float* params, const int64_t* root_tokens,
                           int64_t min_accept, const std::vector<RowStats>& stats, const std::vector<float>& csr_logit,
                           const std::vector<int64_t>& csr_rank, std::vector<char>& ok) {
  const int64_t lo = L.cu[b], n = L.cu[b + 1] - lo, row0 = lo + b;
  ok.assign(n, 0);
  // Forced nodes: the most likely path (Stern et al. 2018, §5.3): at each row the child with the highest logit.
  std::vector<char>& forced = ok;  // reuse: bit 1 of ok[j] marks "forced", bit 0 "accepted"
  {
    int64_t r = row0;
    for (int64_t d = 0; d < min_accept; ++d) {
      const int64_t k0 = L.row_start[r], k1 = L.row_start[r + 1];
      if (k0 == k1) break;
      int64_t best = k0;
      for (int64_t k = k0 + 1; k < k1; ++k)
        if (csr_logit[k] > csr_logit[best]) best = k;  // strict: ties keep the first child in node order
      const int64_t j = L.csr_node[best] - lo;
      forced[j] |= 2;
      r = row0 + j + 1;
    }
  }
  const double p0 = params[0], p1 = params[1];
  int64_t deepest = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = lo + j;
    const int64_t p = L.parents[g];
    if (p >= 0 && !(ok[p] & 1)) continue;
    bool cond = (ok[j] & 2) != 0;
    if (!cond) {
      const RowStats& s = stats[row0 + p + 1];
      const int64_t k = L.node_pos[g];
      const int64_t x = L.tokens[g];
      const double lx = csr_logit[k];
      switch (rule) {
        case kGreedy: cond = x == s.argmax; break;
        case kTopk: cond = double(csr_rank[k]) < p0; break;
        case kDistance: cond = double(std::llabs(x - s.argmax)) <= p0; break;
        case kGad: cond = double(csr_rank[k]) < p0 && double(s.max) - lx <= p1; break;
        case kTypical: {
          const double px = std::exp(lx - double(s.max)) / s.sum;
          cond = px > std::min(p0, p1 * std::exp(-s.ent));
          break;
        }
        case kConfidence: {
          const double px = std::exp(lx - double(s.max)) / s.sum;
          const int64_t parent_token = p >= 0 ? L.tokens[lo + p] : (root_tokens ? root_tokens[b] : -1);
          cond = px >= p0 && x != parent_token;
          break;
        }
        default: TORCH_CHECK(false, "verify: rule ", rule, " is not a deterministic rule");
      }
    }
    if (cond) {
      ok[j] |= 1;
      if (deepest < 0 || L.depth[g] > L.depth[lo + deepest]) deepest = j;
    }
  }
  return deepest;
}

namespace fs = fastverify::sampling;

// Per-thread buffers of the sampling walks.
struct SamplingScratch {
  fs::RowWorkspace ws;
  std::vector<float> w;     // [V] warped weights of the current row
  std::vector<double> p;    // [V] current (residual) distribution p'
  std::vector<double> res;  // [V] max(p' - q, 0)
  std::vector<int64_t> ex_ids;  // one-hot drafts: the rejected tokens of the current row and their weights
  std::vector<double> ex_w;
};

struct SamplingInputs {
  const float* warp;       // [B, 4]
  const float* q;          // [N, V] draft_probs (float32, contiguous) or nullptr
  const float* u_sample;   // [N + B]
  const float* u_accept;   // [N] or nullptr
};

// Phase 2 (speculative, coupled): the walk of one request. Returns false when a warped row on the path has no
// distribution (the request is then reported as invalid); sets *node (last accepted local node or -1) and *next.
template <typename S>
bool walk_sampling(const S* logits, int64_t row_stride, const Layout& L, int64_t b, int64_t rule,
                   const SamplingInputs& in, const std::vector<RowStats>& stats, SamplingScratch& sc, int64_t* node,
                   int64_t* next) {
  const int64_t lo = L.cu[b], row0 = lo + b, V = L.V;
  const fs::Warp wp = fs::load_warp(in.warp + 4 * b);
  *node = -1;
  int64_t r = row0;
  auto first_child_with = [&](int64_t row, int64_t t) -> int64_t {
    for (int64_t k = L.row_start[row]; k < L.row_start[row + 1]; ++k)
      if (L.csr_token[k] == t) return L.csr_node[k] - lo;
    return -1;
  };
  for (;;) {
    if (wp.temperature == 0.f) {  // greedy: accept the child holding the argmax
      const int64_t a = stats[r].argmax;
      const int64_t j = first_child_with(r, a);
      if (j < 0) {
        *next = a;
        return true;
      }
      *node = j;
      r = row0 + j + 1;
      continue;
    }
    const S* row = logits + r * row_stride;
    const fs::RowDist d = fs::warp_row(row, V, wp, sc.ws);
    if (!d.valid) return false;
    if (rule == kCoupled) {  // PTP §2.3: t = F^-1(u) at every row, the same draw as cdf_sample
      const int64_t t = fs::sample_row(row, d, sc.ws, double(in.u_sample[r]));
      const int64_t j = first_child_with(r, t);
      if (j < 0) {
        *next = t;
        return true;
      }
      *node = j;
      r = row0 + j + 1;
      continue;
    }
    // speculative (Leviathan et al. Alg. 1; SpecInfer Alg. 2): siblings in node order against the residual.
    const int64_t k0 = L.row_start[r], k1 = L.row_start[r + 1];
    bool residual = false;
    int64_t hit = -1;
    if (k1 > k0 && !in.q) {
      // One-hot drafts: max(p' - q, 0) renormalised is p' without x, so the residual is the row's own weights
      // without the rejected tokens (fs::Excluded), and no dense array is built. Z' = Z - their weight.
      sc.ex_ids.clear();
      sc.ex_w.clear();
      double rest = d.z;
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t g = L.csr_node[k], x = L.csr_token[k];
        const fs::Excluded ex{int64_t(sc.ex_ids.size()), sc.ex_ids.data(), sc.ex_w.data()};
        const double wx = ex.has(x) ? 0.0 : double(fs::token_weight(row, d, x));
        if (rest > 0.0 && double(in.u_accept[g]) <= wx / rest) {
          hit = g - lo;
          break;
        }
        if (wx > 0.0) {
          sc.ex_ids.push_back(x);
          sc.ex_w.push_back(wx);
          rest -= wx;
        }
      }
      if (hit < 0) {
        const fs::Excluded ex{int64_t(sc.ex_ids.size()), sc.ex_ids.data(), sc.ex_w.data()};
        const double u = double(in.u_sample[r]);
        *next = ex.n ? fs::select_target(row, d, sc.ws, u * rest, ex) : fs::sample_row(row, d, sc.ws, u);
        return true;
      }
    } else if (k1 > k0) {  // draft_probs q
      sc.w.resize(V);
      sc.p.resize(V);
      sc.res.resize(V);
      fs::row_weights(row, d, sc.ws, sc.w.data());
      for (int64_t v = 0; v < V; ++v) sc.p[v] = double(sc.w[v]) / d.z;
      for (int64_t k = k0; k < k1 && hit < 0; ++k) {
        const int64_t g = L.csr_node[k], x = L.csr_token[k];
        const float* q = in.q + g * V;
        const double qx = double(q[x]), px = sc.p[x];
        const bool ok = qx > 0.0 ? double(in.u_accept[g]) <= px / qx : px > 0.0;
        if (ok) {
          hit = g - lo;
          break;
        }
        double mass = 0.0;
        for (int64_t v = 0; v < V; ++v) {
          const double e = sc.p[v] - double(q[v]);
          sc.res[v] = e > 0.0 ? e : 0.0;
          mass += sc.res[v];
        }
        if (mass > 0.0) {
          for (int64_t v = 0; v < V; ++v) sc.p[v] = sc.res[v] / mass;
          residual = true;
        }
      }
    }
    if (hit < 0) {
      const double u = double(in.u_sample[r]);
      *next = residual ? fs::sample_weights(sc.p.data(), V, u) : fs::sample_row(row, d, sc.ws, u);
      return true;
    }
    *node = hit;
    r = row0 + hit + 1;
  }
}

RowNeeds needs_of(int64_t rule) {
  switch (rule) {
    case kTopk: return {true, false, false};
    case kGad: return {true, false, false};
    case kTypical: return {false, true, true};
    case kConfidence: return {false, true, false};
    default: return {false, false, false};
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_cpu(
    const at::Tensor& logits, const at::Tensor& draft_tokens, const at::Tensor& cu_nodes, const at::Tensor& parents,
    const at::Tensor& rule_params, const at::Tensor& warp, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& u_sample, const std::optional<at::Tensor>& u_accept,
    const std::optional<at::Tensor>& root_tokens, int64_t rule, int64_t min_accept, int64_t max_depth) {
  TORCH_CHECK(logits.dim() == 2, "verify: logits: expected [N + B, V], got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "verify: logits: expected float32, bfloat16 or float16, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) >= 1, "verify: logits: expected V >= 1");
  TORCH_CHECK(logits.size(0) == 0 || logits.stride(1) == 1, "verify: logits: expected a contiguous last dimension");
  TORCH_CHECK(draft_tokens.dim() == 1 && draft_tokens.scalar_type() == at::kLong,
              "verify: draft_tokens: expected int64 [N], got ", draft_tokens.scalar_type(), " ", draft_tokens.sizes());
  TORCH_CHECK(cu_nodes.dim() == 1 && cu_nodes.size(0) >= 1 && cu_nodes.scalar_type() == at::kInt,
              "verify: cu_nodes: expected int32 [B + 1], got ", cu_nodes.scalar_type(), " ", cu_nodes.sizes());
  TORCH_CHECK(parents.dim() == 1 && parents.scalar_type() == at::kInt && parents.size(0) == draft_tokens.size(0),
              "verify: parents: expected int32 [N], got ", parents.scalar_type(), " ", parents.sizes());
  const int64_t B = cu_nodes.size(0) - 1;
  TORCH_CHECK(rule_params.scalar_type() == at::kFloat && rule_params.dim() == 2 && rule_params.size(0) == B &&
                  rule_params.size(1) == 2,
              "verify: rule_params: expected float32 [B, 2], got ", rule_params.scalar_type(), " ",
              rule_params.sizes());
  TORCH_CHECK(warp.scalar_type() == at::kFloat && warp.dim() == 2 && warp.size(0) == B && warp.size(1) == 4,
              "verify: warp: expected float32 [B, 4], got ", warp.scalar_type(), " ", warp.sizes());
  TORCH_CHECK(rule >= 0 && rule < kNumRules, "verify: rule: expected an index in [0, ", int64_t(kNumRules), "), got ",
              rule);
  TORCH_CHECK(min_accept >= 0, "verify: min_accept: expected >= 0, got ", min_accept);
  TORCH_CHECK(max_depth >= 0, "verify: max_depth: expected >= 0, got ", max_depth);
  if (root_tokens.has_value())
    TORCH_CHECK(root_tokens->scalar_type() == at::kLong && root_tokens->numel() == B,
                "verify: root_tokens: expected int64 [B], got ", root_tokens->scalar_type(), " ", root_tokens->sizes());
  for (const at::Tensor* t : {&logits, &draft_tokens, &cu_nodes, &parents, &rule_params, &warp})
    TORCH_CHECK(t->device().is_cpu(), "verify: the CPU kernel needs CPU tensors");

  const at::Tensor cu_c = cu_nodes.contiguous(), tok_c = draft_tokens.contiguous(), par_c = parents.contiguous();
  const at::Tensor params_c = rule_params.contiguous();
  const int64_t V = logits.size(1);
  const Layout L = make_layout(cu_c, tok_c, par_c, V, logits.size(0), max_depth);
  const bool sampling_rule = rule == kSpeculative || rule == kCoupled;
  TORCH_CHECK(!sampling_rule || min_accept == 0, "verify: min_accept: must be 0 for the sampling rules");

  std::vector<RowStats> stats(L.R);
  std::vector<float> csr_logit(L.N);
  std::vector<int64_t> csr_rank(L.N, 0);
  const RowNeeds needs = needs_of(rule);
  const int64_t row_stride = L.R > 0 ? logits.stride(0) : 0;
  switch (logits.scalar_type()) {
    case at::kFloat:
      _verify_rows_kernel<F32>(logits.const_data_ptr<float>(), row_stride, L, needs, stats, csr_logit, csr_rank);
      break;
    case at::kBFloat16:
      _verify_rows_kernel<BF16>(reinterpret_cast<const uint16_t*>(logits.const_data_ptr<at::BFloat16>()), row_stride,
                                L, needs, stats, csr_logit, csr_rank);
      break;
    default:
      _verify_rows_kernel<F16>(reinterpret_cast<const uint16_t*>(logits.const_data_ptr<at::Half>()), row_stride, L,
                               needs, stats, csr_logit, csr_rank);
  }

  at::Tensor accept_len = at::empty({B}, cu_nodes.options().dtype(at::kInt));
  at::Tensor accepted = at::full({B, max_depth}, -1, cu_nodes.options().dtype(at::kInt));
  at::Tensor next_token = at::empty({B}, cu_nodes.options().dtype(at::kLong));
  int32_t* out_len = accept_len.data_ptr<int32_t>();
  int32_t* out_acc = accepted.data_ptr<int32_t>();
  int64_t* out_next = next_token.data_ptr<int64_t>();
  const float* params = params_c.data_ptr<float>();
  const at::Tensor root_c = root_tokens.has_value() ? root_tokens->contiguous() : at::Tensor();
  const int64_t* roots = root_tokens.has_value() ? root_c.data_ptr<int64_t>() : nullptr;

  SamplingInputs sin{};
  at::Tensor warp_c, q_c, us_c, ua_c;
  if (sampling_rule) {
    warp_c = warp.contiguous();
    sin.warp = warp_c.data_ptr<float>();
    TORCH_CHECK(u_sample.has_value() && u_sample->scalar_type() == at::kFloat && u_sample->numel() == L.R,
                "verify: u_sample: the sampling rules need float32 [N + B] uniforms");
    us_c = u_sample->contiguous();
    sin.u_sample = us_c.data_ptr<float>();
    if (rule == kSpeculative) {
      TORCH_CHECK(u_accept.has_value() && u_accept->scalar_type() == at::kFloat && u_accept->numel() == L.N,
                  "verify: u_accept: rule speculative needs float32 [N] uniforms");
      ua_c = u_accept->contiguous();
      sin.u_accept = ua_c.data_ptr<float>();
      if (draft_probs.has_value()) {
        TORCH_CHECK(draft_probs->dim() == 2 && draft_probs->size(0) == L.N && draft_probs->size(1) == V &&
                        at::isFloatingType(draft_probs->scalar_type()),
                    "verify: draft_probs: expected floating [N, V] = [", L.N, ", ", V, "], got ",
                    draft_probs->scalar_type(), " ", draft_probs->sizes());
        q_c = draft_probs->to(at::kFloat).contiguous();
        sin.q = q_c.data_ptr<float>();
      }
    }
  }

  // A sampling walk reads whole rows: one request per task when rows are long, several when they are short.
  const int64_t walk_grain = sampling_rule ? std::max<int64_t>(1, 32768 / V) : 16;
  at::parallel_for(0, B, walk_grain, [&](int64_t b0, int64_t b1) {
    std::vector<char> ok;
    std::vector<int64_t> path;
    SamplingScratch sc;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = L.cu[b], n = L.cu[b + 1] - lo, row0 = lo + b;
      bool bad = false;
      for (int64_t r = row0; r <= row0 + n; ++r) bad |= stats[r].bad;
      if (sampling_rule && !bad && sin.warp[4 * b] > 0.f)  // l / T overflowing float32 (as sampling.invalid_rows)
        for (int64_t r = row0; r <= row0 + n; ++r) bad |= std::isinf(stats[r].max / sin.warp[4 * b]);
      int64_t node = -1, nxt = -1;
      if (!bad && sampling_rule) {
        switch (logits.scalar_type()) {
          case at::kFloat:
            bad = !walk_sampling(logits.const_data_ptr<float>(), row_stride, L, b, rule, sin, stats, sc, &node, &nxt);
            break;
          case at::kBFloat16:
            bad = !walk_sampling(logits.const_data_ptr<c10::BFloat16>(), row_stride, L, b, rule, sin, stats, sc,
                                 &node, &nxt);
            break;
          default:
            bad = !walk_sampling(logits.const_data_ptr<c10::Half>(), row_stride, L, b, rule, sin, stats, sc, &node,
                                 &nxt);
        }
      } else if (!bad) {
        node = walk_deterministic(L, b, rule, params + 2 * b, roots, min_accept, stats, csr_logit, csr_rank, ok);
        nxt = stats[row0 + node + 1].argmax;
      }
      if (bad) {
        out_len[b] = -1;
        out_next[b] = -1;
        continue;
      }
      path.clear();
      for (int64_t j = node; j >= 0; j = L.parents[lo + j]) path.push_back(j);
      out_len[b] = int32_t(path.size());
      for (size_t i = 0; i < path.size() && int64_t(i) < max_depth; ++i)  // the path's first max_depth nodes
        out_acc[b * max_depth + i] = int32_t(path[path.size() - 1 - i]);
      out_next[b] = nxt;
    }
  });
  return {accept_len, accepted, next_token};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("verify", &verify_cpu);
}
