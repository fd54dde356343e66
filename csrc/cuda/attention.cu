// CUDA kernel of fastverify::tree_attention (schema: csrc/tree.cpp; reference: fastverify/reference/attention.py).
//
// Flash-style (Dao et al.): one CTA per (request b, query head h, tile of kQueriesPerCta draft queries); the CTA
// streams the keys it may need in tiles of 32 through shared memory (as float) and keeps, per query, a running
// max, a running sum and a float32 output accumulator (online softmax), so the [n, P + n] mask and score matrix
// never exist in memory. The packed mask is read inside the kernel: a draft key tile of 32 keys is exactly one
// 32-bit word of a query's mask row. Prefix keys [0, prefix_len[b]) are visible to every query, prefix slots
// [prefix_len[b], P) are skipped. GQA: query head h reads kv head h / (Hq / Hkv).
//
// Work split inside the CTA: 4 warps, each owning kQueriesPerWarp queries; lane l scores key l of the tile for
// each of its warp's queries, then owns output dims l, l + 32, ... when accumulating p * V. A query that sees no
// key at all gets 0 (as the reference). Head dims up to 128 (instances with 64- and 128-wide tiles); larger head
// dims are rejected with an error naming q.
#include <torch/library.h>

#include "common.cuh"

namespace fastverify {
namespace cuda {

constexpr int kAttnWarps = 4;
constexpr int kQueriesPerWarp = 4;
constexpr int kQueriesPerCta = kAttnWarps * kQueriesPerWarp;
constexpr int kKeyTile = 32;

// q [B, Hq, n, D], k / v [B, Hkv, S, D] (S = P + n), out [B, Hq, n, D]; strides in elements, last dim contiguous.
struct AttnParams {
  int B, Hq, Hkv, n, P, S, D;
  int64_t q_sb, q_sh, q_sn;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t o_sb, o_sh, o_sn;
  int W;  // words per packed mask row, ceil(n / 32)
  float scale;
};

// DMAX (64 or 128) sizes the shared tiles and the per-lane accumulators; any head dim D <= DMAX runs in it, the
// dims past D held at zero.
template <typename T, int DMAX>
__global__ void __launch_bounds__(kAttnWarps * 32)
    _tree_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const int32_t* __restrict__ packed_mask, const int32_t* __restrict__ prefix_len,
                           T* __restrict__ out, AttnParams p) {
  static_assert(DMAX % 32 == 0, "DMAX must be a multiple of 32");
  constexpr int kDimsPerLane = DMAX / 32;
  const int D = p.D;
  // +1 column of padding: lane l reads row l of the key tile, so rows must not share banks.
  __shared__ float sK[kKeyTile][DMAX + 1];
  __shared__ float sV[kKeyTile][DMAX];
  __shared__ float sQ[kQueriesPerCta][DMAX];

  const int tiles_per_head = (p.n + kQueriesPerCta - 1) / kQueriesPerCta;
  const int tile = blockIdx.x % tiles_per_head;
  const int h = (blockIdx.x / tiles_per_head) % p.Hq;
  const int b = blockIdx.x / (tiles_per_head * p.Hq);
  const int hkv = h / (p.Hq / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = tile * kQueriesPerCta;

  // Queries of this CTA in fp32, zero for rows past n and dims past D.
  for (int idx = threadIdx.x; idx < kQueriesPerCta * DMAX; idx += blockDim.x) {
    const int qi = idx / DMAX, d = idx % DMAX;
    const int i = q0 + qi;
    float val = 0.0f;
    if (i < p.n && d < D) val = load_as_float(q + b * p.q_sb + h * p.q_sh + i * p.q_sn + d);
    sQ[qi][d] = val;
  }

  float m[kQueriesPerWarp], l[kQueriesPerWarp], acc[kQueriesPerWarp][kDimsPerLane];
#pragma unroll
  for (int a = 0; a < kQueriesPerWarp; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.0f;
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) acc[a][e] = 0.0f;
  }

  int plen = prefix_len[b];
  if (plen > p.P) plen = p.P;
  if (plen < 0) plen = 0;
  const int prefix_tiles = (plen + kKeyTile - 1) / kKeyTile;
  const int draft_tiles = (p.n + kKeyTile - 1) / kKeyTile;
  const T* kb = k + b * p.k_sb + hkv * p.k_sh;
  const T* vb = v + b * p.v_sb + hkv * p.v_sh;

  for (int t = 0; t < prefix_tiles + draft_tiles; ++t) {
    const bool is_prefix = t < prefix_tiles;
    // key slot of column 0 of this tile, and how many of its 32 columns exist
    const int key0 = is_prefix ? t * kKeyTile : p.P + (t - prefix_tiles) * kKeyTile;
    const int valid = is_prefix ? min(kKeyTile, plen - key0) : min(kKeyTile, p.n - (key0 - p.P));

    __syncthreads();  // previous tile fully consumed (and sQ written, on the first pass)
    for (int idx = threadIdx.x; idx < kKeyTile * DMAX; idx += blockDim.x) {
      const int j = idx / DMAX, d = idx % DMAX;
      float kv = 0.0f, vv = 0.0f;
      if (j < valid && d < D) {
        kv = load_as_float(kb + static_cast<int64_t>(key0 + j) * p.k_ss + d);
        vv = load_as_float(vb + static_cast<int64_t>(key0 + j) * p.v_ss + d);
      }
      sK[j][d] = kv;
      sV[j][d] = vv;
    }
    __syncthreads();

#pragma unroll
    for (int a = 0; a < kQueriesPerWarp; ++a) {
      const int qi = warp * kQueriesPerWarp + a;
      const int i = q0 + qi;
      if (i >= p.n) continue;  // warp-uniform
      bool visible = lane < valid;
      if (!is_prefix && visible) {
        const int word_idx = (key0 - p.P) / kKeyTile;
        const uint32_t word =
            static_cast<uint32_t>(packed_mask[(static_cast<int64_t>(b) * p.n + i) * p.W + word_idx]);
        visible = (word >> lane) & 1u;
      }
      float s = -INFINITY;
      if (visible) {
        float dot = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot = fmaf(sQ[qi][d], sK[lane][d], dot);
        s = dot * p.scale;
      }
      const float tile_max = warp_max(s);
      if (tile_max == -INFINITY) continue;  // nothing visible in this tile for this query (warp-uniform)
      const float m_new = fmaxf(m[a], tile_max);
      const float alpha = expf(m[a] - m_new);  // m[a] = -inf on the first visible tile: alpha = 0
      const float prob = visible ? expf(s - m_new) : 0.0f;
      l[a] = l[a] * alpha + warp_sum(prob);
      m[a] = m_new;
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) acc[a][e] *= alpha;
      for (int j = 0; j < valid; ++j) {
        const float pj = __shfl_sync(0xffffffffu, prob, j);
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e) acc[a][e] = fmaf(pj, sV[j][lane + 32 * e], acc[a][e]);
      }
    }
  }

