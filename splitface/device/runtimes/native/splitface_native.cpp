// splitface_native: the device layer's release and weight gradient through ExecuTorch's C++ runtime, with
// no Python and no libtorch in the process: what a phone app links (libexecutorch, the optimized kernels,
// the XNNPACK delegate). It runs the im2col programs (splitface/export/gemm_programs.py) over a batch of N samples
// in chunks of the programs' batch size B, streaming each chunk's inputs in from files and its release
// out, so a device holding batch-1 programs never has a whole batch's activations in memory.
//
//   splitface_native --dir D --samples N [--runs R] [--warmup W] [--threads 1|all]
//       --release release_gemm.pte:images,noise,weight,bias     (outputs: one batched tensor, written out)
//       --grad vjp_gemm.pte:images,grad,weight,bias             (outputs: summed over the chunks)
//
//   splitface_native --dir D --samples N --strips [--noise-std S [--noise-key K]] ...
//       --release release_strip.pte:images,weight,bias          (one padded strip of rows in, its rows out)
//       --grad vjp_strip.pte:images,grad,weight,bias
//
// Each input name is the file D/<name>.f32 (float32, C order): a per-sample input holds N/B chunks of
// the program's input shape, a shared one (the weights) exactly one. Outputs: D/release.f32 (N samples)
// and D/grad_<i>.f32 (output i of the gradient program, summed). One JSON object on stdout: times per run
// (the programs' execute calls alone, and with the chunks' file reads and writes) and the process's
// resident set size after each step and its high-water mark, from /proc/self/status.
//
// --strips: the strip programs (GemmReleaseProgram/GemmWeightGrad with strip=True) take a few rows of one
// image with the conv's zero halo; the runner cuts each image into such strips, so that every intermediate
// of the programs fits in the core's cache; between the programs it applies the LRN to each strip and, for the
// weight gradient, makes the conv's gradient from each strip's rows of the server's gradient (strip_layer.h). The
// images' height comes from the file's size, the strip's rows and width from the program's output.
// --noise-std S: the runner draws the release's noise itself, N(0, S^2) per value from ChaCha8 under a fresh
// key from the OS CSPRNG per release (gaussian_noise.h); with --strips it is added to each strip's output
// while that is in cache, otherwise it fills the program's input named "noise". --noise-key K: a 32-byte key
// file instead (tests and replays only). Without --noise-std a "noise" input is read from its file.
// --noise-discrete P/Q --quant-step S --clip-steps B (with --strips): the exact option instead
// (discrete_gaussian.h): each sample's map, once complete, clipped to B steps of S and quantised, plus N_Z(0, P/Q)
// in integer arithmetic from ChaCha20 under a fresh key per release (or --noise-key's), written as int8 to
// D/release.i8. Test hooks: --draw-discrete N, --draw-uniform BOUND,N and --draw-reads N write the stream's first
// integers.
// --noise-in NAME (with --strips): the release's noise read from D/NAME.f32 (N maps, the caller's) and added to
// each strip's rows as they are copied out, instead of drawn.
//
//   splitface_native --serve --strips --dir D --noise-in noise --release ... --grad ...
//
// --serve: the programs stay loaded and the runner answers requests, one line each on stdin, "release N" or
// "grad N": it reads that request's N images (and noise or server gradient) and the weights from D as they are
// then, writes D/release.f32 or D/grad_<i>.f32 and one JSON line on stdout; end of input ends it. A bad request
// or input stops it as above (message on stderr, exit 2). splitface/device/runtimes/native_runtime.py drives it.
//
//   splitface_native --serve --strips --dir D --noise-std S --noise-key K ...
//   splitface_native --serve --strips --dir D --noise-discrete P/Q --quant-step S --clip-steps B --noise-key K ...
//
// --serve with drawn noise (the float option, or the exact one): each release's ChaCha key is the caller's
// (its per-release key), read from the file K the caller wrote for that request and removed once read; never
// a fresh OS key, so a replayed release under the same key repeats its noise exactly. The exact option writes
// D/release.i8. The output file is rewritten in place, not truncated, so its pages stay allocated between requests.
// --etdump PREFIX: record every run with ExecuTorch's ETDump (each operator's time, XNNPACK's inside its
// delegate call included) into PREFIX.release.etdp and PREFIX.grad.etdp, for the devtools Inspector.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/extension/threadpool/threadpool_guard.h>

#include <executorch/devtools/etdump/etdump_flatcc.h>

#include "discrete_gaussian.h"
#include "gaussian_noise.h"
#include "strip_layer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using executorch::aten::SizesType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::from_blob;
using executorch::runtime::EValue;

namespace {

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "splitface_native: %s\n", why.c_str());
  std::exit(2);
}

