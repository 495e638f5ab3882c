// Micro-bench of the native kernel's matrix loops, one thread, no XLA: the GGUF block loops
// (skippy_blocks_<isa>, block_kernel_isa.cc) per type beside the q4 panel loops that run Q4_0 / Q4_1
// (skippy_q4_panel_<isa>, quant_kernel_isa.cc) and the q5 ones Q5_0 is repacked into at load, on the
// same [N, K] and M rows of x. Random blocks with modest f16 scales. Each figure is the sum over slices of W (32 tasks / 8 panels) of the fastest of 9
// runs of the slice: a shared machine preempts long runs, short ones mostly run whole. Weights warm in
// cache after the first run: this measures the loops, not memory. Built and run by kernel_micro.py.
//   kernel_micro <M> <N>x<K> [<N>x<K> ...]      one line per (shape, type): JSON
#include "quant_kernel.h"
#include "block_kernel_more.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// The one instruction set this binary measures, linked with that ISA's loop objects only.
#ifndef SKIPPY_MICRO_ISA
#error "compile with -DSKIPPY_MICRO_ISA=<isa>"
#endif
#define SKIPPY_MICRO_CAT2(a, b) a##b
#define SKIPPY_MICRO_CAT(a, b) SKIPPY_MICRO_CAT2(a, b)
#define SKIPPY_MICRO_DECLARE(isa) SKIPPY_DECLARE_ISA(isa)   // (expands the name before pasting it)
SKIPPY_MICRO_DECLARE(SKIPPY_MICRO_ISA)
#if defined(SKIPPY_MICRO_QUANTIZE)   // avx512vnni, avx2int8: SKIPPY_MICRO_INT8_TYPES's types on int8 activations, x quantised as BlockDense does
#define SKIPPY_MICRO_DECLARE_QUANTIZE(isa) SKIPPY_DECLARE_QUANTIZE(isa)
SKIPPY_MICRO_DECLARE_QUANTIZE(SKIPPY_MICRO_ISA)
#endif

