// CPU kernels of the tree ops (schemas: csrc/tree.cpp; arithmetic: csrc/tree.h; reference:
// fastverify/reference/tree.py and attention.py). Parallel over requests, rows or (request, head) planes
// with at::parallel_for; every binding checks its inputs so that no index is read out of bounds.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "tree.h"

namespace {

using namespace fastverify::tree;

void check_cpu_int32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, ": expected int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, ": expected ", dim, "-D, got shape ", t.sizes());
}

// Checks the batch layout (cu_nodes offsets, parents precede children) and returns B. n, if >= 0, must be at
// least every request's node count.
int64_t check_tree(const at::Tensor& parents, const at::Tensor& cu_nodes, int64_t n) {
  check_cpu_int32(parents, "parents", 1);
  check_cpu_int32(cu_nodes, "cu_nodes", 1);
  TORCH_CHECK(cu_nodes.numel() >= 1, "cu_nodes: expected B + 1 >= 1 offsets");
  TORCH_CHECK(parents.is_contiguous() && cu_nodes.is_contiguous(), "parents, cu_nodes: expected contiguous");
  const int64_t B = cu_nodes.numel() - 1, N = parents.numel();
  const int32_t* cu = cu_nodes.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0, "cu_nodes: must start at 0, got ", cu[0]);
  TORCH_CHECK(cu[B] == N, "cu_nodes: last offset ", cu[B], " must equal the number of nodes ", N);
  // every offset first (non-decreasing from 0 to N: each within [0, N]), so that no request's nodes are read past
  // the end of parents
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(cu[b + 1] >= cu[b], "cu_nodes: offsets must be non-decreasing (request ", b, ")");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = int64_t(cu[b + 1]) - cu[b];
    TORCH_CHECK(n < 0 || nb <= n, "n: request ", b, " has ", nb, " nodes, more than n = ", n);
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t p = par[cu[b] + j];
      TORCH_CHECK(p >= -1 && p < j, "parents: node ", j, " of request ", b, " has parent ", p,
                  " (expected -1 or a preceding local node index)");
    }
  }
  return B;
}

void check_prefix(const at::Tensor& prefix_len, int64_t B, int64_t P) {
  check_cpu_int32(prefix_len, "prefix_len", 1);
  TORCH_CHECK(prefix_len.numel() == B, "prefix_len: expected ", B, " entries, got ", prefix_len.numel());
  TORCH_CHECK(prefix_len.is_contiguous(), "prefix_len: expected contiguous");
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pl[b] >= 0 && pl[b] <= P, "prefix_len: entry ", b, " = ", pl[b], " not in [0, P = ", P, "]");
}

template <typename T>
void fill_dense(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len, int64_t n,
                int64_t P, T yes, T no, T* out) {
  const int64_t B = cu_nodes.numel() - 1, rowlen = P + n;
  const int32_t* cu = cu_nodes.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  // Rows are independent. Waking threads costs more than writing a small mask, so each task writes at least
  // ~256 KB: small masks are built on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, rowlen * int64_t(sizeof(T))));
  at::parallel_for(0, B * n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = r / n, i = r % n;
      dense_row<T>(par + cu[b], int64_t(cu[b + 1]) - cu[b], pl[b], P, n, i, yes, no, out + r * rowlen);
    }
  });
}

at::Tensor tree_mask_bool_cpu(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len,
                              int64_t n, int64_t P) {
  TORCH_CHECK(n >= 0 && P >= 0, "n, P: expected >= 0, got ", n, ", ", P);
  const int64_t B = check_tree(parents, cu_nodes, n);
  check_prefix(prefix_len, B, P);
  auto out = at::empty({B, n, P + n}, parents.options().dtype(at::kBool));
  if (out.numel()) fill_dense<bool>(parents, cu_nodes, prefix_len, n, P, true, false, out.data_ptr<bool>());
  return out;
}

at::Tensor tree_mask_additive_cpu(const at::Tensor& parents, const at::Tensor& cu_nodes,
                                  const at::Tensor& prefix_len, int64_t n, int64_t P, at::ScalarType dtype) {
  TORCH_CHECK(n >= 0 && P >= 0, "n, P: expected >= 0, got ", n, ", ", P);
  TORCH_CHECK(at::isFloatingType(dtype), "dtype: the additive mask needs a floating dtype, got ", dtype);
  const int64_t B = check_tree(parents, cu_nodes, n);
  check_prefix(prefix_len, B, P);
  auto out = at::empty({B, 1, n, P + n}, parents.options().dtype(dtype));
  if (!out.numel()) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "tree_mask_additive", [&] {
    fill_dense<scalar_t>(parents, cu_nodes, prefix_len, n, P, scalar_t(0.f),
                         scalar_t(-std::numeric_limits<float>::infinity()), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor tree_mask_packed_cpu(const at::Tensor& parents, const at::Tensor& cu_nodes, int64_t n) {
  TORCH_CHECK(n >= 0, "n: expected >= 0, got ", n);
  const int64_t B = check_tree(parents, cu_nodes, n);
  const int64_t W = (n + 31) / 32;
  auto out = at::empty({B, n, W}, parents.options());
  if (!out.numel()) return out;
  const int32_t* cu = cu_nodes.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  auto* words = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, n * W));  // words per task
  at::parallel_for(0, B, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) packed_rows(par + cu[b], int64_t(cu[b + 1]) - cu[b], n, W, words + b * n * W);
  });
  return out;
}