long status_kb(const char* key) {  // a line of /proc/self/status, in kB
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
  }
  return -1;
}

// The process's own high-water mark. Not getrusage's ru_maxrss: Linux carries that over fork and exec, so
// a runner started by a large parent would report the parent's peak.
long peak_kb() { return status_kb("VmHWM:"); }

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, sep)) out.push_back(part);
  return out;
}

// One program input: a file of float32, read whole (shared) or a chunk at a time (per sample).
struct Input {
  std::string name;
  int fd = -1;
  std::vector<SizesType> shape;
  size_t chunk_floats = 0;
  bool per_sample = false;
  bool drawn = false;  // the noise, drawn by the runner instead of read
  std::vector<float> buffer;
  TensorPtr tensor;
};

struct Program {
  std::string path;
  std::unique_ptr<Module> module;
  std::vector<Input> inputs;
  int batch = 0;
};

struct Noise {
  bool on = false;  // the float option, drawn (--noise-std)
  float std = 0;
  std::optional<splitface::DiscreteGaussian> discrete;  // the exact option (--noise-discrete), with strips
  double step = 0;     // its public quantisation step (--quant-step)
  int64_t bound = 0;   // its clip norm in steps (--clip-steps)
  std::string key_file;
  splitface::NoiseKey key{};
  void rekey() { key = key_file.empty() ? splitface::fresh_key() : splitface::key_from_file(key_file.c_str()); }
};

bool g_profile = false;  // --etdump: load every program with an ETDump event tracer

// The ETDump a program's runs recorded, written to `path` (nothing without --etdump).
void write_etdump(Module& m, const std::string& path) {
  auto* gen = static_cast<executorch::etdump::ETDumpGen*>(m.event_tracer());
  if (gen == nullptr) return;
  auto data = gen->get_etdump_data();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data.buf, 1, data.size, f) != data.size) fail("cannot write " + path);
  std::fclose(f);
  std::free(data.buf);
}

int open_fd(const std::string& file) {
  int fd = open(file.c_str(), O_RDONLY);
  if (fd < 0) fail("cannot open " + file);
  return fd;
}

size_t file_bytes(int fd) {
  struct stat st{};
  fstat(fd, &st);
  return static_cast<size_t>(st.st_size);
}

struct InputMeta {
  std::vector<SizesType> shape;
  size_t nbytes = 0;
};

// A program named on the command line as PATH:input,input,...: its path and one name per input.
std::pair<std::string, std::vector<std::string>> named_path(const std::string& spec) {
  auto colon = spec.rfind(':');
  if (colon == std::string::npos) fail("a program is PATH:input,input,...; got " + spec);
  return {spec.substr(0, colon), split(spec.substr(colon + 1), ',')};
}

// A program named on the command line as PATH:input,input,...: loaded, with one name for each input of its
// forward method, every input a float tensor.
struct NamedProgram {
  std::string path;
  std::unique_ptr<Module> module;
  std::vector<std::string> names;
  std::vector<InputMeta> inputs;
};

NamedProgram open_named(const std::string& spec) {
  NamedProgram p;
  std::tie(p.path, p.names) = named_path(spec);
  p.module = splitface::load_module(p.path, g_profile);
  auto meta = p.module->method_meta("forward");
  if (!meta.ok()) fail("no forward method in " + p.path);
  if (p.names.size() != meta->num_inputs()) {
    fail(p.path + " takes " + std::to_string(meta->num_inputs()) + " inputs; " + std::to_string(p.names.size()) +
         " named");
  }
  for (size_t i = 0; i < p.names.size(); ++i) {
    auto info = meta->input_tensor_meta(i);
    if (!info.ok() || info->scalar_type() != executorch::aten::ScalarType::Float) {
      fail(p.path + ": input " + std::to_string(i) + " is not a float tensor");
    }
    p.inputs.push_back({std::vector<SizesType>(info->sizes().begin(), info->sizes().end()), info->nbytes()});
  }
  return p;
}

