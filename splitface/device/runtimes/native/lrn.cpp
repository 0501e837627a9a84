// See lrn.h.
#include "lrn.h"

#include "isa_versions.h"

#include <cmath>

namespace splitface {
namespace {

// The loops below are PaperLRN's and conv_grad's arithmetic step by step, compiled without floating-point
// contraction (CMakeLists.txt) so that each step rounds as eager PyTorch's does: the squares summed in
// window_sum's order (the zero channels it adds at the edges change no sum), divided by the correctly rounded
// square root (torch.pow(d, 0.5) is torch.sqrt, whose vectorised CPU kernel is one ulp off it in a few values per
// thousand: there the release differs from eager PyTorch by an ulp or two). They are inlined into each ISA's version
// (isa_versions.h); tests/test_native.py holds every version to the same bits (bench/lrn_isa.py).

// dst[o] = the sum of src over channel o's window, in window_sum's order.
__attribute__((always_inline)) inline void window_loop(int r, const float* src, int O, size_t n, float* dst) {
  for (int o = 0; o < O; ++o) {
    int lo = o - r < 0 ? 0 : o - r, hi = o + r >= O ? O - 1 : o + r;
    float* s = dst + static_cast<size_t>(o) * n;
    const float* t = src + static_cast<size_t>(lo) * n;
    for (size_t k = 0; k < n; ++k) s[k] = t[k];
    for (int j = lo + 1; j <= hi; ++j) {
      t = src + static_cast<size_t>(j) * n;
      for (size_t k = 0; k < n; ++k) s[k] += t[k];
    }
  }
}

// The release from the LRN's input a: blocks of pixels keep the window's rows in L1 across the channels that
// share them.
__attribute__((always_inline)) inline void forward_loops(const Lrn& l, const float* a, int O, size_t n, float* out) {
  constexpr size_t kBlock = 256;
  for (size_t k0 = 0; k0 < n; k0 += kBlock) {
    size_t m = n - k0 < kBlock ? n - k0 : kBlock;
    for (int o = 0; o < O; ++o) {
      int lo = o - l.r < 0 ? 0 : o - l.r, hi = o + l.r >= O ? O - 1 : o + l.r;
      float* s = out + static_cast<size_t>(o) * n + k0;
      const float* t = a + static_cast<size_t>(lo) * n + k0;
      for (size_t k = 0; k < m; ++k) s[k] = t[k] * t[k];
      for (int j = lo + 1; j <= hi; ++j) {
        t = a + static_cast<size_t>(j) * n + k0;
        for (size_t k = 0; k < m; ++k) s[k] += t[k] * t[k];
      }
      const float* v = a + static_cast<size_t>(o) * n + k0;
      for (size_t k = 0; k < m; ++k) s[k] = v[k] / std::sqrt(l.gamma + l.alpha * s[k]);
    }
  }
}

// The conv's gradient (conv_grad) from the conv's output x, the LRN's input a and the release's gradient g: with
// inv = d^-1/2, g_a = g inv - alpha a window(g a inv^3), masked by [x > 0] and [x <= m]. inv, t: scratch of the
// strip's size.
__attribute__((always_inline)) inline void backward_loops(const Lrn& l, const float* x, const float* a, const float* g,
                                                          int O, size_t n, float* out, float* inv, float* t) {
  size_t count = static_cast<size_t>(O) * n;
  for (size_t k = 0; k < count; ++k) t[k] = a[k] * a[k];
  window_loop(l.r, t, O, n, inv);
  for (size_t k = 0; k < count; ++k) inv[k] = 1.0f / std::sqrt(l.gamma + l.alpha * inv[k]);
  for (size_t k = 0; k < count; ++k) t[k] = g[k] * a[k] * (inv[k] * inv[k] * inv[k]);
  window_loop(l.r, t, O, n, out);
  bool clamped = l.input_max > 0;
  for (size_t k = 0; k < count; ++k) {
    float g_a = g[k] * inv[k] - l.alpha * (a[k] * out[k]);
    out[k] = x[k] > 0.0f && !(clamped && x[k] > l.input_max) ? g_a : 0.0f;
  }
}

}  // namespace

// Each once per ISA: the square roots, divisions and sums run 16 lanes wide with AVX-512.
#define SPLITFACE_FORWARD(W) forward_loops(l, a, O, n, out)
SPLITFACE_ISA_VERSIONS(void, lrn_forward, (const Lrn& l, const float* a, int O, size_t n, float* out),
                       SPLITFACE_FORWARD)
#undef SPLITFACE_FORWARD
#define SPLITFACE_BACKWARD(W) backward_loops(l, x, a, g, O, n, out, inv, t)
SPLITFACE_ISA_VERSIONS(void, lrn_backward,
                       (const Lrn& l, const float* x, const float* a, const float* g, int O, size_t n, float* out,
                        float* inv, float* t),
                       SPLITFACE_BACKWARD)
#undef SPLITFACE_BACKWARD

void Lrn::forward(const float* a, int O, size_t n, float* out) const { lrn_forward(*this, a, O, n, out); }

void Lrn::backward(const float* x, const float* a, const float* g, int O, size_t n, float* out) {
  size_t count = static_cast<size_t>(O) * n;
  inv_.resize(count);
  t_.resize(count);
  lrn_backward(*this, x, a, g, O, n, out, inv_.data(), t_.data());
}

}  // namespace splitface
