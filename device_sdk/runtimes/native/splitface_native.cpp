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
// Each input name is the file D/<name>.f32 (float32, C order): a per-sample input holds N/B chunks of
// the program's input shape, a shared one (the weights) exactly one. Outputs: D/release.f32 (N samples)
// and D/grad_<i>.f32 (output i of the gradient program, summed). One JSON object on stdout: times per run
// (the programs' execute calls alone, and with the chunks' file reads and writes) and the process's
// resident set size after each step and its high-water mark, from /proc/self/status.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/extension/threadpool/threadpool_guard.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
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
  std::vector<float> buffer;
  TensorPtr tensor;
};

struct Program {
  std::string path;
  std::unique_ptr<Module> module;
  std::vector<Input> inputs;
  int batch = 0;
};

Program open_program(const std::string& spec, const std::string& dir, int samples) {
  auto colon = spec.rfind(':');
  if (colon == std::string::npos) fail("a program is PATH:input,input,...; got " + spec);
  Program p;
  p.path = spec.substr(0, colon);
  // Mmap: the program's constant data stays in the file's pages (the im2col programs have almost none).
  p.module = std::make_unique<Module>(p.path, Module::LoadMode::Mmap);
  if (p.module->load_method("forward") != executorch::runtime::Error::Ok) fail("cannot load " + p.path);
  auto meta = p.module->method_meta("forward");
  if (!meta.ok()) fail("no forward method in " + p.path);
  auto names = split(spec.substr(colon + 1), ',');
  if (names.size() != meta->num_inputs()) {
    fail(p.path + " takes " + std::to_string(meta->num_inputs()) + " inputs; " + std::to_string(names.size()) +
         " named");
  }
  for (size_t i = 0; i < names.size(); ++i) {
    auto info = meta->input_tensor_meta(i);
    if (!info.ok() || info->scalar_type() != executorch::aten::ScalarType::Float) {
      fail(p.path + ": input " + std::to_string(i) + " is not a float tensor");
    }
    Input in;
    in.name = names[i];
    in.shape.assign(info->sizes().begin(), info->sizes().end());
    in.chunk_floats = info->nbytes() / sizeof(float);
    std::string file = dir + "/" + in.name + ".f32";
    in.fd = open(file.c_str(), O_RDONLY);
    if (in.fd < 0) fail("cannot open " + file);
    struct stat st{};
    fstat(in.fd, &st);
    size_t bytes = static_cast<size_t>(st.st_size);
    if (i == 0) p.batch = in.shape.at(0);
    if (bytes == info->nbytes()) {
      in.per_sample = false;
    } else if (p.batch > 0 && samples % p.batch == 0 && bytes == info->nbytes() * (samples / p.batch)) {
      in.per_sample = true;
    } else {
      fail(file + " holds " + std::to_string(bytes) + " bytes: neither one input of " +
           std::to_string(info->nbytes()) + " bytes nor " + std::to_string(samples) + " samples of them");
    }
    in.buffer.resize(in.chunk_floats);
    in.tensor = from_blob(in.buffer.data(), in.shape);
    p.inputs.push_back(std::move(in));
  }
  if (samples % p.batch != 0) fail(std::to_string(samples) + " samples is not a multiple of the batch " +
                                   std::to_string(p.batch) + " of " + p.path);
  return p;
}

void read_chunk(Input& in, size_t chunk, bool first) {
  if (!in.per_sample && !first) return;  // shared inputs are read once
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
  std::vector<double> compute_ms, total_ms;
};

// The release over all samples: each chunk read, run, and its release written to D/release.f32 (last run).
void release_pass(Program& p, int samples, int out_fd, bool write, Times& t) {
  double compute = 0, start = now_ms();
  size_t chunks = samples / p.batch;
  for (size_t c = 0; c < chunks; ++c) {
    for (auto& in : p.inputs) read_chunk(in, c, c == 0);
    double t0 = now_ms();
    auto outs = run(p);
    compute += now_ms() - t0;
    const auto& r = outs.at(0).toTensor();
    if (write && pwrite(out_fd, r.const_data_ptr<float>(), r.nbytes(), static_cast<off_t>(c * r.nbytes())) !=
                     static_cast<ssize_t>(r.nbytes())) {
      fail("cannot write the release");
    }
  }
  t.compute_ms.push_back(compute);
  t.total_ms.push_back(now_ms() - start);
}

