// See discrete_gaussian.h. Integer arithmetic only from the quantised release on; the one floating-point step
// is clip_quantise's scaling, before any noise.
#include "discrete_gaussian.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace splitface {
namespace {

using u128 = unsigned __int128;

constexpr int kMaxLoop = 64;               // Algorithm 1's K reaches k with probability <= 1/(k-1)!
constexpr uint64_t kMaxDenominator = 1ull << 56;  // keeps den * K <= 2^62, so bernoulli_ratio's products fit

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "splitface_native: %s\n", why);
  std::exit(2);
}

// Bernoulli(num / den) for 0 <= num <= den <= 2^62: whether a uniform U in [0, 1) is below num / den, U's
// binary digits read a byte at a time and only as far as they decide it. With U = (b + U') / 256, b the next
// byte, U < num / den iff U' < (256 num - b den) / den: decided by b alone unless num / den lies in
// [b, b + 1) / 256 (probability < 2 / 256), when the next byte compares U' with that remainder. So one byte
// a draw on average, where uniform_below(den) >= num takes a word or two and a division.
bool bernoulli_ratio(uint64_t num, uint64_t den, KeyStream& s) {
  u128 n = num;
  for (;;) {
    const u128 scaled = n << 8, low = static_cast<u128>(s.byte()) * den;
    if (low + den <= scaled) return true;  // (b + 1) / 256 <= num / den
    if (low >= scaled) return false;       // b / 256 >= num / den
    n = scaled - low;                      // in (0, den): the next byte decides U' < n / den
  }
}

// Bernoulli(exp(-num / den)) for 0 <= num <= den (Algorithm 1, gamma <= 1): K counts up while a
// Bernoulli(num / (den K)) succeeds; the result is whether the first failure came at an odd K.
bool bernoulli_exp_at_most_one(uint64_t num, uint64_t den, KeyStream& s) {
  for (uint64_t k = num == den ? 2 : 1;; ++k) {  // num == den: Bernoulli(1) at K = 1 always succeeds
    if (k > kMaxLoop) die("Bernoulli(exp(-gamma)) ran past its loop bound (probability < 1e-80)");
    if (!bernoulli_ratio(num, den * k, s)) return k % 2 == 1;
  }
}

bool bernoulli_exp_minus_one(KeyStream& s) { return bernoulli_exp_at_most_one(1, 1, s); }

// Bernoulli(exp(-num / den)) for any num (Algorithm 1, gamma > 1): one Bernoulli(exp(-1)) per whole den in
// num, then one of exp(-rest / den), all needing to succeed; counted down by subtraction, no division.
bool bernoulli_exp(u128 num, uint64_t den, KeyStream& s) {
  for (; num > den; num -= den) {
    if (!bernoulli_exp_minus_one(s)) return false;
  }
  return bernoulli_exp_at_most_one(static_cast<uint64_t>(num), den, s);
}

// Bernoulli(exp(-diff^2 / den)) for diff < 2^127: directly while diff^2 fits 128 bits, else (a proposal far
// in the tail) as diff trials of exp(-diff / den), since exp(-diff^2 / den) = exp(-diff / den)^diff.
bool bernoulli_exp_square(u128 diff, uint64_t den, KeyStream& s) {
  if (diff < (static_cast<u128>(1) << 63)) return bernoulli_exp(diff * diff, den, s);
  for (u128 i = 0; i < diff; ++i) {
    if (!bernoulli_exp(diff, den, s)) return false;
  }
  return true;
}

// The discrete Laplace with P(y) proportional to exp(-|y| / t) (Algorithm 2, s = 1); `below_t` draws U.
int64_t discrete_laplace(const UniformBelow& below_t, uint64_t t, KeyStream& s) {
  for (;;) {
    uint64_t u = below_t(s);
    if (!bernoulli_exp_at_most_one(u, t, s)) continue;  // accept U with probability exp(-U / t)
    uint64_t v = 0;  // geometric: Bernoulli(exp(-1)) successes before a failure
    while (bernoulli_exp_minus_one(s)) ++v;
    uint64_t x = u + t * v;
    bool negative = s.bit();
    if (negative && x == 0) continue;  // -0 is rejected, or 0 would be drawn twice as often
    return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  }
}

}  // namespace

void KeyStream::refill() {
  chacha20_blocks(key_, block_, buffer_);
  block_ += kChachaLanes;
  used_ = 0;
}

uint64_t KeyStream::uniform_below(uint64_t bound) { return UniformBelow(bound)(*this); }

