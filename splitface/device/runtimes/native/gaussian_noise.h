// The release's Gaussian noise, drawn on the device: ChaCha8's keystream under a 256-bit key from the OS CSPRNG
// (one key per release), turned into normals by Box-Muller, vectorised over 16 ChaCha blocks at a time.
//
// ChaCha is counter-based: block b of the keystream is a function of the key and b alone, so the noise for
// any stretch of the release can be drawn in any order (the runner draws each strip's noise while the strip's
// output is in cache) and still be the same numbers. Value i of the release (flat, C order) is taken from
// block 16 (i / 256) + i % 16, word (i % 256) / 16: 16 consecutive blocks fill 256 consecutive values, lane by
// lane, so the vectorised generator stores its results without a transpose. Words 2k and 2k + 1 of a block
// give the values of words 2k and 2k + 1:
//   r = sqrt(-2 ln U), U = ((w_2k >> 8) + 1) / 2^24 in (0, 1],   theta = 2 pi (w_2k+1 >> 8) / 2^24,
//   z_2k = r cos theta,   z_2k+1 = r sin theta.
// The keystream is ChaCha with 8 rounds (ChaCha8; Bernstein 2008) in RFC 8439's layout (block counter in word 12,
// its high half in word 13, nonce words zero): the same state as ChaCha20 with 12 fewer rounds, the block function
// that Go's runtime and math/rand/v2 build their generator on (chacha8rand; this stream is not chacha8rand's). The tests hold it to `fastnoise.chacha_words(key, ..., rounds=8)`,
// itself held to the `cryptography` package's ChaCha20 at 20 rounds and to published ChaCha8 vectors. Why 8
// rounds and what it changes: docs/noise.md. The exact option keeps ChaCha20 (chacha20.h).
//
// A floating-point sampler: its values are float32 Gaussians truncated at |z| <= sqrt(2 ln 2^24) = 5.77 and
// on a grid, and the release's low bits can reveal the noiseless value (Mironov 2012). Fast, and unpredictable
// without the key, but not the formal DP mechanism: docs/noise.md says which option gives which guarantee.
#pragma once

#include <cstddef>
#include <cstdint>

#include "chacha20.h"

namespace splitface {

// ChaCha's rounds for the float noise (splitface.device.runtimes.native.NOISE_ROUNDS in Python: the tests hold the
// runner's normals to that reference's).
constexpr int kNoiseRounds = 8;

// Values per group of 16 blocks: the unit that the generator draws whole (a range that cuts a group draws all of it).
constexpr size_t kNoiseGroup = 16 * kChachaLanes;

// 32 bytes from the OS CSPRNG (getrandom), as ChaCha's key words; exits with a message if none can be read.
NoiseKey fresh_key();

// The key in a 32-byte file (tests and replays of a release; production draws `fresh_key()` per release).
NoiseKey key_from_file(const char* path);

// dst[i] = src[i] + sigma * z(first + i) for i < n, z the key's normals above (dst may equal src; a null src
// reads as zeros, which draws the noise alone).
void add_gaussian(float* dst, const float* src, size_t n, uint64_t first, const NoiseKey& key, float sigma);

}  // namespace splitface
