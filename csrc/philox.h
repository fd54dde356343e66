// Philox 4x32-10 counter-based random numbers (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy
// as 1, 2, 3", SC'11), bit-identical to Random123's philox4x32_10 and to fastverify.reference.sampling.
// Framework-free and usable from host C++ and CUDA device code.
//
// fastverify keys the generator by (seed, absolute sequence position, stream) so that a request's random stream
// does not depend on the batch, the drafter or the device (csrc/sampling.cpp has the schema):
//   key = (seed low 32 bits, seed high 32 bits), counter = (position low, position high, stream, 0),
//   u = ((word0 >> 9) + 0.5) * 2^-23, exact in float32 (24 significant bits), in [2^-24, 1 - 2^-24].
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FV_PHILOX_HD __host__ __device__ __forceinline__
#else
#define FV_PHILOX_HD inline
#endif

namespace fastverify {

struct Philox4x32 {
  uint32_t v[4];
};

FV_PHILOX_HD void philox_mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// The Philox 4x32 block function with 10 rounds (Random123's default and the one its test vectors use).
FV_PHILOX_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key schedule (golden ratio, sqrt(3) - 1)
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo32(kM0, ctr.v[0], &hi0, &lo0);
    philox_mulhilo32(kM1, ctr.v[2], &hi1, &lo1);
    const Philox4x32 next = {{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    ctr = next;
  }
  return ctr;
}

// Maps a 32-bit word to ((x >> 9) + 0.5) * 2^-23: x >> 9 < 2^23, so (x >> 9) + 0.5 needs at most 24 significant
// bits and every step is exact in float32. The result lies in [2^-24, 1 - 2^-24]: never 0, never 1 (with 24 bits
// kept, (x >> 8) + 0.5 would need 25 and round to 1.0 at the top).
FV_PHILOX_HD float philox_word_to_unit(uint32_t x) {
  return (static_cast<float>(x >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
}

// The uniform of fastverify.uniform(seed, position, stream).
FV_PHILOX_HD float philox_uniform(int64_t seed, int64_t position, uint32_t stream) {
  const uint64_t s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  const Philox4x32 ctr = {{static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32), stream, 0u}};
  const Philox4x32 out = philox4x32_10(ctr, static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return philox_word_to_unit(out.v[0]);
}

}  // namespace fastverify
