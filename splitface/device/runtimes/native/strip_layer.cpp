// See strip_layer.h.
#include "strip_layer.h"

#include <executorch/devtools/etdump/etdump_flatcc.h>

#include <cstring>

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::extension::Module;
using executorch::extension::from_blob;
using executorch::runtime::EValue;

namespace splitface {
namespace {

// A strip program loaded and its buffers allocated; the input of the strip output's shape, if any, is its feature.
StripProgram load_strip(const std::string& path, const std::vector<SizesType>& out_shape, bool profile) {
  StripProgram p;
  p.path = path;
  p.module = load_module(path, profile);
  auto meta = p.module->method_meta("forward");
  if (!meta.ok()) throw StripError("no forward method in " + path);
  for (size_t i = 0; i < meta->num_inputs(); ++i) {
    auto info = meta->input_tensor_meta(i);
    if (!info.ok() || info->scalar_type() != ScalarType::Float) {
      throw StripError(path + ": input " + std::to_string(i) + " is not a float tensor");
    }
    std::vector<SizesType> shape(info->sizes().begin(), info->sizes().end());
    p.buffers.emplace_back(info->nbytes() / sizeof(float));
    p.tensors.push_back(from_blob(p.buffers.back().data(), shape));
    if (i == 0) continue;
    if (shape == out_shape) p.feature = static_cast<int>(i);
    else p.shared.push_back(i);
  }
  return p;
}

// What a program of another format (one from before the runner took the LRN and its backward over) needs.
const std::string kExportAgain =
    "delete it and export the strip programs again (splitface.export.artifacts.write_strip_ptes; an app's folder: "
    "splitface-export --app)";

// A number that a program carries as a constant method (exported with constant_methods).
double constant(Module& m, const std::string& path, const char* name) {
  auto out = m.execute(name);
  if (!out.ok() || out->size() != 1 || !(out->at(0).isInt() || out->at(0).isDouble())) {
    throw StripError(path + " carries no " + name + ": a strip release program of another format; " + kExportAgain);
  }
  return out->at(0).isInt() ? static_cast<double>(out->at(0).toInt()) : out->at(0).toDouble();
}

std::vector<EValue> run(StripProgram& p) {
  std::vector<EValue> args;
  for (auto& t : p.tensors) args.emplace_back(t);
  auto out = p.module->execute("forward", args);
  if (!out.ok()) {
    throw StripError("executing " + p.path + " failed (error " + std::to_string(static_cast<int>(out.error())) + ")");
  }
  return std::move(*out);
}

}  // namespace

std::unique_ptr<Module> load_module(const std::string& path, bool profile) {
  // Mmap: the program's constant data stays in the file's pages (the im2col programs have almost none).
  auto m = std::make_unique<Module>(path, Module::LoadMode::Mmap,
                                    profile ? std::make_unique<executorch::etdump::ETDumpGen>() : nullptr);
  if (m->load_method("forward") != executorch::runtime::Error::Ok) throw StripError("cannot load " + path);
  return m;
}

void accumulate(const std::vector<EValue>& outs, std::vector<std::vector<float>>& sums) {
  sums.resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& g = outs[i].toTensor();
    const float* v = g.const_data_ptr<float>();
    sums[i].resize(g.numel(), 0.0f);
    for (ssize_t k = 0; k < g.numel(); ++k) sums[i][k] += v[k];
  }
}

StripLayer::StripLayer(const std::string& release_pte, const std::string& grad_pte, bool profile) {
  {
    Module probe(release_pte, Module::LoadMode::Mmap);
    auto meta = probe.method_meta("forward");
    if (!meta.ok()) throw StripError("cannot read " + release_pte);
    auto in = meta->input_tensor_meta(0);
    auto out = meta->output_tensor_meta(0);
    if (!in.ok() || !out.ok() || in->sizes().size() != 4 || out->sizes().size() != 4 || in->sizes()[0] != 1 ||
        out->sizes()[0] != 1) {
      throw StripError("a strip program takes and returns one (1, C, rows, width) strip");
    }
    g.C = in->sizes()[1];
    g.O = out->sizes()[1];
    g.R = out->sizes()[2];
    g.W = out->sizes()[3];
    g.kh = in->sizes()[2] - g.R + 1;
    g.kw = in->sizes()[3] - g.W + 1;
    if (g.kh < 1 || g.kw < 1 || g.kh % 2 == 0 || g.kw % 2 == 0) throw StripError("the strip's halo is not a 'same' conv's");
    // The LRN's input and the conv's output (gemm_programs.GemmReleaseProgram(strip=True)), both float strips.
    bool pair = meta->num_outputs() == 2;
    for (size_t i = 0; pair && i < 2; ++i) {
      auto o = meta->output_tensor_meta(i);
      pair = o.ok() && o->scalar_type() == ScalarType::Float &&
             std::vector<SizesType>(o->sizes().begin(), o->sizes().end()) ==
                 std::vector<SizesType>{1, g.O, g.R, g.W};
    }
    if (!pair) {
      throw StripError(release_pte + " does not return the LRN's input and the conv's output as two (1, O, rows, width) "
                       "float strips: a strip release program of another format; " + kExportAgain);
    }
  }
  std::vector<SizesType> out_shape = {1, g.O, g.R, g.W};
  release = load_strip(release_pte, out_shape, profile);
  if (release.feature >= 0) throw StripError("a strip release program takes no per-sample map (the runner draws the noise)");
  double size = constant(*release.module, release_pte, "lrn_size");
  lrn.alpha = static_cast<float>(constant(*release.module, release_pte, "lrn_alpha"));
  lrn.gamma = static_cast<float>(constant(*release.module, release_pte, "lrn_gamma"));
  lrn.input_max = static_cast<float>(constant(*release.module, release_pte, "lrn_input_max"));
  if (size < 1 || size > g.O || !(lrn.gamma > 0) || !(lrn.alpha >= 0) || !(lrn.input_max >= 0)) {
    throw StripError(release_pte + ": an LRN of size " + std::to_string(size) + ", alpha " + std::to_string(lrn.alpha) +
                     ", gamma " + std::to_string(lrn.gamma) + ", input clamp " + std::to_string(lrn.input_max) +
                     " over " + std::to_string(g.O) + " channels");
  }
  lrn.r = static_cast<int>(size) / 2;
  if (!grad_pte.empty()) {
    grad = load_strip(grad_pte, out_shape, profile);
    if (grad.feature < 0) throw StripError(grad.path + " takes no (1, O, rows, width) gradient strip");
    auto mark = grad.module->execute("takes_conv_gradient");  // splitface.export.artifacts.STRIP_GRAD_MARK
    if (!mark.ok() || mark->size() != 1 || !mark->at(0).isInt() || mark->at(0).toInt() != 1) {
      throw StripError(grad.path + " does not take the conv's gradient: a strip gradient program of another format; " +
                       kExportAgain);
    }
    if (grad.shared.size() != release.shared.size()) throw StripError("the release and gradient programs take other weights");
    for (size_t i = 0; i < release.shared.size(); ++i) {
      if (grad.buffers[grad.shared[i]].size() != release.buffers[release.shared[i]].size()) {
        throw StripError("the release and gradient programs' weight " + std::to_string(i) + " differ in size");
      }
    }
  }
}

