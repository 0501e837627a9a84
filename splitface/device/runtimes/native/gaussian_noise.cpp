// ChaCha8 + Box-Muller on W lanes at once (W ChaCha blocks side by side, chacha_lanes.h) with GCC/Clang
// vector extensions: 16 lanes on AVX-512, 8 on AVX2, 4 on SSE2, picked at load time on x86 (function
// multiversions), 4 on NEON at build time; the lanes go from ChaCha's registers straight into Box-Muller, and the
// normals straight into the sum with the release. log, sin and cos are Cephes' float polynomials (about 1 ulp on
// their reduced ranges), branch-free so that they vectorise too. See gaussian_noise.h for the mapping from
// keystream words to normals.
#include "gaussian_noise.h"

#include <sys/random.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "chacha_lanes.h"

namespace splitface {
namespace {

constexpr int kLanes = kChachaLanes;  // ChaCha blocks per group

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "splitface_native: %s\n", why);
  std::exit(2);
}

// Box-Muller on W lanes: words w0 (radius) and w1 (angle) to z0 = r cos theta, z1 = r sin theta, branch-free.
template <int W>
__attribute__((always_inline)) inline void box_muller(typename lanes::Vec<W>::u32 w0, typename lanes::Vec<W>::u32 w1,
                                                      typename lanes::Vec<W>::f32& z0, typename lanes::Vec<W>::f32& z1) {
  using u32v = typename lanes::Vec<W>::u32;
  using i32v = typename lanes::Vec<W>::i32;
  using f32v = typename lanes::Vec<W>::f32;
  // ln U for U = k / 2^24, k in [1, 2^24]: k is exact in float; ln k = ln m + e ln 2, m in [sqrt(1/2), sqrt(2))
  f32v k = __builtin_convertvector((w0 >> 8) + 1u, f32v);
  u32v bits = (u32v)k;
  u32v big = ((bits & 0x7fffffu) > 0x3504f3u) & 1u;  // mantissa above sqrt(2): take m / 2 and e + 1
  i32v e = reinterpret_cast<i32v>(bits >> 23) - (127 + 24) + reinterpret_cast<i32v>(big);
  u32v mbits = (bits & 0x7fffffu) | (0x3f800000u - (big << 23));
  f32v m = (f32v)mbits;
  f32v fe = __builtin_convertvector(e, f32v);
  f32v t = m - 1.0f, t2 = t * t;
  f32v poly = 7.0376836292E-2f * t - 1.1514610310E-1f;
  poly = poly * t + 1.1676998740E-1f;
  poly = poly * t - 1.2420140846E-1f;
  poly = poly * t + 1.4249322787E-1f;
  poly = poly * t - 1.6668057665E-1f;
  poly = poly * t + 2.0000714765E-1f;
  poly = poly * t - 2.4999993993E-1f;
  poly = poly * t + 3.3333331174E-1f;
  f32v ln = t + (t * t2 * poly - 2.12194440E-4f * fe - 0.5f * t2) + 0.693359375f * fe;
  f32v r2 = -2.0f * ln;
  r2 = r2 > 0.0f ? r2 : 0.0f;
  f32v r;
  for (int l = 0; l < W; ++l) r[l] = std::sqrt(r2[l]);  // one vsqrtps
  // theta = (pi / 2) (q + f): the quadrant q from the top bits, f in [-1/2, 1/2) exactly from the rest
  u32v v = w1 >> 8;
  u32v half = (v >> 21) & 1u;
  u32v q = ((v >> 22) + half) & 3u;
  f32v f = __builtin_convertvector(reinterpret_cast<i32v>(v & 0x3fffffu) - reinterpret_cast<i32v>(half << 22), f32v) *
           (1.0f / 4194304.0f);
  f32v a = f * 1.5707963267948966f, a2 = a * a;
  f32v sn = ((-1.9515295891E-4f * a2 + 8.3321608736E-3f) * a2 - 1.6666654611E-1f) * a2 * a + a;
  f32v cs = ((2.443315711809948E-5f * a2 - 1.388731625493765E-3f) * a2 + 4.166664568298827E-2f) * a2 * a2 -
            0.5f * a2 + 1.0f;
  // cos(theta), sin(theta) by quadrant: (c, s), (-s, c), (-c, -s), (s, -c)
  u32v swap = 0u - (q & 1u);
  u32v sb = (u32v)sn, cb = (u32v)cs;
  u32v cos_b = ((sb & swap) | (cb & ~swap)) ^ ((((q + 1u) >> 1) & 1u) << 31);
  u32v sin_b = ((cb & swap) | (sb & ~swap)) ^ ((q >> 1) << 31);
  z0 = r * (f32v)cos_b;
  z1 = r * (f32v)sin_b;
}