Program open_program(const std::string& spec, const std::string& dir, int samples, bool draw_noise) {
  NamedProgram named = open_named(spec);
  Program p;
  p.path = named.path;
  p.module = std::move(named.module);
  for (size_t i = 0; i < named.names.size(); ++i) {
    const InputMeta& info = named.inputs[i];
    Input in;
    in.name = named.names[i];
    in.shape = info.shape;
    in.chunk_floats = info.nbytes / sizeof(float);
    if (i == 0) p.batch = in.shape.at(0);
    in.buffer.resize(in.chunk_floats);
    in.tensor = from_blob(in.buffer.data(), in.shape);
    if (draw_noise && in.name == "noise") {
      in.drawn = in.per_sample = true;
      p.inputs.push_back(std::move(in));
      continue;
    }
    std::string file = dir + "/" + in.name + ".f32";
    in.fd = open_fd(file);
    size_t bytes = file_bytes(in.fd);
    if (bytes == info.nbytes) {
      in.per_sample = false;
    } else if (p.batch > 0 && samples % p.batch == 0 && bytes == info.nbytes * (samples / p.batch)) {
      in.per_sample = true;
    } else {
      fail(file + " holds " + std::to_string(bytes) + " bytes: neither one input of " +
           std::to_string(info.nbytes) + " bytes nor " + std::to_string(samples) + " samples of them");
    }
    p.inputs.push_back(std::move(in));
  }
  if (samples % p.batch != 0) fail(std::to_string(samples) + " samples is not a multiple of the batch " +
                                   std::to_string(p.batch) + " of " + p.path);
  return p;
}

void read_chunk(Input& in, size_t chunk, bool first, const Noise& noise) {
  if (!in.per_sample && !first) return;  // shared inputs are read once
  if (in.drawn) {
    splitface::add_gaussian(in.buffer.data(), nullptr, in.chunk_floats, chunk * in.chunk_floats, noise.key, noise.std);
    return;
  }
  size_t bytes = in.chunk_floats * sizeof(float);
  off_t offset = in.per_sample ? static_cast<off_t>(chunk * bytes) : 0;
  if (pread(in.fd, in.buffer.data(), bytes, offset) != static_cast<ssize_t>(bytes)) {
    fail("short read of " + in.name);
  }
}

std::vector<EValue> run(Program& p) {
  std::vector<EValue> args;
  for (auto& in : p.inputs) args.emplace_back(in.tensor);
  auto out = p.module->execute("forward", args);
  if (!out.ok()) fail("executing " + p.path + " failed (error " + std::to_string(static_cast<int>(out.error())) + ")");
  return std::move(*out);
}

struct Times {
  std::vector<double> compute_ms, total_ms, noise_ms;
};

// The release over all samples: each chunk read, run, and its release written to D/release.f32 (last run).
void release_pass(Program& p, int samples, int out_fd, bool write, Noise& noise, Times& t) {
  double compute = 0, drawing = 0, start = now_ms();
  size_t chunks = samples / p.batch;
  if (noise.on) noise.rekey();  // one key per release
  for (size_t c = 0; c < chunks; ++c) {
    for (auto& in : p.inputs) {
      double t0 = now_ms();
      read_chunk(in, c, c == 0, noise);
      if (in.drawn) drawing += now_ms() - t0;
    }
    double t0 = now_ms();
    auto outs = run(p);
    compute += now_ms() - t0;
    const auto& r = outs.at(0).toTensor();
    if (write && pwrite(out_fd, r.const_data_ptr<float>(), r.nbytes(), static_cast<off_t>(c * r.nbytes())) !=
                     static_cast<ssize_t>(r.nbytes())) {
      fail("cannot write the release");
    }
  }
  t.compute_ms.push_back(compute + drawing);
  t.noise_ms.push_back(drawing);
  t.total_ms.push_back(now_ms() - start);
}

// The weight gradient over all samples: the chunks' gradients summed (the loss is a sum over samples).
std::vector<std::vector<float>> grad_pass(Program& p, int samples, Times& t) {
  double compute = 0, start = now_ms();
  std::vector<std::vector<float>> sums;
  size_t chunks = samples / p.batch;
  for (size_t c = 0; c < chunks; ++c) {
    for (auto& in : p.inputs) read_chunk(in, c, c == 0, Noise{});
    double t0 = now_ms();
    splitface::accumulate(run(p), sums);
    compute += now_ms() - t0;
  }
  t.compute_ms.push_back(compute);
  t.total_ms.push_back(now_ms() - start);
  return sums;
}

// ---- strips: one image at a time, cut into strips of R rows with the conv's halo ----

void pread_all(int fd, float* dst, size_t floats, size_t offset_floats, const std::string& what) {
  size_t bytes = floats * sizeof(float);
  if (pread(fd, dst, bytes, static_cast<off_t>(offset_floats * sizeof(float))) != static_cast<ssize_t>(bytes)) {
    fail("short read of " + what);
  }
}

// One channel's plane of a sample's release map as the strips fill it: its values, how many, where its noise
// starts in the release's stream, and how far the noise has reached.
struct Plane {
  float* map;
  size_t size;
  uint64_t first;
  size_t noised = 0;
};

