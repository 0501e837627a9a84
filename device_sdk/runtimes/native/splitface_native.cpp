// splitface_native: the device layer's release and weight gradient through ExecuTorch's C++ runtime, with
// no Python and no libtorch in the process: what a phone app links (libexecutorch, the optimized kernels,
// the XNNPACK delegate). It runs the im2col programs (export/gemm_programs.py) over a batch of N samples
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
// of the programs fits in the core's cache, and copies each strip's rows of the server's gradient in. The
// images' height comes from the file's size, the strip's rows and width from the program's output.
// --noise-std S: the runner draws the release's noise itself, N(0, S^2) per value from ChaCha20 under a fresh
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
// or input stops it as above (message on stderr, exit 2). device_sdk/runtimes/native_runtime.py drives it.
//
//   splitface_native --serve --strips --dir D --noise-std S --noise-key K ...
//   splitface_native --serve --strips --dir D --noise-discrete P/Q --quant-step S --clip-steps B --noise-key K ...
//
// --serve with drawn noise (the float option, or the exact one): each release's ChaCha20 key is the caller's
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

std::unique_ptr<Module> load_module(const std::string& path) {
  // Mmap: the program's constant data stays in the file's pages (the im2col programs have almost none).
  auto m = std::make_unique<Module>(path, Module::LoadMode::Mmap,
                                    g_profile ? std::make_unique<executorch::etdump::ETDumpGen>() : nullptr);
  if (m->load_method("forward") != executorch::runtime::Error::Ok) fail("cannot load " + path);
  return m;
}

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

// A program named on the command line as PATH:input,input,...: loaded, with one name for each input of its
// forward method, every input a float tensor.
struct NamedProgram {
  std::string path;
  std::unique_ptr<Module> module;
  std::vector<std::string> names;
  std::vector<InputMeta> inputs;
};

NamedProgram open_named(const std::string& spec) {
  auto colon = spec.rfind(':');
  if (colon == std::string::npos) fail("a program is PATH:input,input,...; got " + spec);
  NamedProgram p;
  p.path = spec.substr(0, colon);
  p.module = load_module(p.path);
  auto meta = p.module->method_meta("forward");
  if (!meta.ok()) fail("no forward method in " + p.path);
  p.names = split(spec.substr(colon + 1), ',');
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

// Adds a program's outputs into `sums` (the loss is a sum over samples and strips, so are the gradients).
void accumulate(const std::vector<EValue>& outs, std::vector<std::vector<float>>& sums) {
  sums.resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& g = outs[i].toTensor();
    const float* v = g.const_data_ptr<float>();
    sums[i].resize(g.numel(), 0.0f);
    for (ssize_t k = 0; k < g.numel(); ++k) sums[i][k] += v[k];
  }
}

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
    accumulate(run(p), sums);
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

// A strip program: input 0 the padded strip (1, C, R + kh - 1, W + kw - 1); an input of the strip's output
// shape (1, O, R, W) is that strip of a per-sample map (the server's gradient); any other is shared (read once).
struct StripProgram {
  std::string path;
  std::unique_ptr<Module> module;
  std::vector<std::string> names;
  std::vector<std::vector<float>> buffers;
  std::vector<TensorPtr> tensors;
  int feature = -1;       // the input cut from a per-sample map, if any
  int feature_fd = -1;
};

struct Geometry {
  int C = 0, H = 0, W = 0, O = 0, R = 0, kh = 0, kw = 0;
  size_t image() const { return static_cast<size_t>(C) * H * W; }
  size_t map() const { return static_cast<size_t>(O) * H * W; }
  size_t strip_in() const { return static_cast<size_t>(C) * (R + kh - 1) * (W + kw - 1); }
};

// A strip program loaded, its buffers allocated; `bind_strip` reads its files. The per-sample input, if any, is
// the one of the strip's output shape.
StripProgram load_strip(const std::string& spec, const std::vector<SizesType>& out_shape) {
  NamedProgram named = open_named(spec);
  StripProgram p;
  p.path = named.path;
  p.module = std::move(named.module);
  p.names = named.names;
  for (size_t i = 0; i < p.names.size(); ++i) {
    p.buffers.emplace_back(named.inputs[i].nbytes / sizeof(float));
    p.tensors.push_back(from_blob(p.buffers.back().data(), named.inputs[i].shape));
    if (i > 0 && named.inputs[i].shape == out_shape) p.feature = static_cast<int>(i);
  }
  return p;
}

