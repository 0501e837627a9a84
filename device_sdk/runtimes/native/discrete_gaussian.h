// The exact noise option (`--noise discrete`, device_sdk/privacy/discrete.py) in the runner: each image's release
// clipped to an L2 norm of B quantisation steps and quantised (the last floating-point step), plus discrete
// Gaussian noise N_Z(0, sigma2) sampled exactly with integer arithmetic only (Canonne, Kamath & Steinke 2020,
// Algorithms 1-3), clamped to int8's [-127, 127].
//
// The random integers come from ChaCha20's keystream (RFC 8439, block counter from 0, nonce zero: the same
// stream as `fastnoise.NoiseStream(key)`) under a key from getrandom per release, read in order: uniform
// integers below a bound by Lemire's multiply-shift with rejection (bounds < 2^32, 32-bit words) or rejection
// then modulo (64-bit words), exactly as `NoiseStream.uniform_below` defines them. The samplers are scalar and
// draw one value at a time, so under the same key their values are not those of the vectorised numpy sampler
// (which draws lane by lane); the tests hold them to its law (`DiscreteGaussian.pmf`) and the uniform integers
// to `NoiseStream.uniform_below` word for word.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gaussian_noise.h"

namespace splitface {

// ChaCha20's keystream under `key`, read byte by byte in order (little-endian words), from block 0.
class KeyStream {
 public:
  explicit KeyStream(const NoiseKey& key) : key_(key) {}
  uint32_t word32();
  uint64_t word64();
  bool bit();                               // one fair coin (one byte's top bit)
  uint64_t uniform_below(uint64_t bound);   // exactly uniform on [0, bound), 1 <= bound <= 2^62

 private:
  uint8_t byte();
  NoiseKey key_;
  uint64_t block_ = 0;
  uint8_t buffer_[64] = {};
  int used_ = 64;
};

// N_Z(0, sigma2) with sigma2 = num / den (a positive rational whose Algorithm 3 denominator 2 num den t^2 fits
// 2^56, as discrete.py requires); exits with a message otherwise.
class DiscreteGaussian {
 public:
  DiscreteGaussian(uint64_t num, uint64_t den);
  int64_t sample(KeyStream& s) const;

 private:
  uint64_t p_, q_, t_, den_;
};

// Each of an image's n values in steps of `step`, scaled so that the integers' L2 norm is at most `bound`
// (discrete.py's clip_quantise: rounded half to even after scaling, scaled down again where rounding overshot,
// truncated if that did not suffice); the squared norm is checked exactly in integers.
void clip_quantise(const float* x, size_t n, double step, int64_t bound, int64_t* q);

// out[i] = clamp(q[i] + Z_i, -127, 127), Z_i the next n samples of `noise` from `s`.
void add_discrete(const int64_t* q, size_t n, const DiscreteGaussian& noise, KeyStream& s, int8_t* out);

}  // namespace splitface