// Copies a strip's values [a, b) of a plane from `rows` into the map, with their noise, drawn in whole groups of
// the stream (kNoiseGroup values) so that none is drawn twice: a strip's rows seldom end on a group (4 rows of
// 224 px are 3.5 groups), so the values of a group that the strip leaves unfinished wait in the map without
// their noise, and the strip that finishes the group noises them in place, still in cache.
void copy_noised(const Noise& noise, Plane& p, const float* rows, size_t a, size_t b) {
  constexpr uint64_t G = splitface::kNoiseGroup;
  size_t end = b;  // the noise reaches here: b, or the last group start before it while the plane is unfinished
  if (b < p.size) {
    uint64_t cut = (p.first + b) / G * G;
    end = cut > p.first + p.noised ? static_cast<size_t>(cut - p.first) : p.noised;
  }
  if (p.noised < a) {  // the waiting values [noised, a) and this strip's part of their group, noised in place
    size_t upto = std::min(end, static_cast<size_t>(((p.first + p.noised) / G + 1) * G - p.first));
    if (upto > p.noised) {
      std::memcpy(p.map + a, rows, (upto - a) * sizeof(float));
      splitface::add_gaussian(p.map + p.noised, p.map + p.noised, upto - p.noised, p.first + p.noised, noise.key,
                              noise.std);
      p.noised = upto;
    }
  }
  if (end > p.noised) {  // whole groups (and the plane's last part) from the strip
    splitface::add_gaussian(p.map + p.noised, rows + (p.noised - a), end - p.noised, p.first + p.noised, noise.key,
                            noise.std);
    p.noised = end;
  }
  size_t raw = std::max(p.noised, a);  // the strip's part of an unfinished group, without its noise yet
  std::memcpy(p.map + raw, rows + (raw - a), (b - raw) * sizeof(float));
}

// The runner around the in-memory strip layer (strip_layer.h): each request's images (and noise, or the
// server's gradient) streamed in from files one sample at a time, its release or weight gradient out.
struct StripRunner {
  std::unique_ptr<splitface::StripLayer> layer;
  std::vector<std::string> release_names, grad_names;  // each program's inputs' file names, from the command line
  int image_fd = -1, grad_fd = -1, samples = 0;
  std::string noise_in;  // --noise-in NAME: the release's noise read from D/NAME.f32 (N maps), added per strip
  int noise_fd = -1;
  std::vector<float> image, map, noise_map;  // one sample's image, release or gradient map, and read noise
  std::vector<int64_t> quantised;  // --noise-discrete: one sample's release in steps, and its int8 release
  std::vector<int8_t> integers;

  const splitface::Geometry& g() const { return layer->g; }
  bool has_grad() const { return layer->has_grad(); }

  // --noise-discrete: the finished map clipped, quantised and noised from `stream` (one per release, read in
  // order over the samples) into `integers`.
  void exact_noise(const Noise& noise, splitface::KeyStream& stream) {
    quantised.resize(g().map());
    integers.resize(g().map());
    splitface::clip_quantise(map.data(), g().map(), noise.step, noise.bound, quantised.data());
    splitface::add_discrete(quantised.data(), g().map(), *noise.discrete, stream, integers.data());
  }

  // Sample `s`'s release into the output file: float32, or int8 with --noise-discrete.
  void write_sample(int out_fd, int s, bool exact) {
    const void* data = exact ? static_cast<const void*>(integers.data()) : map.data();
    size_t bytes = exact ? g().map() : g().map() * sizeof(float);
    if (pwrite(out_fd, data, bytes, static_cast<off_t>(s * bytes)) != static_cast<ssize_t>(bytes)) {
      fail("cannot write the release");
    }
  }

  void load_image(int s) { pread_all(image_fd, image.data(), g().image(), s * g().image(), "images"); }

  // The release of every sample, strip by strip, the noise drawn into each strip's rows as they are copied out.
  void release_pass(int out_fd, bool write, Noise& noise, Times& t) {
    double compute = 0, drawing = 0, start = now_ms();
    if (noise.on || noise.discrete) noise.rekey();  // one key per release
    std::optional<splitface::KeyStream> stream;
    if (noise.discrete) stream.emplace(noise.key);
    const splitface::Geometry& geo = g();
    size_t rows = static_cast<size_t>(geo.R) * geo.W, plane = static_cast<size_t>(geo.H) * geo.W;
    std::vector<Plane> planes(geo.O);
    for (int s = 0; s < samples; ++s) {
      load_image(s);
      if (noise_fd >= 0) pread_all(noise_fd, noise_map.data(), geo.map(), s * geo.map(), noise_in);
      for (int o = 0; o < geo.O; ++o) planes[o] = {&map[o * plane], plane, s * geo.map() + o * plane};
      double t0 = now_ms();
      layer->release_image(image.data(), [&](int strip, const float* out) {
        double t1 = now_ms();
        for (int o = 0; o < geo.O; ++o) {
          size_t at = static_cast<size_t>(o) * plane + strip * rows;
          if (noise.on) {
            copy_noised(noise, planes[o], out + o * rows, strip * rows, (strip + 1) * rows);
          } else if (noise_fd >= 0) {
            for (size_t k = 0; k < rows; ++k) map[at + k] = out[o * rows + k] + noise_map[at + k];
          } else {
            std::memcpy(&map[at], out + o * rows, rows * sizeof(float));
          }
        }
        if (noise.on) drawing += now_ms() - t1;
      });
      if (noise.discrete) {  // the exact noise needs the whole image's norm: drawn once its map is complete
        double t1 = now_ms();
        exact_noise(noise, *stream);
        drawing += now_ms() - t1;
      }
      compute += now_ms() - t0;
      if (write) write_sample(out_fd, s, noise.discrete.has_value());
    }
    t.compute_ms.push_back(compute);
    t.noise_ms.push_back(drawing);
    t.total_ms.push_back(now_ms() - start);
  }

