// Times the native runner's noise generator (splitface/device/runtimes/native/gaussian_noise.cpp) as built by
// bench/noise_isa.py for one ISA path, and dumps what it draws for the tests:
//   noise_isa <key: 64 hex digits> <values> <repetitions> [dump file]
// prints {"ms_min": .., "ns_per_value": .., "keystream_ms_min": ..}; the last (with SPLITFACE_FORCE_LANES, else -1):
// the ChaCha8 keystream alone that those values consume (4 bytes a value), made W blocks at a time in registers
// as the draw makes it, and folded by XOR instead of turned into normals; the dump holds the first `values` normals
// as float32, then the keystream's first 4 groups of 16 blocks (chacha20_blocks, what the exact noise reads) as
// bytes.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "chacha20.h"
#include "chacha_lanes.h"
#include "gaussian_noise.h"

#ifdef SPLITFACE_FORCE_LANES
// The keystream of `n` values in registers, W blocks at a time (the draw's own width); returns ms.
static double keystream_ms(const splitface::NoiseKey& key, size_t n, uint32_t& sink) {
  constexpr int W = SPLITFACE_FORCE_LANES;
  using V = splitface::lanes::Vec<W>::u32;
  V acc{}, x[16];
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t block = 0; block < (4 * n + 63) / 64; block += W) {
    splitface::lanes::chacha_lanes<W, splitface::kNoiseRounds>(key, block, x);
    for (int j = 0; j < 16; ++j) acc ^= x[j];
  }
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (int l = 0; l < W; ++l) sink ^= acc[l];
  return ms;
}
#endif

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: noise_isa KEYHEX VALUES REPETITIONS [DUMP]\n");
    return 2;
  }
  splitface::NoiseKey key{};
  for (int i = 0; i < 32; ++i) {  // little-endian words, as key_from_file reads a key file
    unsigned byte = 0;
    if (std::sscanf(argv[1] + 2 * i, "%2x", &byte) != 1) return 2;
    key[i / 4] |= static_cast<uint32_t>(byte) << (8 * (i % 4));
  }
  size_t n = std::strtoull(argv[2], nullptr, 10);
  int reps = std::atoi(argv[3]);
  std::vector<float> z(n);
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    splitface::add_gaussian(z.data(), nullptr, n, 0, key, 1.0f);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (ms < best) best = ms;
  }
  double keystream = -1;
  uint32_t sink = 0;  // the XOR of every keystream word, printed so that none can be left out
#ifdef SPLITFACE_FORCE_LANES
  keystream = 1e300;
  for (int r = 0; r < reps; ++r) {
    double ms = keystream_ms(key, n, sink);
    if (ms < keystream) keystream = ms;
  }
#endif
  if (argc > 4) {
    std::FILE* f = std::fopen(argv[4], "wb");
    if (!f || std::fwrite(z.data(), sizeof(float), n, f) != n) return 1;
    uint8_t group[splitface::kChachaGroupBytes];
    for (uint64_t g = 0; g < 4; ++g) {
      splitface::chacha20_blocks(key, g * splitface::kChachaLanes, group);
      if (std::fwrite(group, 1, sizeof(group), f) != sizeof(group)) return 1;
    }
    std::fclose(f);
  }
  std::printf("{\"ms_min\": %.6f, \"ns_per_value\": %.4f, \"keystream_ms_min\": %.6f, \"sink\": %u}\n", best,
              best * 1e6 / static_cast<double>(n), keystream, sink);
  return 0;
}