namespace {

struct Type { const char* name; int32_t id; int block, bytes, f16a, f16b; };   // f16 scale offsets (-1: none)
const Type kTypes[] = {{"Q4_K", SKIPPY_GGML_Q4_K, 256, 144, 0, 2}, {"Q5_K", SKIPPY_GGML_Q5_K, 256, 176, 0, 2},
                       {"Q6_K", SKIPPY_GGML_Q6_K, 256, 210, 208, -1}, {"Q5_0", SKIPPY_GGML_Q5_0, 32, 22, 0, -1},
                       {"Q8_0", SKIPPY_GGML_Q8_0, 32, 34, 0, -1}, {"Q3_K", SKIPPY_GGML_Q3_K, 256, 110, 108, -1},
                       {"Q2_K", SKIPPY_GGML_Q2_K, 256, 84, 80, 82}, {"IQ4_XS", SKIPPY_GGML_IQ4_XS, 256, 136, 0, -1},
                       {"IQ4_NL", SKIPPY_GGML_IQ4_NL, 32, 18, 0, -1}, {"Q5_1", SKIPPY_GGML_Q5_1, 32, 24, 0, 2}};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Sum over slices [i, i + step) of `tasks` of the fastest of 9 runs of run(i, end).
template <class Run>
double best_of(int64_t tasks, int64_t step, Run run) {
  double total = 0;
  for (int64_t i = 0; i < tasks; i += step) {
    const int64_t end = std::min(tasks, i + step);
    double best = 1e30;
    for (int rep = 0; rep < 9; ++rep) {
      const double t0 = now();
      run(i, end);
      best = std::min(best, now() - t0);
    }
    total += best;
  }
  return total;
}

void row(const char* kind, int64_t M, int64_t N, int64_t K, double s, double bytes) {
  printf("{\"type\": \"%s\", \"M\": %lld, \"N\": %lld, \"K\": %lld, \"us\": %.1f, \"gb_s\": %.2f, \"gweights_s\": %.2f}\n",
         kind, (long long)M, (long long)N, (long long)K, s * 1e6, bytes / s / 1e9, (double)N * K / s / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return fprintf(stderr, "usage: %s M NxK...\n", argv[0]), 2;
  const int64_t M = atoll(argv[1]);
  const SkippyBlockFn blocks = SKIPPY_MICRO_CAT(skippy_blocks_, SKIPPY_MICRO_ISA);
  const SkippyPanelFn q4 = SKIPPY_MICRO_CAT(skippy_q4_panel_, SKIPPY_MICRO_ISA);
  const SkippyPanelFn q5 = SKIPPY_MICRO_CAT(skippy_q5_panel_, SKIPPY_MICRO_ISA);
  std::mt19937 rng(1);
  for (int a = 2; a < argc; ++a) {
    int64_t N = 0, K = 0;
    if (sscanf(argv[a], "%lldx%lld", (long long*)&N, (long long*)&K) != 2 || N % SKIPPY_PANEL || K % 32 || K <= 0)
      return fprintf(stderr, "shape %s: NxK, N a multiple of 64, K of 32\n", argv[a]), 2;
    std::vector<float> x(M * K), y(M * N), xs(M * K / 16);
    for (float& v : x) v = (float)(rng() % 2001) / 1000.0f - 1.0f;
    std::vector<uint8_t> q(N * K / 2);   // q4 panels, group 32, as Q4_1 converts
    for (uint8_t& b : q) b = (uint8_t)rng();
    std::vector<uint16_t> s(N * K / 32, 0x2000), z(N * K / 32, 0xa000);
    const SkippyDenseArgs d{x.data(), q.data(), s.data(), z.data(), y.data(), M, K, N, 32, nullptr, nullptr, nullptr};
    row("q4 panels (Q4_0 / Q4_1)", M, N, K, best_of(N / SKIPPY_PANEL, 8, [&](int64_t i, int64_t e) {
          for (; i < e; ++i) q4(&d, i);
        }), q.size() + 4.0 * s.size());
    std::vector<uint8_t> q5b(N * K * 5 / 8);   // 5-bit panels: Q5_0 repacked at load (offsets -16 s: no z)
    for (uint8_t& b : q5b) b = (uint8_t)rng();
    const SkippyDenseArgs d5{x.data(), q5b.data(), s.data(), nullptr, y.data(), M, K, N, 32, nullptr, nullptr, nullptr};
    row("q5 panels (Q5_0 at load)", M, N, K, best_of(N / SKIPPY_PANEL, 8, [&](int64_t i, int64_t e) {
          for (; i < e; ++i) q5(&d5, i);
        }), q5b.size() + 2.0 * s.size());
    for (const Type& t : kTypes) {
      if (K % t.block) continue;   // (K-quants need K a multiple of 256)
      const int64_t row_bytes = K / t.block * t.bytes;
      std::vector<uint8_t> w(N * row_bytes);
      for (uint8_t& b : w) b = (uint8_t)rng();
      for (int64_t i = 0; i < N * (K / t.block); ++i)
        for (int f : {t.f16a, t.f16b}) {
          const uint16_t h = (uint16_t)(0x1c00 + rng() % 0x400);   // 2^-8 .. 2^-7
          if (f >= 0) memcpy(&w[i * t.bytes + f], &h, 2);
        }
      SkippyBlockArgs b{x.data(), xs.data(), w.data(), y.data(), M, K, N, row_bytes, t.id};
      std::string name = t.name;
#if defined(SKIPPY_MICRO_QUANTIZE)
      std::vector<int8_t> xq(M * K);
      std::vector<float> xd(M * K / SKIPPY_XBLOCK), xsq(M * K / SKIPPY_XBLOCK);
      if (SKIPPY_MICRO_INT8_TYPES(t.id)) {   // (every M; once per call in BlockDense: untimed)
        SKIPPY_MICRO_CAT(skippy_quantize_x_, SKIPPY_MICRO_ISA)(x.data(), M, K, xq.data(), xd.data(), xsq.data());
        b.xq = xq.data(), b.xd = xd.data(), b.xs = xsq.data();
        name += " (int8 x)";
      }
#endif
      row(name.c_str(), M, N, K, best_of((N + SKIPPY_BLOCK_ROWS - 1) / SKIPPY_BLOCK_ROWS, 32, [&](int64_t i, int64_t e) {
            for (; i < e; ++i) blocks(&b, i);
          }), (double)w.size());
    }
  }
  return 0;
}
