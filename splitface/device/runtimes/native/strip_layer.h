// The device layer on the strip programs (splitface.export.artifacts.export_strip_ptes), in memory: one image at a time,
// cut into strips of R rows with the conv's zero halo, so that every intermediate of XNNPACK's passes stays in
// the core's cache. The conv is local and the LRN per pixel, so the strips' outputs are exactly the image's
// release, and the strips' weight gradients sum to the image's. Shared by the runner (splitface_native.cpp,
// which streams images and maps from files) and the JNI library (splitface_jni.cpp, Java arrays).
#pragma once

#include "lrn.h"

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace splitface {

// A bad program, input or call: the runner prints it and exits 2; the JNI library throws it into Java.
struct StripError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Geometry {
  int C = 0, H = 0, W = 0, O = 0, R = 0, kh = 0, kw = 0;
  size_t image() const { return static_cast<size_t>(C) * H * W; }
  size_t map() const { return static_cast<size_t>(O) * H * W; }
  size_t strip_in() const { return static_cast<size_t>(C) * (R + kh - 1) * (W + kw - 1); }
};

// One strip program's forward method, loaded, with a buffer per input: input 0 the padded strip
// (1, C, R + kh - 1, W + kw - 1); `feature` the input of the strip output's shape (1, O, R, W), the conv's
// gradient over the strip (the gradient program's; `Lrn::backward` makes it from the server's), if any; the
// others are shared by every strip (the weights, in `shared` order).
struct StripProgram {
  std::string path;
  std::unique_ptr<executorch::extension::Module> module;
  std::vector<std::vector<float>> buffers;
  std::vector<executorch::extension::TensorPtr> tensors;
  std::vector<size_t> shared;
  int feature = -1;
};

// A program's forward method loaded (memory-mapped; with an ETDump event tracer when `profile`).
std::unique_ptr<executorch::extension::Module> load_module(const std::string& path, bool profile);

// Adds a program's outputs into `sums` (the loss is a sum over samples and strips, so are the gradients).
void accumulate(const std::vector<executorch::runtime::EValue>& outs, std::vector<std::vector<float>>& sums);

class StripLayer {
 public:
  // The release program and the weight-gradient program (empty: none); the geometry from the release
  // program's strip input and output. `profile`: load both with an ETDump event tracer.
  StripLayer(const std::string& release_pte, const std::string& grad_pte, bool profile = false);

  Geometry g;  // H: the images' height, set_height's
  Lrn lrn;     // its constants from the release program's constant methods
  StripProgram release, grad;
  bool has_grad() const { return grad.module != nullptr; }

  // The images' height for the next calls: a multiple of the strip's rows.
  void set_height(int H);
  // Shared input i of both programs (the i-th weight): exactly its size in floats, else StripError.
  size_t shared_count() const { return release.shared.size(); }
  size_t shared_size(size_t i) const;
  void set_shared(size_t i, const float* data, size_t n);

  // One image (C, H, W)'s release, strip by strip: emit(strip, out), out the strip's (O, R, W) output, valid
  // during the call.
  void release_image(const float* image, const std::function<void(int, const float*)>& emit);
  // Adds one image's weight gradient, given its (O, H, W) gradient map, into `sums` (one per program output).
  void grad_image(const float* image, const float* grad_map, std::vector<std::vector<float>>& sums);

 private:
  void pad(const float* image);
  void cut(int strip, float* out) const;
  std::vector<float> padded_, released_, grad_rows_;
};

}  // namespace splitface
