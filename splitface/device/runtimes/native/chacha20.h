// ChaCha20's keystream (RFC 8439: block counter in word 12, its high half in word 13, nonce words zero), the
// stream `splitface.device.privacy.fastnoise.NoiseStream(key)` reads, 16 blocks at a time: the exact noise's
// uniform integers (discrete_gaussian.cpp). The vectorised block function itself is in chacha_lanes.h, for code
// that consumes the lanes in registers (gaussian_noise.cpp, whose float noise runs it at 8 rounds).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace splitface {

using NoiseKey = std::array<uint32_t, 8>;

constexpr int kChachaLanes = 16;                          // blocks computed side by side
constexpr size_t kChachaGroupBytes = 64 * kChachaLanes;   // the keystream bytes of one such group

// Keystream blocks first .. first + 15 in stream order (block by block, little-endian words) into out.
void chacha20_blocks(const NoiseKey& key, uint64_t first, uint8_t* out);

}  // namespace splitface