#pragma unroll
  for (int a = 0; a < kQueriesPerWarp; ++a) {
    const int i = q0 + warp * kQueriesPerWarp + a;
    if (i >= p.n) continue;
    const float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
    T* o = out + b * p.o_sb + h * p.o_sh + i * p.o_sn;
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e)
      if (lane + 32 * e < D) o[lane + 32 * e] = store_from_float<T>(acc[a][e] * inv);
  }
}

namespace {

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& packed_mask, const at::Tensor& prefix_len, double scale) {
  check_cuda(q_in, "q");
  check_cuda(k_in, "k");
  check_cuda(v_in, "v");
  check_cuda(packed_mask, "packed_mask");
  check_cuda(prefix_len, "prefix_len");
  check_same_device(k_in, q_in, "k", "q");
  check_same_device(v_in, q_in, "v", "q");
  check_same_device(packed_mask, q_in, "packed_mask", "q");
  check_same_device(prefix_len, q_in, "prefix_len", "q");
  check_dim(q_in, 4, "q");
  check_dim(k_in, 4, "k");
  check_dim(v_in, 4, "v");
  check_logits_dtype(q_in, "q");
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type(), "k: expected the dtype of q (", q_in.scalar_type(), "), got ",
              k_in.scalar_type());
  TORCH_CHECK(v_in.scalar_type() == q_in.scalar_type(), "v: expected the dtype of q (", q_in.scalar_type(), "), got ",
              v_in.scalar_type());
  const int64_t B = q_in.size(0), Hq = q_in.size(1), n = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), S = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == B && k_in.size(3) == D, "k: expected shape [", B, ", Hkv, P + n, ", D, "], got ",
              k_in.sizes());
  TORCH_CHECK(v_in.sizes() == k_in.sizes(), "v: expected the shape of k ", k_in.sizes(), ", got ", v_in.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "k: query heads (", Hq, ") must be a multiple of key/value heads (", Hkv, ")");
  TORCH_CHECK(S >= n, "k: expected at least n = ", n, " key slots (P + n), got ", S);
  TORCH_CHECK(D >= 1 && D <= 128, "q: the CUDA tree_attention supports head dims 1..128, got ", D);
  const int64_t W = (n + 31) / 32;
  check_dtype(packed_mask, at::kInt, "packed_mask");
  TORCH_CHECK(packed_mask.dim() == 3 && packed_mask.size(0) == B && packed_mask.size(1) == n &&
                  packed_mask.size(2) == W,
              "packed_mask: expected shape [", B, ", ", n, ", ", W, "], got ", packed_mask.sizes());
  check_dtype(prefix_len, at::kInt, "prefix_len");
  TORCH_CHECK(prefix_len.dim() == 1 && prefix_len.size(0) == B, "prefix_len: expected shape [", B, "], got ",
              prefix_len.sizes());
  TORCH_CHECK(B * Hq * ((n + kQueriesPerCta - 1) / kQueriesPerCta) <= INT32_MAX, "q: too many query tiles");

  const c10::cuda::CUDAGuard guard(q_in.device());
  // Only the last dim must be contiguous; other strides are passed to the kernel.
  auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  auto k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  auto v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  auto mask = packed_mask.contiguous();
  auto pre = prefix_len.contiguous();
  auto out = at::empty({B, Hq, n, D}, q.options());
  if (out.numel() == 0) return out;

  AttnParams p;
  p.B = static_cast<int>(B);
  p.Hq = static_cast<int>(Hq);
  p.Hkv = static_cast<int>(Hkv);
  p.n = static_cast<int>(n);
  p.S = static_cast<int>(S);
  p.P = static_cast<int>(S - n);
  p.D = static_cast<int>(D);
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sn = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_sn = out.stride(2);
  p.W = static_cast<int>(W);
  p.scale = static_cast<float>(scale);

  const unsigned grid = static_cast<unsigned>(B * Hq * ((n + kQueriesPerCta - 1) / kQueriesPerCta));
  auto stream = at::cuda::getCurrentCUDAStream();
  FASTVERIFY_DISPATCH_FLOATING(q.scalar_type(), "q", [&] {
    const auto* qp = reinterpret_cast<const scalar_t*>(q.data_ptr());
    const auto* kp = reinterpret_cast<const scalar_t*>(k.data_ptr());
    const auto* vp = reinterpret_cast<const scalar_t*>(v.data_ptr());
    auto* op = reinterpret_cast<scalar_t*>(out.data_ptr());
    if (D <= 64) {
      _tree_attention_kernel<scalar_t, 64><<<grid, kAttnWarps * 32, 0, stream>>>(
          qp, kp, vp, mask.data_ptr<int32_t>(), pre.data_ptr<int32_t>(), op, p);
    } else {
      _tree_attention_kernel<scalar_t, 128><<<grid, kAttnWarps * 32, 0, stream>>>(
          qp, kp, vp, mask.data_ptr<int32_t>(), pre.data_ptr<int32_t>(), op, p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace cuda
}  // namespace fastverify