// The program's files in `dir`: every shared input (the weights) read now, the per-sample map's file opened. Called
// again for each request of --serve, so that weights written between requests are the ones used.
void bind_strip(StripProgram& p, const std::string& dir) {
  for (size_t i = 1; i < p.names.size(); ++i) {  // input 0 is the strip, cut by the runner
    std::string file = dir + "/" + p.names[i] + ".f32";
    int fd = open_fd(file);
    if (static_cast<int>(i) == p.feature) {
      if (p.feature_fd >= 0) close(p.feature_fd);
      p.feature_fd = fd;
      continue;
    }
    size_t nbytes = p.buffers[i].size() * sizeof(float);
    if (file_bytes(fd) != nbytes) {
      fail(file + " holds " + std::to_string(file_bytes(fd)) + " bytes; the shared input takes " +
           std::to_string(nbytes));
    }
    pread_all(fd, p.buffers[i].data(), p.buffers[i].size(), 0, file);
    close(fd);
  }
}

std::vector<EValue> run_strip(StripProgram& p) {
  std::vector<EValue> args;
  for (auto& t : p.tensors) args.emplace_back(t);
  auto out = p.module->execute("forward", args);
  if (!out.ok()) fail("executing " + p.path + " failed (error " + std::to_string(static_cast<int>(out.error())) + ")");
  return std::move(*out);
}

// The image's rows with the conv's zero halo: `padded` is (C, H + kh - 1, W + kw - 1), its border stays zero.
void pad_image(const Geometry& g, const float* image, std::vector<float>& padded) {
  int hp = g.H + g.kh - 1, wp = g.W + g.kw - 1, top = (g.kh - 1) / 2, left = (g.kw - 1) / 2;
  padded.resize(static_cast<size_t>(g.C) * hp * wp, 0.0f);
  for (int c = 0; c < g.C; ++c)
    for (int y = 0; y < g.H; ++y)
      std::memcpy(&padded[(static_cast<size_t>(c) * hp + y + top) * wp + left], image + (static_cast<size_t>(c) * g.H + y) * g.W,
                  g.W * sizeof(float));
}

// Strip t of the padded image into the program's first input: rows [t R, t R + R + kh - 1) of every channel.
void cut_strip(const Geometry& g, const std::vector<float>& padded, int t, float* strip) {
  int hp = g.H + g.kh - 1, wp = g.W + g.kw - 1, rows = g.R + g.kh - 1;
  for (int c = 0; c < g.C; ++c)
    std::memcpy(strip + static_cast<size_t>(c) * rows * wp, &padded[(static_cast<size_t>(c) * hp + t * g.R) * wp],
                static_cast<size_t>(rows) * wp * sizeof(float));
}

struct StripRunner {
  Geometry g;
  StripProgram release, grad;
  bool has_grad = false;
  int image_fd = -1, samples = 0;
  std::string noise_in;  // --noise-in NAME: the release's noise read from D/NAME.f32 (N maps), added per strip
  int noise_fd = -1;
  std::vector<float> image, padded, map, noise_map;  // one sample's image, padded image, release or gradient
                                                       // map, and read noise
  std::vector<int64_t> quantised;  // --noise-discrete: one sample's release in steps, and its int8 release
  std::vector<int8_t> integers;

  // --noise-discrete: the finished map clipped, quantised and noised from `stream` (one per release, read in
  // order over the samples) into `integers`.
  void exact_noise(const Noise& noise, splitface::KeyStream& stream) {
    quantised.resize(g.map());
    integers.resize(g.map());
    splitface::clip_quantise(map.data(), g.map(), noise.step, noise.bound, quantised.data());
    splitface::add_discrete(quantised.data(), g.map(), *noise.discrete, stream, integers.data());
  }

  // Sample `s`'s release into the output file: float32, or int8 with --noise-discrete.
  void write_sample(int out_fd, int s, bool exact) {
    const void* data = exact ? static_cast<const void*>(integers.data()) : map.data();
    size_t bytes = exact ? g.map() : g.map() * sizeof(float);
    if (pwrite(out_fd, data, bytes, static_cast<off_t>(s * bytes)) != static_cast<ssize_t>(bytes)) {
      fail("cannot write the release");
    }
  }