  // The weight gradient: each strip's, with the strip's rows of the server's gradient, summed.
  std::vector<std::vector<float>> grad_pass(Times& t) {
    double compute = 0, start = now_ms();
    std::vector<std::vector<float>> sums;
    for (int s = 0; s < samples; ++s) {
      load_image(s);
      pread_all(grad_fd, map.data(), g().map(), s * g().map(), grad_names[layer->grad.feature]);
      double t0 = now_ms();
      layer->grad_image(image.data(), map.data(), sums);
      compute += now_ms() - t0;
    }
    t.compute_ms.push_back(compute);
    t.total_ms.push_back(now_ms() - start);
    return sums;
  }
};

// The strip programs loaded; the files are read by `bind_strips`.
StripRunner load_strips(const std::string& release_spec, const std::string& grad_spec) {
  StripRunner r;
  auto [release_path, release_names] = named_path(release_spec);
  std::string grad_path;
  if (!grad_spec.empty()) std::tie(grad_path, r.grad_names) = named_path(grad_spec);
  r.release_names = release_names;
  r.layer = std::make_unique<splitface::StripLayer>(release_path, grad_path, g_profile);
  auto check = [](const splitface::StripProgram& p, const std::vector<std::string>& names) {
    if (names.size() != p.buffers.size()) {
      fail(p.path + " takes " + std::to_string(p.buffers.size()) + " inputs; " + std::to_string(names.size()) + " named");
    }
  };
  check(r.layer->release, r.release_names);
  if (r.has_grad()) {
    check(r.layer->grad, r.grad_names);
    for (size_t i = 0; i < r.layer->shared_count(); ++i) {
      if (r.release_names[r.layer->release.shared[i]] != r.grad_names[r.layer->grad.shared[i]]) {
        fail("the release and gradient programs take the same weights, in the same order");
      }
    }
  }
  return r;
}

// `samples` images from D/<images>.f32 (their height from its size), the weights as they are in `dir` now, and
// the noise or the server's gradient opened.
void bind_strips(StripRunner& r, const std::string& dir, int samples, bool release, bool grad) {
  r.samples = samples;
  splitface::StripLayer& layer = *r.layer;
  for (size_t i = 0; i < layer.shared_count(); ++i) {  // the weights, re-read with every request
    std::string file = dir + "/" + r.release_names[layer.release.shared[i]] + ".f32";
    int fd = open_fd(file);
    size_t nbytes = layer.shared_size(i) * sizeof(float);
    if (file_bytes(fd) != nbytes) {
      fail(file + " holds " + std::to_string(file_bytes(fd)) + " bytes; the shared input takes " + std::to_string(nbytes));
    }
    std::vector<float> weight(layer.shared_size(i));
    pread_all(fd, weight.data(), weight.size(), 0, file);
    close(fd);
    layer.set_shared(i, weight.data(), weight.size());
  }
  std::string file = dir + "/" + r.release_names[0] + ".f32";
  if (r.image_fd >= 0) close(r.image_fd);
  r.image_fd = open_fd(file);
  const splitface::Geometry& g = layer.g;
  size_t per_row = static_cast<size_t>(samples) * g.C * g.W * sizeof(float);
  size_t bytes = file_bytes(r.image_fd);
  if (bytes % per_row != 0 || bytes / per_row % g.R != 0 || bytes == 0) {
    fail(file + " holds " + std::to_string(bytes) + " bytes: not " + std::to_string(samples) + " images of " +
         std::to_string(g.C) + " x H x " + std::to_string(g.W) + " with H a multiple of " + std::to_string(g.R));
  }
  layer.set_height(static_cast<int>(bytes / per_row));
  const size_t maps = samples * g.map() * sizeof(float);
  auto open_maps = [&](int& fd, const std::string& name) {
    if (fd >= 0) close(fd);
    fd = open_fd(dir + "/" + name + ".f32");
    if (file_bytes(fd) != maps) {
      fail(name + ".f32 holds " + std::to_string(file_bytes(fd)) + " bytes; " + std::to_string(samples) +
           " maps of " + std::to_string(g.map() * sizeof(float)) + " expected");
    }
  };
  if (grad) open_maps(r.grad_fd, r.grad_names[layer.grad.feature]);
  if (release && !r.noise_in.empty()) {
    open_maps(r.noise_fd, r.noise_in);
    r.noise_map.resize(g.map());
  }
  r.image.resize(g.image());
  r.map.resize(g.map());
}