at::Tensor tree_positions_cpu(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len) {
  const int64_t B = check_tree(parents, cu_nodes, -1);
  check_prefix(prefix_len, B, std::numeric_limits<int32_t>::max());
  auto out = at::empty({parents.numel()}, parents.options().dtype(at::kLong));
  const int32_t* cu = cu_nodes.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t per_request = std::max<int64_t>(1, parents.numel() / std::max<int64_t>(1, B));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / per_request);
  at::parallel_for(0, B, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) positions(par + cu[b], int64_t(cu[b + 1]) - cu[b], pl[b], o + cu[b]);
  });
  return out;
}

// Tree attention through the masked-attention kernel (csrc/attention.h). One task per (request, kv head, block of up
// to kBlockRows query rows of its group), over the request's used keys alone: its prefix [0, prefix_len) and the
// draft keys [P, P + n). The unused slots [prefix_len, P) are the kernel's gap, never read (a preallocated cache may
// hold anything there) and costing nothing. The block's additive mask rows are made from the packed bits: 0 for the
// prefix and for the draft keys a row's bits set, -inf for the rest; a row that sees no key gives zeros, as the
// reference. bfloat16 / float16 keys and values are converted to float32 a (request, kv head) plane at a time into
// the thread's scratch (the tasks of one plane are consecutive, so a plane is converted about once per thread); the
// arithmetic is float32, the output rounded once. Scratch per thread: kBlockRows rows of S scores and mask values,
// and for half precision a plane's used keys and values as float; never an [n, P + n] mask.
template <typename T>
void tree_attention_masked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int32_t* bits,
                           const int32_t* pl, int64_t W, float scale, at::Tensor& out) {
  constexpr int64_t kBlockRows = 16;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t P = S - n, G = Hq / Hkv, rows = G * n, blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor kc = k, vc = v;  // each key's D values contiguous, as the kernel reads them
  if (k.stride(2) != D) kc = k.contiguous();
  if (v.stride(2) != D) vc = v.contiguous();
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // The tasks in order (request, kv head, block), split into one contiguous range per thread of about equal keys
  // (a request's tasks cost its used keys): a short prefix's tasks are cheap. One thread for small calls.
  const int64_t tasks = B * Hkv * blocks;
  std::vector<int64_t> keys(B + 1, 0);  // keys[b]: the used keys of the requests before b, per task
  for (int64_t b = 0; b < B; ++b) keys[b + 1] = keys[b] + pl[b] + n;
  const int64_t parts = kBlockRows * D * 2 * Hkv * blocks * keys[B] >= (int64_t(1) << 18)
                            ? std::min<int64_t>(tasks, at::get_num_threads()) : 1;
  const auto task_at = [&](int64_t part) {  // the first task of a part
    const int64_t goal = keys[B] * part / parts;
    const int64_t b = std::upper_bound(keys.begin(), keys.end(), goal) - keys.begin() - 1;
    if (b >= B) return tasks;
    const int64_t per_task = std::max<int64_t>(keys[b + 1] - keys[b], 1);
    return std::min(tasks, b * Hkv * blocks + (goal - keys[b]) * Hkv * blocks / per_task);
  };
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    const int64_t t0 = task_at(p0), t1 = task_at(p1);
    std::vector<float> qrows(kBlockRows * D), scores(kBlockRows * S), masks(kBlockRows * S), orows(kBlockRows * D);
    std::unique_ptr<float[]> kf(kFloat ? nullptr : new float[S * D]);  // a plane's used keys and values, as float
    std::unique_ptr<float[]> vf(kFloat ? nullptr : new float[S * D]);
    int64_t converted = -1;  // the plane kf / vf hold
    const float* mrows[kBlockRows];
    bool sees[kBlockRows];
    int64_t dst[kBlockRows];  // each row's offset in out (contiguous [B, Hq, n, D])
    const float neg = -std::numeric_limits<float>::infinity();
    const auto to_float = [](T x) { return static_cast<float>(x); };
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hkv * blocks), h = (t / blocks) % Hkv, r0 = (t % blocks) * kBlockRows;
      const int64_t R = std::min(kBlockRows, rows - r0), plen = pl[b], used = plen + n;
      const T* kh = kp + b * kc.stride(0) + h * kc.stride(1);
      const T* vh = vp + b * vc.stride(0) + h * vc.stride(1);
      const float *kr, *vr;
      int64_t gap;  // the unused slots between the prefix and the draft keys (0: the used keys side by side)
      if constexpr (kFloat) {
        kr = kh, vr = vh, gap = P - plen;
      } else {
        if (converted != b * Hkv + h) {
          std::transform(kh, kh + plen * D, kf.get(), to_float);
          std::transform(kh + P * D, kh + S * D, kf.get() + plen * D, to_float);
          std::transform(vh, vh + plen * D, vf.get(), to_float);
          std::transform(vh + P * D, vh + S * D, vf.get() + plen * D, to_float);
          converted = b * Hkv + h;
        }
        kr = kf.get(), vr = vf.get(), gap = 0;
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t hq = h * G + (r0 + r) / n, i = (r0 + r) % n;
        const T* src = qp + b * q.stride(0) + hq * q.stride(1) + i * q.stride(2);
        std::transform(src, src + D, qrows.data() + r * D, to_float);
        dst[r] = ((b * Hq + hq) * n + i) * D;
        float* m = masks.data() + r * used;
        std::fill(m, m + plen, 0.f);
        const int32_t* word = bits + (b * n + i) * W;
        bool any = plen > 0;
        for (int64_t j = 0; j < n; ++j) {
          const bool on = (uint32_t(word[j >> 5]) >> (j & 31)) & 1u;
          m[plen + j] = on ? 0.f : neg;
          any |= on;
        }
        mrows[r] = m;
        sees[r] = any;
      }
      fastverify::attention::group(qrows.data(), R, D, kr, vr, D, used, mrows, scale, scores.data(), orows.data(),
                                   0.f, nullptr, plen, gap);
      for (int64_t r = 0; r < R; ++r) {
        if (sees[r]) std::transform(orows.data() + r * D, orows.data() + (r + 1) * D, op + dst[r],
                                    [](float x) { return static_cast<T>(x); });
        else std::fill(op + dst[r], op + dst[r] + D, T(0.f));
      }
    }
  });
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& packed_mask, const at::Tensor& prefix_len, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "q, k, v: expected CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: expected 4-D tensors");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "q: expected fp32, bf16 or fp16, got ",
              st);
  TORCH_CHECK(k.scalar_type() == st && v.scalar_type() == st, "k, v: expected q's dtype ", st);
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes(), "v: expected k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, "k: expected [B, Hkv, P + n, D] matching q, got ", k.sizes());
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "k: query heads ", Hq, " must be a multiple of kv heads ", Hkv);
  TORCH_CHECK(S >= n, "k: expected at least n = ", n, " key slots, got ", S);
  const int64_t W = (n + 31) / 32, P = S - n;
  check_cpu_int32(packed_mask, "packed_mask", 3);
  TORCH_CHECK(packed_mask.size(0) == B && packed_mask.size(1) == n && packed_mask.size(2) == W,
              "packed_mask: expected [B, n, ceil(n / 32)] = [", B, ", ", n, ", ", W, "], got ", packed_mask.sizes());
  check_prefix(prefix_len, B, P);
  auto out = at::empty({B, Hq, n, D}, q.options());
  if (!out.numel()) return out;
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "q, k, v: expected a unit stride in the head dimension");
  const auto mask = packed_mask.contiguous();
  const int32_t* bits = mask.data_ptr<int32_t>();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  if (st == at::kFloat) tree_attention_masked<float>(q, k, v, bits, pl, W, float(scale), out);
  else if (st == at::kBFloat16) tree_attention_masked<at::BFloat16>(q, k, v, bits, pl, W, float(scale), out);
  else tree_attention_masked<at::Half>(q, k, v, bits, pl, W, float(scale), out);
  return out;
}