  void load_image(int s) {
    pread_all(image_fd, image.data(), g.image(), s * g.image(), "images");
    pad_image(g, image.data(), padded);
  }

  // The release of every sample, strip by strip, the noise drawn into each strip's rows as they are copied out.
  void release_pass(int out_fd, bool write, Noise& noise, Times& t) {
    double compute = 0, drawing = 0, start = now_ms();
    if (noise.on || noise.discrete) noise.rekey();  // one key per release
    std::optional<splitface::KeyStream> stream;
    if (noise.discrete) stream.emplace(noise.key);
    for (int s = 0; s < samples; ++s) {
      load_image(s);
      if (noise_fd >= 0) pread_all(noise_fd, noise_map.data(), g.map(), s * g.map(), noise_in);
      double t0 = now_ms();
      for (int strip = 0; strip < g.H / g.R; ++strip) {
        cut_strip(g, padded, strip, release.buffers[0].data());
        auto outs = run_strip(release);
        const float* out = outs.at(0).toTensor().const_data_ptr<float>();
        double t1 = now_ms();
        size_t rows = static_cast<size_t>(g.R) * g.W;
        for (int o = 0; o < g.O; ++o) {
          size_t at = static_cast<size_t>(o) * g.H * g.W + strip * rows;
          if (noise.on) {
            splitface::add_gaussian(&map[at], out + o * rows, rows, s * g.map() + at, noise.key, noise.std);
          } else if (noise_fd >= 0) {
            for (size_t k = 0; k < rows; ++k) map[at + k] = out[o * rows + k] + noise_map[at + k];
          } else {
            std::memcpy(&map[at], out + o * rows, rows * sizeof(float));
          }
        }
        if (noise.on) drawing += now_ms() - t1;
      }
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
      pread_all(grad.feature_fd, map.data(), g.map(), s * g.map(), grad.names[grad.feature]);
      double t0 = now_ms();
      size_t rows = static_cast<size_t>(g.R) * g.W;
      float* feature = grad.buffers[grad.feature].data();
      for (int strip = 0; strip < g.H / g.R; ++strip) {
        cut_strip(g, padded, strip, grad.buffers[0].data());
        for (int o = 0; o < g.O; ++o)
          std::memcpy(feature + o * rows, &map[static_cast<size_t>(o) * g.H * g.W + strip * rows], rows * sizeof(float));
        accumulate(run_strip(grad), sums);
      }
      compute += now_ms() - t0;
    }
    t.compute_ms.push_back(compute);
    t.total_ms.push_back(now_ms() - start);
    return sums;
  }
};

// The strip programs loaded and their geometry read from the release program's strip input and output; the
// files are read by `bind_strips`.
StripRunner load_strips(const std::string& release_spec, const std::string& grad_spec) {
  StripRunner r;
  {
    auto colon = release_spec.rfind(':');
    Module probe(release_spec.substr(0, colon), Module::LoadMode::Mmap);
    auto meta = probe.method_meta("forward");
    if (!meta.ok()) fail("cannot read " + release_spec.substr(0, colon));
    auto in = meta->input_tensor_meta(0);
    auto out = meta->output_tensor_meta(0);
    if (!in.ok() || !out.ok() || in->sizes().size() != 4 || out->sizes().size() != 4 || in->sizes()[0] != 1 ||
        out->sizes()[0] != 1) {
      fail("a strip program takes and returns one (1, C, rows, width) strip");
    }
    r.g.C = in->sizes()[1];
    r.g.O = out->sizes()[1];
    r.g.R = out->sizes()[2];
    r.g.W = out->sizes()[3];
    r.g.kh = in->sizes()[2] - r.g.R + 1;
    r.g.kw = in->sizes()[3] - r.g.W + 1;
    if (r.g.kh < 1 || r.g.kw < 1 || r.g.kh % 2 == 0 || r.g.kw % 2 == 0) fail("the strip's halo is not a 'same' conv's");
  }
  std::vector<SizesType> out_shape = {1, r.g.O, r.g.R, r.g.W};
  r.release = load_strip(release_spec, out_shape);
  if (r.release.feature >= 0) fail("a strip release program takes no per-sample map (the runner draws the noise)");
  r.has_grad = !grad_spec.empty();
  if (r.has_grad) {
    r.grad = load_strip(grad_spec, out_shape);
    if (r.grad.feature < 0) fail(r.grad.path + " takes no (1, O, rows, width) gradient strip");
  }
  return r;
}