void write_grads(const std::string& dir, const std::vector<std::vector<float>>& sums) {
  for (size_t i = 0; i < sums.size(); ++i) {
    std::string path = dir + "/grad_" + std::to_string(i) + ".f32";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(sums[i].data(), sizeof(float), sums[i].size(), f) != sums[i].size()) {
      fail("cannot write " + path);
    }
    std::fclose(f);
  }
}

// --serve: the strip programs stay loaded and answer one request per line on stdin, "release N" or "grad N",
// reading that request's N images (and noise, or server gradient) and the weights from D as they are now, and
// writing D/release.f32 or D/grad_<i>.f32 before one JSON line on stdout. End of input ends the process.
// D/release.f32, or D/release.i8 for the exact option's integers.
std::string release_path(const std::string& dir, const Noise& noise) {
  return dir + (noise.discrete ? "/release.i8" : "/release.f32");
}

int serve(StripRunner& r, const std::string& dir, Noise& noise) {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream request(line);
    std::string op;
    int samples = 0;
    if (!(request >> op >> samples) || samples <= 0 || (op != "release" && op != "grad") ||
        (op == "grad" && !r.has_grad())) {
      fail("a request is \"release N\" or \"grad N\" (with --grad), got \"" + line + "\"");
    }
    bool release = op == "release";
    bind_strips(r, dir, samples, release, !release);
    Times t;
    if (release) {
      // A drawn noise's key is the request's: written by the caller before each release and consumed here, so
      // a release never reuses an earlier request's key and a replay with the same key repeats its noise.
      bool keyed = noise.on || noise.discrete;
      if (keyed && access(noise.key_file.c_str(), R_OK) != 0) {
        fail(std::string(noise.discrete ? "an exact" : "a noisy") + " release needs its key in " + noise.key_file +
             ": none was written for this request");
      }
      std::string out_path = release_path(dir, noise);
      int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT, 0644);  // no O_TRUNC: the pages are reused
      size_t per_sample = noise.discrete ? r.g().map() : r.g().map() * sizeof(float);
      if (out_fd < 0 || ftruncate(out_fd, static_cast<off_t>(samples * per_sample)) != 0) {
        fail("cannot create " + out_path);
      }
      r.release_pass(out_fd, true, noise, t);
      close(out_fd);
      if (keyed) unlink(noise.key_file.c_str());
    } else {
      write_grads(dir, r.grad_pass(t));
    }
    std::printf("{\"op\": \"%s\", \"samples\": %d, \"height\": %d, \"compute_ms\": %g, \"noise_ms\": %g, "
                "\"total_ms\": %g, \"peak_kb\": %ld}\n", op.c_str(), samples, r.g().H, t.compute_ms[0],
                t.noise_ms.empty() ? 0.0 : t.noise_ms[0], t.total_ms[0], peak_kb());
    std::fflush(stdout);
  }
  return 0;
}

// --noise-discrete P/Q: the exact option's sigma^2 in steps^2, an exact fraction (discrete.py's `sigma2_steps`).
splitface::DiscreteGaussian parse_sigma2(const std::string& text) {
  auto parts = split(text, '/');
  char* end = nullptr;
  uint64_t num = parts.empty() ? 0 : std::strtoull(parts[0].c_str(), &end, 10);
  uint64_t den = 1;
  if (parts.size() == 2 && end != nullptr && *end == '\0') den = std::strtoull(parts[1].c_str(), &end, 10);
  if (parts.empty() || parts.size() > 2 || end == nullptr || *end != '\0' || num == 0 || den == 0) {
    fail("--noise-discrete takes sigma^2 in steps^2 as P or P/Q (positive integers), got \"" + text + "\"");
  }
  return splitface::DiscreteGaussian(num, den);
}

