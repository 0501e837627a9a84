// The exact noise option (`--noise discrete`, splitface/device/privacy/discrete.py) in the runner: each image's release
// clipped to an L2 norm of B quantisation steps and quantised (the last floating-point step), plus discrete
// Gaussian noise N_Z(0, sigma2) sampled exactly with integer arithmetic only (Canonne, Kamath & Steinke 2020,
// Algorithms 1-3), clamped to int8's [-127, 127].
//
// The random integers come from ChaCha20's keystream (RFC 8439, block counter from 0, nonce zero: the same
// stream as `fastnoise.NoiseStream(key)`) under a key from getrandom per release, made 16 blocks at a time by
// the vectorised block function (chacha20.h) and read in order: uniform integers below a bound by Lemire's
// multiply-shift with rejection (bounds < 2^32, 32-bit words) or rejection then modulo (64-bit words), exactly
// as `NoiseStream.uniform_below` defines them; the samplers' Bernoulli(num / den) trials compare a uniform's
// bytes with num / den lazily (one byte a trial but for a straddle, no division). The samplers are scalar and
// draw one value at a time, so under the same key their values are not those of the vectorised numpy sampler
// (which draws lane by lane); the tests hold them to its law (`DiscreteGaussian.pmf`), the uniform integers to
// `NoiseStream.uniform_below` word for word, and the buffered stream to NoiseStream's bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "chacha20.h"

namespace splitface {

// ChaCha20's keystream under `key` from block 0, read in order: bytes, and words as little-endian bytes. The
// blocks are made 16 at a time into a buffer (chacha20_blocks); a read that straddles two buffers takes its
// bytes from both, so any mix of reads sees the same bytes as one pass over the stream.
class KeyStream {
 public:
  explicit KeyStream(const NoiseKey& key) : key_(key) {}
  uint8_t byte() {
    if (used_ == kChachaGroupBytes) refill();
    return buffer_[used_++];
  }
  uint32_t word32() { return read<uint32_t>(); }
  uint64_t word64() { return read<uint64_t>(); }
  bool bit() { return (byte() >> 7) != 0; }  // one fair coin (one byte's top bit)
  uint64_t uniform_below(uint64_t bound);     // exactly uniform on [0, bound), 1 <= bound <= 2^62

 private:
  void refill();
  template <typename T>
  T read() {
    T w = 0;
    if (used_ + sizeof(T) <= kChachaGroupBytes) {  // little-endian hosts only (chacha20.cpp asserts it)
      std::memcpy(&w, buffer_ + used_, sizeof(T));
      used_ += sizeof(T);
    } else {
      for (size_t b = 0; b < sizeof(T); ++b) w |= static_cast<T>(byte()) << (8 * b);
    }
    return w;
  }
  NoiseKey key_;
  uint64_t block_ = 0;  // the next group's first block
  size_t used_ = kChachaGroupBytes;
  alignas(64) uint8_t buffer_[kChachaGroupBytes];
};

// Uniform integers on [0, bound), 1 <= bound <= 2^62, as `NoiseStream.uniform_below` defines them: Lemire's
// multiply-shift with rejection on 32-bit words for bounds below 2^32, else 64-bit words kept when at least
// 2^64 mod bound, then taken mod bound. The rejection threshold is computed once, for samplers that reuse a bound.
class UniformBelow {
 public:
  explicit UniformBelow(uint64_t bound);
  uint64_t operator()(KeyStream& s) const;

 private:
  uint64_t bound_, threshold_;
};

// N_Z(0, sigma2) with sigma2 = num / den (a positive rational whose Algorithm 3 denominator 2 num den t^2 fits
// 2^56, as discrete.py requires); exits with a message otherwise.
class DiscreteGaussian {
 public:
  DiscreteGaussian(uint64_t num, uint64_t den);
  int64_t sample(KeyStream& s) const;

 private:
  uint64_t p_, q_, t_, den_;
  UniformBelow below_t_{1};  // the Laplace proposal's U on [0, t)
};

// Each of an image's n values in steps of `step`, scaled so that the integers' L2 norm is at most `bound`
// (discrete.py's clip_quantise: rounded half to even after scaling, scaled down again where rounding overshot,
// truncated if that did not suffice); the squared norm is checked exactly in integers.
void clip_quantise(const float* x, size_t n, double step, int64_t bound, int64_t* q);

// out[i] = clamp(q[i] + Z_i, -127, 127), Z_i the next n samples of `noise` from `s`.
void add_discrete(const int64_t* q, size_t n, const DiscreteGaussian& noise, KeyStream& s, int8_t* out);

}  // namespace splitface