// compact_cache's arguments checked against B requests of S slots; returns the source slot of each move
// (request b's i-th at [b * max_depth + i]), so that the planes below only copy.
std::vector<int64_t> compact_sources(const at::Tensor& prefix_len, int64_t draft_start, const at::Tensor& acc,
                                     const at::Tensor& alen, int64_t B, int64_t S) {
  check_cpu_int32(acc, "accepted", 2);
  check_cpu_int32(alen, "accept_len", 1);
  TORCH_CHECK(acc.size(0) == B, "accepted: expected [B = ", B, ", max_depth], got ", acc.sizes());
  TORCH_CHECK(alen.numel() == B, "accept_len: expected ", B, " entries, got ", alen.numel());
  check_prefix(prefix_len, B, S);
  TORCH_CHECK(draft_start >= 0, "draft_start: expected >= 0, got ", draft_start);
  const int64_t depth = acc.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const int32_t* lp = alen.data_ptr<int32_t>();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  std::vector<int64_t> src(std::max<int64_t>(1, B * depth));
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= depth, "accept_len: entry ", b, " = ", lp[b], " not in [0, ", depth, "]");
    TORCH_CHECK(int64_t(pl[b]) + lp[b] <= S, "prefix_len: request ", b, ": prefix_len + accept_len = ",
                int64_t(pl[b]) + lp[b], " exceeds the ", S, " cache slots");
    for (int64_t i = 0; i < lp[b]; ++i) {
      const int64_t a = ap[b * depth + i];
      TORCH_CHECK(a >= 0 && draft_start + a < S, "accepted: request ", b, " entry ", i, " = ", a,
                  " puts the source slot draft_start + accepted outside [0, ", S, ")");
      src[b * depth + i] = draft_start + a;
    }
  }
  return src;
}

