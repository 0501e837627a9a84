// ChaCha20 + Box-Muller on 16 lanes at once (16 ChaCha blocks side by side) with GCC/Clang vector extensions:
// AVX-512, AVX2 or SSE2 picked at run time on x86 (target_clones), NEON on arm64 at build time. The ChaCha
// state is 16 named vectors so that it stays in registers. log, sin and cos are Cephes' float polynomials
// (about 1 ulp on their reduced ranges), branch-free so that they vectorise too. See gaussian_noise.h for the
// mapping from keystream words to normals.
#include "gaussian_noise.h"

#include <sys/random.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPLITFACE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPLITFACE_CLONES
#endif

namespace splitface {
namespace {

constexpr int kRounds = 20;                // ChaCha20
constexpr int kLanes = 16;                 // ChaCha blocks per group
constexpr int kGroup = kLanes * 16;        // values per group

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "splitface_native: %s\n", why);
  std::exit(2);
}

// 16 lanes as one value (GCC/Clang vector extensions): the compiler maps it onto AVX-512, AVX2 or NEON.
typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
typedef int32_t i32v __attribute__((vector_size(4 * kLanes)));
typedef float f32v __attribute__((vector_size(4 * kLanes)));

__attribute__((always_inline)) inline u32v rotl(u32v v, int c) { return (v << c) | (v >> (32 - c)); }

__attribute__((always_inline)) inline void quarter(u32v& a, u32v& b, u32v& c, u32v& d) {
  a += b; d = rotl(d ^ a, 16);
  c += d; b = rotl(b ^ c, 12);
  a += b; d = rotl(d ^ a, 8);
  c += d; b = rotl(b ^ c, 7);
}

// Box-Muller on 16 lanes: words w0 (radius) and w1 (angle) to z0 = r cos theta, z1 = r sin theta, branch-free.
__attribute__((always_inline)) inline void box_muller(u32v w0, u32v w1, f32v& z0, f32v& z1) {
  // ln U for U = k / 2^24, k in [1, 2^24]: k is exact in float; ln k = ln m + e ln 2, m in [sqrt(1/2), sqrt(2))
  f32v k = __builtin_convertvector((w0 >> 8) + 1u, f32v);
  u32v bits = reinterpret_cast<u32v&>(k);
  u32v big = ((bits & 0x7fffffu) > 0x3504f3u) & 1u;  // mantissa above sqrt(2): take m / 2 and e + 1
  i32v e = reinterpret_cast<i32v>(bits >> 23) - (127 + 24) + reinterpret_cast<i32v>(big);
  u32v mbits = (bits & 0x7fffffu) | (0x3f800000u - (big << 23));
  f32v m = reinterpret_cast<f32v&>(mbits);
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
  for (int l = 0; l < kLanes; ++l) r[l] = std::sqrt(r2[l]);  // one vsqrtps
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
  u32v sb = reinterpret_cast<u32v&>(sn), cb = reinterpret_cast<u32v&>(cs);
  u32v cos_b = ((sb & swap) | (cb & ~swap)) ^ ((((q + 1u) >> 1) & 1u) << 31);
  u32v sin_b = ((cb & swap) | (sb & ~swap)) ^ ((q >> 1) << 31);
  z0 = r * reinterpret_cast<f32v&>(cos_b);
  z1 = r * reinterpret_cast<f32v&>(sin_b);
}

// out[16 j + l]: normal j of block `block + l` (lane l of vector j, stored as they are: no transpose).
SPLITFACE_CLONES
void group_normals(const NoiseKey& key, uint64_t block, float* out) {
  const uint32_t in[12] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                           key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7]};
  u32v lo, hi;
  for (int l = 0; l < kLanes; ++l) {
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
  const u32v x[16] = {x0 + in[0], x1 + in[1], x2 + in[2], x3 + in[3], x4 + in[4], x5 + in[5], x6 + in[6],
                      x7 + in[7], x8 + in[8], x9 + in[9], x10 + in[10], x11 + in[11], x12 + lo, x13 + hi, x14, x15};
  f32v z0, z1;
  for (int p = 0; p < 8; ++p) {
    box_muller(x[2 * p], x[2 * p + 1], z0, z1);
    std::memcpy(out + 16 * (2 * p), &z0, sizeof(z0));
    std::memcpy(out + 16 * (2 * p + 1), &z1, sizeof(z1));
  }
}

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
  alignas(64) float z[kGroup];
  uint64_t end = first + n;
  for (uint64_t g = first / kGroup * kGroup; g < end; g += kGroup) {  // groups start at multiples of 256 values
    group_normals(key, g / 16, z);
    uint64_t lo = g > first ? g : first, hi = g + kGroup < end ? g + kGroup : end;
    const float* zg = z + (lo - g);
    float* d = dst + (lo - first);
    if (src == nullptr) {
      for (uint64_t i = 0; i < hi - lo; ++i) d[i] = sigma * zg[i];
    } else {
      const float* s = src + (lo - first);
      for (uint64_t i = 0; i < hi - lo; ++i) d[i] = s[i] + sigma * zg[i];
    }
  }
}

}  // namespace splitface
