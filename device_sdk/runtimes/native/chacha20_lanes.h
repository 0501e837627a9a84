// ChaCha20 on 16 lanes at once (16 blocks side by side) with GCC/Clang vector extensions, shared by the float
// noise (gaussian_noise.cpp, which turns the lanes into normals in registers) and the keystream buffer
// (chacha20.cpp). Callers mark their outer function SPLITFACE_CLONES: AVX-512, AVX2 or SSE2 picked at run time
// on x86 (target_clones), NEON on arm64 at build time; these always_inline helpers compile into each clone.
// Included only by .cpp files built with -Wno-psabi (the vector types are 64 bytes by design).
#pragma once

#include <cstdint>

#include "chacha20.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPLITFACE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPLITFACE_CLONES
#endif

namespace splitface {
namespace lanes {

constexpr int kRounds = 20;  // ChaCha20

// 16 lanes as one value: the compiler maps it onto AVX-512, AVX2 or NEON.
typedef uint32_t u32v __attribute__((vector_size(4 * kChachaLanes)));

__attribute__((always_inline)) inline u32v rotl(u32v v, int c) { return (v << c) | (v >> (32 - c)); }

__attribute__((always_inline)) inline void quarter(u32v& a, u32v& b, u32v& c, u32v& d) {
  a += b; d = rotl(d ^ a, 16);
  c += d; b = rotl(b ^ c, 12);
  a += b; d = rotl(d ^ a, 8);
  c += d; b = rotl(b ^ c, 7);
}

// x[j][l] = word j of keystream block `block + l`.
__attribute__((always_inline)) inline void chacha20_lanes(const NoiseKey& key, uint64_t block, u32v x[16]) {
  const uint32_t in[12] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                           key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7]};
  u32v lo, hi;
  for (int l = 0; l < kChachaLanes; ++l) {
    uint64_t b = block + static_cast<uint64_t>(l);
    lo[l] = static_cast<uint32_t>(b);
    hi[l] = static_cast<uint32_t>(b >> 32);
  }
  // the state as 16 named values, not an array, so that it stays in registers through the rounds
  u32v x0 = u32v{} + in[0], x1 = u32v{} + in[1], x2 = u32v{} + in[2], x3 = u32v{} + in[3];
  u32v x4 = u32v{} + in[4], x5 = u32v{} + in[5], x6 = u32v{} + in[6], x7 = u32v{} + in[7];
  u32v x8 = u32v{} + in[8], x9 = u32v{} + in[9], x10 = u32v{} + in[10], x11 = u32v{} + in[11];
  u32v x12 = lo, x13 = hi, x14 = u32v{}, x15 = u32v{};
  for (int round = 0; round < kRounds / 2; ++round) {  // column + diagonal double rounds
    quarter(x0, x4, x8, x12); quarter(x1, x5, x9, x13); quarter(x2, x6, x10, x14); quarter(x3, x7, x11, x15);
    quarter(x0, x5, x10, x15); quarter(x1, x6, x11, x12); quarter(x2, x7, x8, x13); quarter(x3, x4, x9, x14);
  }
  x[0] = x0 + in[0]; x[1] = x1 + in[1]; x[2] = x2 + in[2]; x[3] = x3 + in[3];
  x[4] = x4 + in[4]; x[5] = x5 + in[5]; x[6] = x6 + in[6]; x[7] = x7 + in[7];
  x[8] = x8 + in[8]; x[9] = x9 + in[9]; x[10] = x10 + in[10]; x[11] = x11 + in[11];
  x[12] = x12 + lo; x[13] = x13 + hi; x[14] = x14; x[15] = x15;
}

}  // namespace lanes
}  // namespace splitface
