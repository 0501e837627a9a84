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

constexpr int kMaxLoop = 64;               // Algorithm 1's K reaches k with probability <= 1/(k-1)!
constexpr uint64_t kMaxDenominator = 1ull << 56;  // keeps den * K <= 2^62, uniform_below's range

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "splitface_native: %s\n", why);
  std::exit(2);
}

// Bernoulli(exp(-num / den)) for 0 <= num <= den (Algorithm 1, gamma <= 1): K counts up while a
// Bernoulli(num / (den K)) succeeds; the result is whether the first failure came at an odd K.
bool bernoulli_exp_at_most_one(uint64_t num, uint64_t den, KeyStream& s) {
  for (uint64_t k = num == den ? 2 : 1;; ++k) {  // num == den: Bernoulli(1) at K = 1 always succeeds
    if (k > kMaxLoop) die("Bernoulli(exp(-gamma)) ran past its loop bound (probability < 1e-80)");
    if (s.uniform_below(den * k) >= num) return k % 2 == 1;
  }
}

// Bernoulli(exp(-(whole + rem / den))): `whole` Bernoulli(exp(-1)) trials, then one of exp(-rem / den), all
// needing to succeed (Algorithm 1, gamma > 1). A saturated `whole` (a proposal far in the tail) needs 2^64
// successes in a row, so it fails as the exact count would.
bool bernoulli_exp(uint64_t whole, uint64_t rem, uint64_t den, KeyStream& s) {
  for (uint64_t i = 0; i < whole; ++i) {
    if (!bernoulli_exp_at_most_one(1, 1, s)) return false;
  }
  return bernoulli_exp_at_most_one(rem, den, s);
}

// The discrete Laplace with P(y) proportional to exp(-|y| / t) (Algorithm 2, s = 1).
int64_t discrete_laplace(uint64_t t, KeyStream& s) {
  for (;;) {
    uint64_t u = s.uniform_below(t);
    if (!bernoulli_exp_at_most_one(u, t, s)) continue;  // accept U with probability exp(-U / t)
    uint64_t v = 0;  // geometric: Bernoulli(exp(-1)) successes before a failure
    while (bernoulli_exp_at_most_one(1, 1, s)) ++v;
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
}

int64_t DiscreteGaussian::sample(KeyStream& s) const {
  const unsigned __int128 tq = static_cast<unsigned __int128>(t_) * q_;
  for (;;) {
    int64_t y = discrete_laplace(t_, s);
    unsigned __int128 a = y < 0 ? -static_cast<unsigned __int128>(y) : static_cast<unsigned __int128>(y);
    uint64_t whole = std::numeric_limits<uint64_t>::max(), rem = 0;
    if (a < (static_cast<unsigned __int128>(1) << 62) / tq) {  // (|y| t q - p)^2 < 2^126: exact in 128 bits
      unsigned __int128 m = a * tq;
      unsigned __int128 diff = m >= p_ ? m - p_ : p_ - m;
      unsigned __int128 num = diff * diff;  // gamma = num / den = (|y| - sigma2 / t)^2 / (2 sigma2)
      if (num / den_ <= std::numeric_limits<uint64_t>::max()) whole = static_cast<uint64_t>(num / den_);
      rem = static_cast<uint64_t>(num % den_);
    }
    if (bernoulli_exp(whole, rem, den_, s)) return y;
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