// dst[16 j + l] = src[16 j + l] + sigma * (normal j of block `block + l`) for the group's 256 values (lane l of
// vector j, as they are: no transpose), the 16 blocks W at a time; a null src reads as zeros. The sum is made in
// registers: the normals never go through memory, and no scalar pass over the group follows (the compiler at -O2
// left that pass unvectorised; docs/device.md measures the change).
template <int W>
__attribute__((always_inline)) inline void group_add_w(const NoiseKey& key, uint64_t block, float sigma,
                                                       const float* src, float* dst) {
  using f32v = typename lanes::Vec<W>::f32;
  for (int h = 0; h < kLanes; h += W) {
    typename lanes::Vec<W>::u32 x[16];
    lanes::chacha_lanes<W, kNoiseRounds>(key, block + static_cast<uint64_t>(h), x);
    for (int p = 0; p < 8; ++p) {
      f32v z[2];
      box_muller<W>(x[2 * p], x[2 * p + 1], z[0], z[1]);
      for (int k = 0; k < 2; ++k) {
        size_t at = 16 * (2 * p + k) + h;
        f32v v = sigma * z[k];
        if (src != nullptr) {
          f32v s;
          std::memcpy(&s, src + at, sizeof(s));
          v = s + v;
        }
        std::memcpy(dst + at, &v, sizeof(v));
      }
    }
  }
}

#define SPLITFACE_GROUP_ADD(W) group_add_w<W>(key, block, sigma, src, dst)
SPLITFACE_ISA_VERSIONS(void, group_add, (const NoiseKey& key, uint64_t block, float sigma, const float* src, float* dst),
                       SPLITFACE_GROUP_ADD)

}  // namespace

NoiseKey fresh_key() {
  NoiseKey key{};
  auto* bytes = reinterpret_cast<unsigned char*>(key.data());
  size_t got = 0;
  while (got < sizeof(key)) {
    ssize_t n = getrandom(bytes + got, sizeof(key) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) die("cannot read a noise key from the OS CSPRNG (getrandom)");
    got += static_cast<size_t>(n);
  }
  return key;
}

NoiseKey key_from_file(const char* path) {
  NoiseKey key{};
  std::FILE* f = std::fopen(path, "rb");
  unsigned char bytes[32];
  if (!f || std::fread(bytes, 1, 32, f) != 32 || std::fgetc(f) != EOF) die("the noise key file must hold 32 bytes");
  std::fclose(f);
  for (int i = 0; i < 8; ++i) {  // little-endian words, as RFC 8439 reads the key
    key[i] = bytes[4 * i] | (bytes[4 * i + 1] << 8) | (bytes[4 * i + 2] << 16) | (static_cast<uint32_t>(bytes[4 * i + 3]) << 24);
  }
  return key;
}

void add_gaussian(float* dst, const float* src, size_t n, uint64_t first, const NoiseKey& key, float sigma) {
  uint64_t end = first + n;
  for (uint64_t g = first / kNoiseGroup * kNoiseGroup; g < end; g += kNoiseGroup) {  // groups of 256 values
    uint64_t lo = g > first ? g : first, hi = g + kNoiseGroup < end ? g + kNoiseGroup : end;
    if (lo == g && hi == g + kNoiseGroup) {  // a whole group: drawn and added in registers
      group_add(key, g / 16, sigma, src == nullptr ? nullptr : src + (g - first), dst + (g - first));
      continue;
    }
    // a group cut by the range's ends: its part of the range through a buffer, added by the same code, so that
    // a value rounds alike whichever way its group was cut
    alignas(64) float t[kNoiseGroup] = {};
    size_t at = lo - g, count = hi - lo;
    if (src != nullptr) std::memcpy(t + at, src + (lo - first), count * sizeof(float));
    group_add(key, g / 16, sigma, t, t);
    std::memcpy(dst + (lo - first), t + at, count * sizeof(float));
  }
}

}  // namespace splitface