// Test hooks: --draw-discrete N writes N samples of --noise-discrete's N_Z(0, sigma2) to D/discrete.i64,
// --draw-uniform BOUND,N N integers below BOUND to D/uniform.i64, and --draw-reads N the stream's first N
// reads cycling through bit, word64, word32, byte, byte to D/reads.u64 (15 bytes a cycle, so over 1024 cycles
// a word straddles the buffer's refill at every offset), under --noise-key's key (else a fresh one), from the
// stream's start; a release with the same key draws the same discrete samples in the same order.
struct Draws {
  long long discrete = 0, reads = 0;
  std::string uniform;
  bool any() const { return discrete > 0 || reads > 0 || !uniform.empty(); }
};

uint64_t mixed_read(splitface::KeyStream& stream, long long i) {
  switch (i % 5) {
    case 0: return stream.bit();
    case 1: return stream.word64();
    case 2: return stream.word32();
    default: return stream.byte();
  }
}

int draw_integers(const std::string& dir, Noise& noise, const Draws& draws) {
  noise.rekey();
  splitface::KeyStream stream(noise.key);
  std::vector<int64_t> out;
  std::string name;
  if (draws.discrete > 0) {
    if (!noise.discrete) fail("--draw-discrete needs --noise-discrete");
    for (long long i = 0; i < draws.discrete; ++i) out.push_back(noise.discrete->sample(stream));
    name = "/discrete.i64";
  } else if (draws.reads > 0) {
    for (long long i = 0; i < draws.reads; ++i) out.push_back(static_cast<int64_t>(mixed_read(stream, i)));
    name = "/reads.u64";
  } else {
    auto parts = split(draws.uniform, ',');
    if (parts.size() != 2) fail("--draw-uniform takes BOUND,N");
    uint64_t bound = std::strtoull(parts[0].c_str(), nullptr, 10);
    long long n = std::atoll(parts[1].c_str());
    for (long long i = 0; i < n; ++i) out.push_back(static_cast<int64_t>(stream.uniform_below(bound)));
    name = "/uniform.i64";
  }
  std::FILE* f = std::fopen((dir + name).c_str(), "wb");
  if (!f || std::fwrite(out.data(), sizeof(int64_t), out.size(), f) != out.size()) fail("cannot write " + dir + name);
  std::fclose(f);
  return 0;
}

std::string json_list(const std::vector<double>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  return s.str() + "]";
}

}  // namespace