// The moves of compact_sources in one tensor [B, H, S, D]: parallel over (request, head), inline when small.
void compact_tensor(at::Tensor& t, const std::vector<int64_t>& src, const int32_t* lp, const int32_t* pl,
                    int64_t depth) {
  const int64_t B = t.size(0), H = t.size(1), D = t.size(3), es = t.element_size();
  if (t.numel() == 0) return;
  char* base = static_cast<char*>(t.data_ptr());
  const int64_t sb = t.stride(0) * es, sh = t.stride(1) * es, ss = t.stride(2) * es, sd = t.stride(3) * es;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, depth * D * es));
  at::parallel_for(0, B * H, grain, [&](int64_t lo, int64_t hi) {
    std::vector<char> buf(std::max<int64_t>(1, depth * D * es));
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t b = p / H, h = p % H;
      compact_plane(base + b * sb + h * sh, ss, sd, D, es, src.data() + b * depth, lp[b], pl[b], buf.data());
    }
  });
}

void check_cache_pair(const at::Tensor& k, const at::Tensor& v, int64_t B, int64_t S, const char* where,
                      int64_t layer) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), where, ": expected CPU tensors (layer ", layer, ")");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, where, ": expected [B, H, S, D] tensors, got ", k.sizes(), " and ",
              v.sizes(), " (layer ", layer, ")");
  TORCH_CHECK(k.size(0) == B && k.size(2) == S && v.size(0) == B && v.size(2) == S, where, ": expected batch ", B,
              " and ", S, " slots, got ", k.sizes(), " and ", v.sizes(), " (layer ", layer, ")");
}

// compact_cache over every layer of a cache in one call: the arguments checked once, each layer's k and v moved.
void compact_cache_layers_cpu(at::TensorList k, at::TensorList v, const at::Tensor& prefix_len, int64_t draft_start,
                              const at::Tensor& accepted, const at::Tensor& accept_len) {
  TORCH_CHECK(k.size() == v.size(), "k, v: expected as many value tensors as key tensors, got ", k.size(), " and ",
              v.size());
  if (k.empty()) return;
  TORCH_CHECK(k[0].dim() == 4, "k[0]: expected a [B, H, S, D] tensor, got ", k[0].sizes());
  const int64_t B = k[0].size(0), S = k[0].size(2);
  for (size_t i = 0; i < k.size(); ++i) check_cache_pair(k[i], v[i], B, S, "k, v", static_cast<int64_t>(i));
  const auto acc = accepted.contiguous(), alen = accept_len.contiguous();
  const auto src = compact_sources(prefix_len, draft_start, acc, alen, B, S);
  for (size_t i = 0; i < k.size(); ++i) {
    for (at::Tensor t : {k[i], v[i]})
      compact_tensor(t, src, alen.data_ptr<int32_t>(), prefix_len.data_ptr<int32_t>(), acc.size(1));
  }
}

// compact_cache: the one layer (k, v).
void compact_cache_cpu(at::Tensor& k, at::Tensor& v, const at::Tensor& prefix_len, int64_t draft_start,
                       const at::Tensor& accepted, const at::Tensor& accept_len) {
  compact_cache_layers_cpu({k}, {v}, prefix_len, draft_start, accepted, accept_len);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CPU, m) {
  m.impl("tree_mask_bool", &tree_mask_bool_cpu);
  m.impl("tree_mask_additive", &tree_mask_additive_cpu);
  m.impl("tree_mask_packed", &tree_mask_packed_cpu);
  m.impl("tree_positions", &tree_positions_cpu);
  m.impl("tree_attention", &tree_attention_cpu);
  m.impl("compact_cache", &compact_cache_cpu);
  m.impl("compact_cache_layers", &compact_cache_layers_cpu);
}