// The weight gradient over all samples: the chunks' gradients summed (the loss is a sum over samples).
std::vector<std::vector<float>> grad_pass(Program& p, int samples, Times& t) {
  double compute = 0, start = now_ms();
  std::vector<std::vector<float>> sums;
  size_t chunks = samples / p.batch;
  for (size_t c = 0; c < chunks; ++c) {
    for (auto& in : p.inputs) read_chunk(in, c, c == 0);
    double t0 = now_ms();
    auto outs = run(p);
    sums.resize(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      const auto& g = outs[i].toTensor();
      const float* v = g.const_data_ptr<float>();
      sums[i].resize(g.numel(), 0.0f);
      for (ssize_t k = 0; k < g.numel(); ++k) sums[i][k] += v[k];
    }
    compute += now_ms() - t0;
  }
  t.compute_ms.push_back(compute);
  t.total_ms.push_back(now_ms() - start);
  return sums;
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
    else fail("unknown argument " + a);
  }
  if (dir.empty() || samples <= 0 || release_spec.empty() || runs <= 0 || warmup < 0) {
    fail("usage: splitface_native --dir D --samples N --release P:inputs [--grad P:inputs] [--runs R] "
         "[--warmup W] [--threads 1|all]");
  }
  if (threads != "1" && threads != "all") fail("--threads is 1 or all (the runtime's pool, one per core)");
  // One thread: XNNPACK gets no thread pool and runs on the calling thread.
  std::unique_ptr<executorch::extension::threadpool::NoThreadPoolGuard> single;
  if (threads == "1") single = std::make_unique<executorch::extension::threadpool::NoThreadPoolGuard>();

  long rss_start = status_kb("VmRSS:");
  Program release = open_program(release_spec, dir, samples);
  Program grad;
  bool has_grad = !grad_spec.empty();
  if (has_grad) grad = open_program(grad_spec, dir, samples);
  long rss_loaded = status_kb("VmRSS:"), peak_loaded = peak_kb();

  std::string out_path = dir + "/release.f32";
  int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out_fd < 0) fail("cannot create " + out_path);
  Times fwd, bwd;
  std::vector<std::vector<float>> sums;
  long peak_forward = 0;
  for (int r = 0; r < warmup + runs; ++r) {
    release_pass(release, samples, out_fd, r == warmup + runs - 1, fwd);
    if (r == 0) peak_forward = peak_kb();  // before any gradient program ran
    if (has_grad) sums = grad_pass(grad, samples, bwd);
  }
  close(out_fd);
  long peak_end = peak_kb();
  for (size_t i = 0; i < sums.size(); ++i) {
    std::string path = dir + "/grad_" + std::to_string(i) + ".f32";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(sums[i].data(), sizeof(float), sums[i].size(), f) != sums[i].size()) {
      fail("cannot write " + path);
    }
    std::fclose(f);
  }
  auto drop = [&](std::vector<double> v) { return std::vector<double>(v.begin() + warmup, v.end()); };
  std::printf(
      "{\"samples\": %d, \"program_batch\": %d, \"threads\": \"%s\", \"warmup\": %d, \"runs\": %d,\n"
      " \"rss_start_kb\": %ld, \"rss_loaded_kb\": %ld, \"peak_loaded_kb\": %ld, \"peak_forward_kb\": %ld,\n"
      " \"peak_kb\": %ld, \"grad_outputs\": %zu,\n"
      " \"forward_compute_ms\": %s, \"forward_total_ms\": %s,\n"
      " \"backward_compute_ms\": %s, \"backward_total_ms\": %s}\n",
      samples, release.batch, threads.c_str(), warmup, runs, rss_start, rss_loaded, peak_loaded, peak_forward, peak_end, sums.size(),
      json_list(drop(fwd.compute_ms)).c_str(), json_list(drop(fwd.total_ms)).c_str(),
      json_list(has_grad ? drop(bwd.compute_ms) : std::vector<double>{}).c_str(),
      json_list(has_grad ? drop(bwd.total_ms) : std::vector<double>{}).c_str());
  return 0;
}
