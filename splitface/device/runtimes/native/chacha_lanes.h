// ChaCha on W lanes at once (W blocks side by side) with GCC/Clang vector extensions, shared by the float noise
// (gaussian_noise.cpp: ChaCha8, its lanes turned into normals in registers) and the exact noise's keystream buffer
// (chacha20.cpp: ChaCha20). The rounds are a template parameter; everything else is RFC 8439's block function.
//
// The lane width follows the register file, because ChaCha's state is 16 vectors that must stay in registers
// through the rounds: with W lanes of 32 bits a vector is 4W bytes, and 16 of them fit
//   AVX-512 (32 zmm of 64 bytes) at W = 16, AVX2 (16 ymm of 32 bytes) at W = 8, SSE2 (16 xmm) and NEON (32 q of
//   16 bytes) at W = 4.
// A 16-lane state on AVX2 needs 32 ymm registers, twice what there is: GCC spilled it to the stack on every round
// and drawing ran 4-7x slower than on AVX-512 (docs/device.md). Callers write each ISA's function once as a
// template over W and pick it with SPLITFACE_ISA_VERSIONS (isa_versions.h); the output of 16 blocks (kChachaLanes) is the
// same whatever W computed it.
// Included only by .cpp files built with -Wno-psabi (the vector types are up to 64 bytes wide by design).
#pragma once

#include <cstdint>

#include "chacha20.h"
#include "isa_versions.h"

namespace splitface {
namespace lanes {

// W lanes as one value: the compiler maps it onto one AVX-512, AVX2, SSE2 or NEON register.
template <int W>
struct Vec {
  typedef uint32_t u32 __attribute__((vector_size(4 * W)));
  typedef int32_t i32 __attribute__((vector_size(4 * W)));
  typedef float f32 __attribute__((vector_size(4 * W)));
};

template <typename V>
__attribute__((always_inline)) inline V rotl(V v, int c) { return (v << c) | (v >> (32 - c)); }

template <typename V>
__attribute__((always_inline)) inline void quarter(V& a, V& b, V& c, V& d) {
  a += b; d = rotl(d ^ a, 16);
  c += d; b = rotl(b ^ c, 12);
  a += b; d = rotl(d ^ a, 8);
  c += d; b = rotl(b ^ c, 7);
}

// x[j][l] = word j of keystream block `block + l`, l < W, after `Rounds` rounds (20: RFC 8439's ChaCha20).
template <int W, int Rounds>
__attribute__((always_inline)) inline void chacha_lanes(const NoiseKey& key, uint64_t block, typename Vec<W>::u32 x[16]) {
  static_assert(Rounds % 2 == 0, "ChaCha's rounds come in column + diagonal pairs");
  using V = typename Vec<W>::u32;
  const uint32_t in[12] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                           key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7]};
  V lo, hi;
  for (int l = 0; l < W; ++l) {
    uint64_t b = block + static_cast<uint64_t>(l);
    lo[l] = static_cast<uint32_t>(b);
    hi[l] = static_cast<uint32_t>(b >> 32);
  }
  // the state as 16 named values, not an array, so that it stays in registers through the rounds
  V x0 = V{} + in[0], x1 = V{} + in[1], x2 = V{} + in[2], x3 = V{} + in[3];
  V x4 = V{} + in[4], x5 = V{} + in[5], x6 = V{} + in[6], x7 = V{} + in[7];
  V x8 = V{} + in[8], x9 = V{} + in[9], x10 = V{} + in[10], x11 = V{} + in[11];
  V x12 = lo, x13 = hi, x14 = V{}, x15 = V{};
  for (int round = 0; round < Rounds / 2; ++round) {  // column + diagonal double rounds
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