UniformBelow::UniformBelow(uint64_t bound) : bound_(bound) {
  if (bound < 1 || bound > (1ull << 62)) die("uniform_below: bound outside [1, 2^62]");
  threshold_ = bound < (1ull << 32) ? (1ull << 32) % bound : (0 - bound) % bound;  // 2^32 or 2^64 mod bound
}

uint64_t UniformBelow::operator()(KeyStream& s) const {
  if (bound_ < (1ull << 32)) {  // Lemire: m = u bound, m >> 32, redrawn when m mod 2^32 < 2^32 mod bound
    for (;;) {
      uint64_t m = static_cast<uint64_t>(s.word32()) * bound_;
      if ((m & 0xffffffffull) >= threshold_) return m >> 32;
    }
  }
  for (;;) {
    uint64_t u = s.word64();
    if (u >= threshold_) return u % bound_;
  }
}

DiscreteGaussian::DiscreteGaussian(uint64_t num, uint64_t den) : p_(num), q_(den) {
  if (num == 0 || den == 0) die("the discrete Gaussian's sigma2 must be a positive fraction P/Q");
  const char* wide = "the discrete Gaussian's sigma2 needs integers wider than 2^56 (as discrete.py refuses)";
  if (num > kMaxDenominator || den > kMaxDenominator) die(wide);
  uint64_t whole = num / den, r = static_cast<uint64_t>(std::sqrt(static_cast<double>(whole)));
  while (r * r > whole) --r;  // floor(sqrt), exact
  while ((r + 1) * (r + 1) <= whole) ++r;
  t_ = r + 1;  // floor(sigma) + 1, the proposal's scale (Algorithm 3)
  unsigned __int128 d = static_cast<unsigned __int128>(2 * p_) * q_;  // 2 p q t^2, checked before each factor
  for (int i = 0; i < 2; ++i) {
    if (d > kMaxDenominator) die(wide);
    d *= t_;
  }
  if (d > kMaxDenominator) die(wide);
  den_ = static_cast<uint64_t>(d);
  below_t_ = UniformBelow(t_);
}

int64_t DiscreteGaussian::sample(KeyStream& s) const {
  const u128 tq = static_cast<u128>(t_) * q_;
  for (;;) {
    int64_t y = discrete_laplace(below_t_, t_, s);
    u128 a = y < 0 ? -static_cast<u128>(y) : static_cast<u128>(y);
    u128 m = a * tq, diff = m >= p_ ? m - p_ : p_ - m;  // < 2^63 t q <= 2^119: exact
    if (bernoulli_exp_square(diff, den_, s)) return y;  // gamma = (|y| - sigma2 / t)^2 / (2 sigma2)
  }
}

void clip_quantise(const float* x, size_t n, double step, int64_t bound, int64_t* q) {
  std::vector<double> v(n);
  double squares = 0;
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<double>(x[i]) / step;
    if (!std::isfinite(v[i])) die("the release holds non-finite values");
    squares += v[i] * v[i];
  }
  const double b = static_cast<double>(bound);
  double factor = std::fmin(1.0, b / std::fmax(std::sqrt(squares), 1e-300));
  auto norm2 = [&]() {
    unsigned __int128 sum = 0;
    for (size_t i = 0; i < n; ++i) sum += static_cast<unsigned __int128>(q[i] < 0 ? -q[i] : q[i]) * (q[i] < 0 ? -q[i] : q[i]);
    return sum;
  };
  const unsigned __int128 limit = static_cast<unsigned __int128>(bound) * bound;
  for (size_t i = 0; i < n; ++i) q[i] = static_cast<int64_t>(std::nearbyint(v[i] * factor));  // half to even
  for (int round = 0; round < 64; ++round) {
    unsigned __int128 over = norm2();
    if (over <= limit) return;
    factor *= b / std::sqrt(static_cast<double>(over)) * (1 - 1e-6);  // the ratio it overshot, and a little
    for (size_t i = 0; i < n; ++i) q[i] = static_cast<int64_t>(std::nearbyint(v[i] * factor));
  }
  if (norm2() > limit) {  // |trunc(a)| <= |a| in every coordinate, and the scaled vector is below the bound
    for (size_t i = 0; i < n; ++i) q[i] = static_cast<int64_t>(std::trunc(v[i] * factor));
  }
  if (norm2() > limit) die("an image's quantised norm exceeds its bound");  // the guarantee rests on it
}

void add_discrete(const int64_t* q, size_t n, const DiscreteGaussian& noise, KeyStream& s, int8_t* out) {
  for (size_t i = 0; i < n; ++i) {
    int64_t z = q[i] + noise.sample(s);
    out[i] = static_cast<int8_t>(z < -127 ? -127 : (z > 127 ? 127 : z));
  }
}

}  // namespace splitface