int run_main(int argc, char** argv) {
  std::string dir, release_spec, grad_spec, threads = "1";
  int samples = 0, runs = 3, warmup = 1;
  bool strips = false, serving = false;
  std::string noise_in, discrete_sigma2;
  Draws draws;
  Noise noise;
  std::string etdump;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") dir = value();
    else if (a == "--samples") samples = std::atoi(value().c_str());
    else if (a == "--runs") runs = std::atoi(value().c_str());
    else if (a == "--warmup") warmup = std::atoi(value().c_str());
    else if (a == "--threads") threads = value();
    else if (a == "--release") release_spec = value();
    else if (a == "--grad") grad_spec = value();
    else if (a == "--strips") strips = true;
    else if (a == "--noise-std") {
      const std::string text = value();
      char* end = nullptr;
      noise.on = true;
      noise.std = std::strtof(text.c_str(), &end);
      if (text.empty() || *end != '\0') fail("--noise-std must be a number >= 0, got \"" + text + "\"");
    }
    else if (a == "--noise-key") noise.key_file = value();
    else if (a == "--noise-in") noise_in = value();
    else if (a == "--noise-discrete") discrete_sigma2 = value();
    else if (a == "--quant-step") noise.step = std::strtod(value().c_str(), nullptr);
    else if (a == "--clip-steps") noise.bound = std::atoll(value().c_str());
    else if (a == "--draw-discrete") draws.discrete = std::atoll(value().c_str());
    else if (a == "--draw-uniform") draws.uniform = value();
    else if (a == "--draw-reads") draws.reads = std::atoll(value().c_str());
    else if (a == "--serve") serving = true;
    else if (a == "--etdump") etdump = value();
    else fail("unknown argument " + a);
  }
  if (!discrete_sigma2.empty()) noise.discrete.emplace(parse_sigma2(discrete_sigma2));
  if (!dir.empty() && draws.any()) {
    return draw_integers(dir, noise, draws);
  }
  if (dir.empty() || (samples <= 0 && !serving) || release_spec.empty() || runs <= 0 || warmup < 0) {
    fail("usage: splitface_native --dir D (--samples N | --serve) --release P:inputs [--grad P:inputs] [--strips] "
         "[--noise-std S [--noise-key K] | --noise-in NAME] [--etdump PREFIX] [--runs R] [--warmup W] "
         "[--threads 1|all]");
  }
  if (!strips && (serving || !noise_in.empty())) fail("--serve and --noise-in need --strips");
  if (serving && (noise.on || noise.discrete) && noise.key_file.empty()) {
    fail("--serve with --noise-std or --noise-discrete needs --noise-key K: each release's key, written by the "
         "caller per request");
  }
  if (noise.on + noise.discrete.has_value() + !noise_in.empty() > 1) {
    fail("the noise is drawn (--noise-std), drawn exactly (--noise-discrete) or read (--noise-in): one of them");
  }
  if (noise.discrete && (!strips || !(noise.step > 0) || noise.bound < 1)) {
    fail("--noise-discrete needs --strips, --quant-step S > 0 and --clip-steps B >= 1");
  }
  if (threads != "1" && threads != "all") fail("--threads is 1 or all (the runtime's pool, one per core)");
  g_profile = !etdump.empty();
  if (!noise.key_file.empty() && !noise.on && !noise.discrete) fail("--noise-key needs --noise-std or --noise-discrete");
  if (noise.on && !(noise.std >= 0.0f)) fail("--noise-std must be a number >= 0");
  // One thread: XNNPACK gets no thread pool and runs on the calling thread.
  std::unique_ptr<executorch::extension::threadpool::NoThreadPoolGuard> single;
  if (threads == "1") single = std::make_unique<executorch::extension::threadpool::NoThreadPoolGuard>();

  long rss_start = status_kb("VmRSS:");
  bool has_grad = !grad_spec.empty();
  Program release, grad;
  StripRunner striped;
  if (strips) {
    striped = load_strips(release_spec, grad_spec);
    striped.noise_in = noise_in;
    if (serving) return serve(striped, dir, noise);
    bind_strips(striped, dir, samples, true, has_grad);
  } else {
    release = open_program(release_spec, dir, samples, noise.on);
    if (noise.on && std::none_of(release.inputs.begin(), release.inputs.end(), [](const Input& in) { return in.drawn; })) {
      fail(release.path + " has no input named noise to draw");
    }
    if (has_grad) grad = open_program(grad_spec, dir, samples, false);
  }
  long rss_loaded = status_kb("VmRSS:"), peak_loaded = peak_kb();

  std::string out_path = release_path(dir, noise);
  int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out_fd < 0) fail("cannot create " + out_path);
  Times fwd, bwd;
  std::vector<std::vector<float>> sums;
  long peak_forward = 0;
  for (int r = 0; r < warmup + runs; ++r) {
    bool last = r == warmup + runs - 1;
    if (strips) striped.release_pass(out_fd, last, noise, fwd);
    else release_pass(release, samples, out_fd, last, noise, fwd);
    if (r == 0) peak_forward = peak_kb();  // before any gradient program ran
    if (has_grad) sums = strips ? striped.grad_pass(bwd) : grad_pass(grad, samples, bwd);
  }
  close(out_fd);
  long peak_end = peak_kb();
  if (g_profile) {
    write_etdump(strips ? *striped.layer->release.module : *release.module, etdump + ".release.etdp");
    if (has_grad) write_etdump(strips ? *striped.layer->grad.module : *grad.module, etdump + ".grad.etdp");
  }
  write_grads(dir, sums);
  auto drop = [&](std::vector<double> v) { return std::vector<double>(v.begin() + warmup, v.end()); };
  std::printf(
      "{\"samples\": %d, \"program_batch\": %d, \"strip_rows\": %d, \"threads\": \"%s\", \"warmup\": %d, \"runs\": %d,\n"
      " \"noise_std\": %g, \"rss_start_kb\": %ld, \"rss_loaded_kb\": %ld, \"peak_loaded_kb\": %ld,\n"
      " \"peak_forward_kb\": %ld, \"peak_kb\": %ld, \"grad_outputs\": %zu,\n"
      " \"forward_compute_ms\": %s, \"forward_noise_ms\": %s, \"forward_total_ms\": %s,\n"
      " \"backward_compute_ms\": %s, \"backward_total_ms\": %s}\n",
      samples, strips ? 1 : release.batch, strips ? striped.g().R : 0, threads.c_str(), warmup, runs,
      noise.on ? noise.std : 0.0f, rss_start, rss_loaded, peak_loaded, peak_forward, peak_end, sums.size(),
      json_list(drop(fwd.compute_ms)).c_str(), json_list(drop(fwd.noise_ms)).c_str(),
      json_list(drop(fwd.total_ms)).c_str(),
      json_list(has_grad ? drop(bwd.compute_ms) : std::vector<double>{}).c_str(),
      json_list(has_grad ? drop(bwd.total_ms) : std::vector<double>{}).c_str());
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const splitface::StripError& e) {  // a bad program, weight or call in the strip layer
    fail(e.what());
  } catch (const std::exception& e) {  // out of memory and the like: still a message and exit 2, not an abort
    fail(std::string("internal error: ") + e.what());
  }
}