void StripLayer::set_height(int H) {
  if (H <= 0 || H % g.R != 0) {
    throw StripError("an image height of " + std::to_string(H) + " is not a positive multiple of the strip's " +
                     std::to_string(g.R) + " rows");
  }
  g.H = H;
}

size_t StripLayer::shared_size(size_t i) const { return release.buffers.at(release.shared.at(i)).size(); }

void StripLayer::set_shared(size_t i, const float* data, size_t n) {
  if (i >= shared_count() || n != shared_size(i)) {
    throw StripError("weight " + std::to_string(i) + " of " + std::to_string(n) + " values; the programs take " +
                     (i < shared_count() ? std::to_string(shared_size(i)) : "no such weight"));
  }
  std::memcpy(release.buffers[release.shared[i]].data(), data, n * sizeof(float));
  if (has_grad()) std::memcpy(grad.buffers[grad.shared[i]].data(), data, n * sizeof(float));
}

// The image's rows with the conv's zero halo: (C, H + kh - 1, W + kw - 1), its border zero.
void StripLayer::pad(const float* image) {
  int hp = g.H + g.kh - 1, wp = g.W + g.kw - 1, top = (g.kh - 1) / 2, left = (g.kw - 1) / 2;
  padded_.assign(static_cast<size_t>(g.C) * hp * wp, 0.0f);
  for (int c = 0; c < g.C; ++c)
    for (int y = 0; y < g.H; ++y)
      std::memcpy(&padded_[(static_cast<size_t>(c) * hp + y + top) * wp + left],
                  image + (static_cast<size_t>(c) * g.H + y) * g.W, g.W * sizeof(float));
}

// Strip t of the padded image into a program's first input: rows [t R, t R + R + kh - 1) of every channel.
void StripLayer::cut(int t, float* strip) const {
  int hp = g.H + g.kh - 1, wp = g.W + g.kw - 1, rows = g.R + g.kh - 1;
  for (int c = 0; c < g.C; ++c)
    std::memcpy(strip + static_cast<size_t>(c) * rows * wp, &padded_[(static_cast<size_t>(c) * hp + t * g.R) * wp],
                static_cast<size_t>(rows) * wp * sizeof(float));
}

void StripLayer::release_image(const float* image, const std::function<void(int, const float*)>& emit) {
  if (g.H <= 0) throw StripError("set_height before a release");
  pad(image);
  for (int strip = 0; strip < g.H / g.R; ++strip) {
    cut(strip, release.buffers[0].data());
    auto outs = run(release);  // the LRN's input, and the conv's output
    released_.resize(static_cast<size_t>(g.O) * g.R * g.W);
    lrn.forward(outs.at(0).toTensor().const_data_ptr<float>(), g.O, static_cast<size_t>(g.R) * g.W, released_.data());
    emit(strip, released_.data());
  }
}

void StripLayer::grad_image(const float* image, const float* grad_map, std::vector<std::vector<float>>& sums) {
  if (!has_grad()) throw StripError("no gradient program was loaded");
  if (g.H <= 0) throw StripError("set_height before a gradient");
  pad(image);
  size_t rows = static_cast<size_t>(g.R) * g.W;
  float* feature = grad.buffers[grad.feature].data();
  grad_rows_.resize(static_cast<size_t>(g.O) * rows);
  for (int strip = 0; strip < g.H / g.R; ++strip) {
    cut(strip, release.buffers[0].data());
    auto outs = run(release);  // the LRN's input and the conv's output over the strip, which the backward needs
    for (int o = 0; o < g.O; ++o)
      std::memcpy(&grad_rows_[o * rows], grad_map + static_cast<size_t>(o) * g.H * g.W + strip * rows,
                  rows * sizeof(float));
    lrn.backward(outs.at(1).toTensor().const_data_ptr<float>(), outs.at(0).toTensor().const_data_ptr<float>(),
                 grad_rows_.data(), g.O, rows, feature);
    std::memcpy(grad.buffers[0].data(), release.buffers[0].data(), g.strip_in() * sizeof(float));
    accumulate(run(grad), sums);
  }
}

}  // namespace splitface
