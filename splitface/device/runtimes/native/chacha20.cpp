// See chacha20.h: the W-lane block function at 20 rounds (chacha_lanes.h), its lanes stored back in stream order.
#include "chacha20.h"

#include <cstring>

#include "chacha_lanes.h"

namespace splitface {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "keystream words are stored as little-endian bytes");

namespace {

template <int W>
__attribute__((always_inline)) inline void blocks_w(const NoiseKey& key, uint64_t first, uint8_t* out) {
  uint32_t words[16 * kChachaLanes];
  for (int h = 0; h < kChachaLanes; h += W) {
    typename lanes::Vec<W>::u32 x[16];
    lanes::chacha_lanes<W, 20>(key, first + static_cast<uint64_t>(h), x);
    for (int l = 0; l < W; ++l) {  // the transpose: block h + l is lane l of each word
      for (int j = 0; j < 16; ++j) words[16 * (h + l) + j] = x[j][l];
    }
  }
  std::memcpy(out, words, sizeof(words));
}

}  // namespace

#define SPLITFACE_BLOCKS(W) blocks_w<W>(key, first, out)
SPLITFACE_ISA_VERSIONS(void, chacha20_blocks, (const NoiseKey& key, uint64_t first, uint8_t* out), SPLITFACE_BLOCKS)

}  // namespace splitface
