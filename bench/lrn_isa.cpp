// The native runner's LRN and its backward (splitface/device/runtimes/native/lrn.cpp) alone, as built by
// bench/lrn_isa.py for one ISA path, for the tests:
//   lrn_isa <in> <out> <O> <n> <size> <alpha> <gamma> <input_max>
// <in> holds x, a and g, each O x n float32 (the conv's output, the LRN's input clamp(relu(x), 0, input_max) and
// the release's gradient, as the strip layer has them); <out> gets Lrn::forward(a), then Lrn::backward(x, a, g),
// each O x n float32. The constants are read as the runner reads the release program's (doubles cast to float;
// the window's half-width r = size / 2).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lrn.h"

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: lrn_isa IN OUT O N SIZE ALPHA GAMMA INPUT_MAX\n");
    return 2;
  }
  int O = std::atoi(argv[3]);
  size_t n = std::strtoull(argv[4], nullptr, 10), count = static_cast<size_t>(O) * n;
  splitface::Lrn lrn;
  lrn.r = std::atoi(argv[5]) / 2;
  lrn.alpha = static_cast<float>(std::strtod(argv[6], nullptr));
  lrn.gamma = static_cast<float>(std::strtod(argv[7], nullptr));
  lrn.input_max = static_cast<float>(std::strtod(argv[8], nullptr));
  std::vector<float> in(3 * count), out(2 * count);
  std::FILE* f = std::fopen(argv[1], "rb");
  if (!f || std::fread(in.data(), sizeof(float), in.size(), f) != in.size()) {
    std::fprintf(stderr, "cannot read %zu floats from %s\n", in.size(), argv[1]);
    return 1;
  }
  std::fclose(f);
  const float *x = in.data(), *a = x + count, *g = a + count;
  lrn.forward(a, O, n, out.data());
  lrn.backward(x, a, g, O, n, out.data() + count);
  f = std::fopen(argv[2], "wb");
  if (!f || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 1;
  std::fclose(f);
  return 0;
}
