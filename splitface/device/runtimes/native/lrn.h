// The paper's LRN and its backward on one strip, as the native runner computes them between the strip programs
// (strip_layer.h). Plain loops over float arrays, no ExecuTorch: bench/lrn_isa.cpp builds them alone per ISA.
#pragma once

#include <cstddef>
#include <vector>

namespace splitface {

// What the native runner computes between the strip programs, on one strip (O channels of n values each): the
// paper's LRN (PaperLRN.forward, beta 1/2) of its input a = clamp(relu(x), 0, input_max) (0: no clamp), x the
// conv's output: out = a / sqrt(gamma + alpha s), s the sum of a^2 over the channel window [o - r, o + r]
// clamped at the edges; and the backward of that chain to x. The strip release program returns a and x and
// carries these constants as its constant methods (splitface.export.gemm_programs.strip_constants); the
// gradient program starts from the conv's gradient.
class Lrn {
 public:
  int r = 0;
  float alpha = 1, gamma = 2, input_max = 0;
  // The release of the strip: out = LRN(a).
  void forward(const float* a, int O, size_t n, float* out) const;
  // The conv's gradient: out = d/dx sum(LRN(clamp(relu(x))) * g) (gemm_programs.conv_grad), a the clamped x.
  void backward(const float* x, const float* a, const float* g, int O, size_t n, float* out);

 private:
  std::vector<float> inv_, t_;
};

}  // namespace splitface