// `samples` images from D/<images>.f32 (their height from its size) and the inputs of the release or of the
// gradient program, as they are in `dir` now.
void bind_strips(StripRunner& r, const std::string& dir, int samples, bool release, bool grad) {
  r.samples = samples;
  if (release) bind_strip(r.release, dir);
  if (grad) bind_strip(r.grad, dir);
  std::string file = dir + "/" + r.release.names[0] + ".f32";
  if (r.image_fd >= 0) close(r.image_fd);
  r.image_fd = open_fd(file);
  size_t per_row = static_cast<size_t>(samples) * r.g.C * r.g.W * sizeof(float);
  size_t bytes = file_bytes(r.image_fd);
  if (bytes % per_row != 0 || bytes / per_row % r.g.R != 0 || bytes == 0) {
    fail(file + " holds " + std::to_string(bytes) + " bytes: not " + std::to_string(samples) + " images of " +
         std::to_string(r.g.C) + " x H x " + std::to_string(r.g.W) + " with H a multiple of " + std::to_string(r.g.R));
  }
  r.g.H = static_cast<int>(bytes / per_row);
  const size_t maps = samples * r.g.map() * sizeof(float);
  if (grad && file_bytes(r.grad.feature_fd) != maps) {
    fail(r.grad.names[r.grad.feature] + ".f32 holds " + std::to_string(file_bytes(r.grad.feature_fd)) +
         " bytes; " + std::to_string(samples) + " maps of " + std::to_string(r.g.map() * sizeof(float)) + " expected");
  }
  if (release && !r.noise_in.empty()) {
    if (r.noise_fd >= 0) close(r.noise_fd);
    r.noise_fd = open_fd(dir + "/" + r.noise_in + ".f32");
    if (file_bytes(r.noise_fd) != maps) {
      fail(r.noise_in + ".f32 holds " + std::to_string(file_bytes(r.noise_fd)) + " bytes; " +
           std::to_string(samples) + " maps of " + std::to_string(r.g.map() * sizeof(float)) + " expected");
    }
    r.noise_map.resize(r.g.map());
  }
  r.image.resize(r.g.image());
  r.map.resize(r.g.map());
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
        (op == "grad" && !r.has_grad)) {
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
      size_t per_sample = noise.discrete ? r.g.map() : r.g.map() * sizeof(float);
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
                "\"total_ms\": %g, \"peak_kb\": %ld}\n", op.c_str(), samples, r.g.H, t.compute_ms[0],
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

int main(int argc, char** argv) {
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
    write_etdump(strips ? *striped.release.module : *release.module, etdump + ".release.etdp");
    if (has_grad) write_etdump(strips ? *striped.grad.module : *grad.module, etdump + ".grad.etdp");
  }
  write_grads(dir, sums);
  auto drop = [&](std::vector<double> v) { return std::vector<double>(v.begin() + warmup, v.end()); };
  std::printf(
      "{\"samples\": %d, \"program_batch\": %d, \"strip_rows\": %d, \"threads\": \"%s\", \"warmup\": %d, \"runs\": %d,\n"
      " \"noise_std\": %g, \"rss_start_kb\": %ld, \"rss_loaded_kb\": %ld, \"peak_loaded_kb\": %ld,\n"
      " \"peak_forward_kb\": %ld, \"peak_kb\": %ld, \"grad_outputs\": %zu,\n"
      " \"forward_compute_ms\": %s, \"forward_noise_ms\": %s, \"forward_total_ms\": %s,\n"
      " \"backward_compute_ms\": %s, \"backward_total_ms\": %s}\n",
      samples, strips ? 1 : release.batch, strips ? striped.g.R : 0, threads.c_str(), warmup, runs,
      noise.on ? noise.std : 0.0f, rss_start, rss_loaded, peak_loaded, peak_forward, peak_end, sums.size(),
      json_list(drop(fwd.compute_ms)).c_str(), json_list(drop(fwd.noise_ms)).c_str(),
      json_list(drop(fwd.total_ms)).c_str(),
      json_list(has_grad ? drop(bwd.compute_ms) : std::vector<double>{}).c_str(),
      json_list(has_grad ? drop(bwd.total_ms) : std::vector<double>{}).c_str());
  return 0;
}
