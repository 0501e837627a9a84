// SPLITFACE_ISA_VERSIONS: one definition per x86 ISA, picked at load time, for the runner's vector loops (the
// noise's ChaCha lanes, chacha_lanes.h; the strip layer's LRN, lrn.cpp).
#pragma once

// SPLITFACE_ISA_VERSIONS(ret, name, params, call): defines `ret name params` once per ISA, each version's body
// calling `call(W)` with that ISA's lane width. A build for a baseline x86-64 target with GCC gets C++ function
// multiversions (AVX-512, AVX2, the baseline), picked once at load time by the CPU's features (ifunc). A build
// for a named target (-march=native, -march=x86-64-v3, arm64) decides at compile time: the multiversions could
// not inline code already compiled for more features than theirs.
#if defined(SPLITFACE_FORCE_LANES)  // one width for every CPU: the benchmarks' side-by-side of the ISA paths
#define SPLITFACE_ISA_VERSIONS(ret, name, params, call) ret name params { call(SPLITFACE_FORCE_LANES); }
#elif defined(__AVX512F__)
#define SPLITFACE_ISA_VERSIONS(ret, name, params, call) ret name params { call(16); }
#elif defined(__AVX2__)
#define SPLITFACE_ISA_VERSIONS(ret, name, params, call) ret name params { call(8); }
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPLITFACE_ISA_VERSIONS(ret, name, params, call)                    \
  __attribute__((target("arch=x86-64-v4"))) ret name params { call(16); } \
  __attribute__((target("arch=x86-64-v3"))) ret name params { call(8); }  \
  __attribute__((target("default"))) ret name params { call(4); }
#else  // SSE2 without GCC's multiversions, NEON on arm64 (32 registers of 16 bytes)
#define SPLITFACE_ISA_VERSIONS(ret, name, params, call) ret name params { call(4); }
#endif
