// See chacha20.h: the 16-lane block function, its lanes stored back in stream order.
#include "chacha20.h"

#include <cstring>

#include "chacha20_lanes.h"

namespace splitface {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "keystream words are stored as little-endian bytes");

SPLITFACE_CLONES
void chacha20_blocks(const NoiseKey& key, uint64_t first, uint8_t* out) {
  lanes::u32v x[16];
  lanes::chacha20_lanes(key, first, x);
  uint32_t words[16 * kChachaLanes];
  for (int l = 0; l < kChachaLanes; ++l) {  // the transpose: block l is lane l of each word
    for (int j = 0; j < 16; ++j) words[16 * l + j] = x[j][l];
  }
  std::memcpy(out, words, sizeof(words));
}

}  // namespace splitface
