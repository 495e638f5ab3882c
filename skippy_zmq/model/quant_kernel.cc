// Weight-only int8 and 4-bit dense layers for XLA CPU, called through the XLA FFI.
//
//   y[M, Np] = x[M, K] @ W,  W[k, n] = level(k, n) * s[g, n] + z[g, n],  g = k / group
//
// Layout: quant_kernel.h. This file is the glue: it validates buffers, spreads
// panels over XLA's thread pool and calls the loops of the instruction set
// chosen at load time (skippy_kernel_select). The loops live in
// quant_kernel_isa.cc, compiled once per ISA; this file is compiled for the
// baseline CPU, so loading the library never executes an instruction the CPU
// lacks.
//
// Why a kernel at all: XLA CPU cannot fuse an int8->f32 convert into a dot.
// It materialises the converted f32 weight (4 bytes per weight written and
// read back, plus page faults on the fresh buffer), which is ~10x slower than
// the plain f32 dot. Here levels are widened in registers, so a decode step
// reads 1 byte (int8) or half a byte (4-bit) per weight instead of 4.
//
// Why the packed layout: a 64-column panel (and its scales) is contiguous
// over K, so a tile streams memory linearly. With [K, N] rows the tile strides
// by N bytes per k, a new page every step for the 49152-wide head, and the
// prefetcher gives up: a decode step measured 3.5x slower with q as [K, N],
// 1.5x slower with s and z as [groups, N]. The panel stays in L2 while row
// blocks of a prefill reuse it.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "quant_kernel.h"
#include "block_kernel_more.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// kernel.py may build only the loops this CPU runs (and generic): -DSKIPPY_NO_<isa> leaves one out
#if defined(__x86_64__)
#define SKIPPY_X86 1
#endif
SKIPPY_DECLARE_ISA(generic)
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx2)
SKIPPY_DECLARE_ISA(avx2)
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx512)
SKIPPY_DECLARE_ISA(avx512)
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx512vnni)
SKIPPY_DECLARE_ISA(avx512vnni)
SKIPPY_DECLARE_QUANTIZE(avx512vnni)
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx2int8)
SKIPPY_DECLARE_ISA(avx2int8)
SKIPPY_DECLARE_QUANTIZE(avx2int8)
#endif

namespace {

struct Isa {
  const char* name;
  SkippyPanelFn int8, q4, q5;
  bool (*supported)();
  SkippyQuantizeFn quantize;  // int8 activations (null: float loops only)
  SkippyAttendFn attend;
  SkippyBlockFn blocks;
  int (*int8_block)(int32_t type);  // the GGUF block types it runs on int8 activations (null: none)
  bool int8_panels;                 // whether its panel loops (Dense) run on int8 activations too
};

bool always() { return true; }
#if defined(__x86_64__)
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx512vnni() {
  return has_avx512() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}
#endif

const Isa kIsas[] = {  // best first
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx512vnni)
    {"avx512vnni", skippy_int8_panel_avx512vnni, skippy_q4_panel_avx512vnni, skippy_q5_panel_avx512vnni,
     has_avx512vnni, skippy_quantize_x_avx512vnni, skippy_attend_avx512vnni, skippy_blocks_avx512vnni,
     skippy_int8_block_type, true},
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx512)
    {"avx512", skippy_int8_panel_avx512, skippy_q4_panel_avx512, skippy_q5_panel_avx512, has_avx512, nullptr,
     skippy_attend_avx512, skippy_blocks_avx512, nullptr, false},
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx2int8)
    // int8 activations on AVX2 (opt-in): the block types skippy_int8_block_type_avx2 lists; panels float
    {"avx2int8", skippy_int8_panel_avx2int8, skippy_q4_panel_avx2int8, skippy_q5_panel_avx2int8, has_avx2,
     skippy_quantize_x_avx2int8, skippy_attend_avx2int8, skippy_blocks_avx2int8, skippy_int8_block_type_avx2, false},
#endif
#if SKIPPY_X86 && !defined(SKIPPY_NO_avx2)
    {"avx2", skippy_int8_panel_avx2, skippy_q4_panel_avx2, skippy_q5_panel_avx2, has_avx2, nullptr,
     skippy_attend_avx2, skippy_blocks_avx2, nullptr, false},
#endif
    {"generic", skippy_int8_panel_generic, skippy_q4_panel_generic, skippy_q5_panel_generic, always, nullptr,
     skippy_attend_generic, skippy_blocks_generic, nullptr, false},
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

std::atomic<const Isa*> g_isa{&kIsas[kNumIsas - 1]};

// Multiply-adds from which a call shares its tasks with pool threads (skippy_kernel_set_min_parallel,
// $SKIPPY_KERNEL_SHARE_FROM change it). This default keeps a decode step's projections on their caller:
// on the 2-core AVX-512 Xeon one core read SmolLM2's 5-bit panels at ~5 GB/s, and with the second core
// free, 65536 (every decode projection shared) cut a step's matrix time from ~15 to ~10 ms (one traced
// run); but on that machine loaded by other work (load 8-20) it was no faster and its median step up
// to 1.25x slower. kernel.py sets 65536 when it loads the library into a process that may use 2 CPUs
// or more (its pool, sized by the CPU quota, has a helper to share with); this default is for one CPU.
// Sharing a call of decode size is only worth it because helpers stay hot between calls
// (HelperLoop): a parked pool thread takes ~25-50 us to wake, as long as a whole decode projection.
std::atomic<int64_t> g_min_parallel{4 << 20};
// How long a helper waits, spinning, for the next call's tasks before it goes back to the pool: a
// decode step's projections are a few small XLA ops apart, its steps (Python, sampling) much further.
constexpr auto kHelperSpin = std::chrono::microseconds(100);
// A caller kept waiting this long for a helper's tasks, beyond two of its own tasks' time, means the helper
// lost its core (a loaded machine: other processes, or other stages on these cores); the next kBackoffCalls
// calls (a few decode steps) then run on their callers alone, where hot helpers measured 1.5x slower than
// none under load. The tasks' own time is not lateness: a prefill chunk's task (16 rows of a 1B model's
// matrix over 128 tokens) runs longer than kLateHelper, and counting the wait for a helper's last one as
// late had every prefill switch the next 2048 calls, the decode steps after it, to one thread (a 1B
// Q4_K_M decode step 185 ms on the 2-core Xeon, one core busy; helper_stats: 1 backoff a request).
constexpr auto kLateHelper = std::chrono::microseconds(100);
constexpr int64_t kBackoffCalls = 64;
std::atomic<int64_t> g_backoff{0};   // calls left to run alone
// Counters for benchmarks (skippy_kernel_helper_stats): calls shared, tasks helpers ran, backoffs.
std::atomic<int64_t> g_shared_calls{0}, g_helper_tasks{0}, g_backoffs{0};

// One call's tasks, claimed from a shared counter by the caller and any helper.
struct Job {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  virtual ~Job() = default;
  virtual void Run(int64_t task) = 0;
  int64_t Help() {   // returns how many tasks this thread ran
    int64_t ran = 0;
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < n; ++ran) {
      Run(p);
      done.fetch_add(1, std::memory_order_release);
    }
    return ran;
  }
};
template <class Task>
struct TaskJob final : Job {
  Task task;
  TaskJob(int64_t count, Task t) : task(std::move(t)) { n = count; }
  void Run(int64_t p) override { task(p); }
};

// The latest call's job, where spinning helpers look for work (bumping g_epoch announces a new one).
// Never destroyed: a helper may still spin in it while the process exits.
struct Slot {
  std::mutex mu;
  std::shared_ptr<Job> job;
};
Slot& g_slot = *new Slot;
std::atomic<uint64_t> g_epoch{0};
std::atomic<int> g_spinning{0};

// A spinning helper yields its core to anything waiting for it (on a loaded machine that is often
// this very call's caller, queued behind the spinner); with nothing waiting, yield returns at once.
inline void CpuRelax() { std::this_thread::yield(); }

// A pool thread's turn as a helper: helps `job`, then takes each newer job announced within
// kHelperSpin of finishing the last, so the calls of one decode step keep it without a wake-up.
void HelperLoop(std::shared_ptr<Job> job, uint64_t epoch) {
  while (job) {
    g_helper_tasks.fetch_add(job->Help(), std::memory_order_relaxed);
    job.reset();
    g_spinning.fetch_add(1, std::memory_order_acq_rel);
    const auto until = std::chrono::steady_clock::now() + kHelperSpin;
    for (int i = 0; !job; ++i) {
      const uint64_t now = g_epoch.load(std::memory_order_acquire);
      if (now != epoch) {
        std::lock_guard<std::mutex> lock(g_slot.mu);
        job = g_slot.job, epoch = now;
      } else if (i % 64 == 0 && std::chrono::steady_clock::now() > until) {
        break;
      }
      CpuRelax();
    }
    g_spinning.fetch_sub(1, std::memory_order_acq_rel);
  }
}

// Runs task(0..n-1) on the caller, helped by pool threads when `work` (multiply-adds) is
// worth it. Tasks are claimed from a shared counter; the caller works too and takes
// whatever the helpers have not started, so a pool busy with other thunks slows this
// call down but can never deadlock it; the caller waits at most for tasks a helper is
// running. Late helpers find nothing left; the shared_ptr keeps the job (and the
// task's captures) alive for them. Which thread runs a task changes no result.
template <class Task>
void RunTasks(ffi::ThreadPool& pool, int64_t n, int64_t work, Task task) {
  auto job = std::make_shared<TaskJob<Task>>(n, std::move(task));
  int64_t helpers = work < g_min_parallel.load(std::memory_order_relaxed) ? 0 : std::min<int64_t>(pool.num_threads() - 1, n - 1);
  if (helpers > 0 && g_backoff.load(std::memory_order_relaxed) > 0) {
    g_backoff.fetch_sub(1, std::memory_order_relaxed);
    helpers = 0;
  }
  if (helpers > 0) {
    g_shared_calls.fetch_add(1, std::memory_order_relaxed);
    uint64_t epoch;
    {
      std::lock_guard<std::mutex> lock(g_slot.mu);
      g_slot.job = job;
      epoch = g_epoch.fetch_add(1, std::memory_order_acq_rel) + 1;
    }
    // hot helpers take the job by themselves; wake pool threads only for the rest
    for (int64_t i = g_spinning.load(std::memory_order_acquire); i < helpers; ++i)
      pool.Schedule([job, epoch] { HelperLoop(job, epoch); });
  }
  const auto start = std::chrono::steady_clock::now();
  const int64_t ran = job->Help();
  if (job->done.load(std::memory_order_acquire) < n) {
    const auto since = std::chrono::steady_clock::now();
    while (job->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
    const auto task = ran > 0 ? (since - start) / ran : std::chrono::steady_clock::duration::zero();
    if (std::chrono::steady_clock::now() - since > kLateHelper + 2 * task) {
      g_backoff.store(kBackoffCalls, std::memory_order_relaxed);
      g_backoffs.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (helpers > 0) {
    std::lock_guard<std::mutex> lock(g_slot.mu);
    if (g_slot.job == job) g_slot.job.reset();
  }
}

// A decode-sized GGUF call (x of kDecodeTaskRows rows or fewer) runs in at most kDecodeTasks tasks, each a
// run of consecutive SKIPPY_BLOCK_ROWS chunks: a task of one 16-row chunk (18 KB of a 2048-wide Q4_K
// matrix) is ~1 us at M = 1, ~45k of them a 1B step, each claimed and counted on the job's shared
// counters (a cache line bounced between the cores) and each breaking the thread's stream through W; a
// step ran ~12 ms slower so. 16 tasks keep some balance for a late helper (it holds back 1/16 of a call).
// Rows are still computed one by one, so the bits do not change.
// 1B Q4_K_M decode step, 2-core EPYC Zen 4, avx512vnni, 100 steps, alternating: 1 chunk a task 41.9-43.2
// ms; 16 tasks 29.7-30.1; 8 30.1-31.9; 4 31.2-32.2; 2 (contiguous halves) 28.7-33.3.
constexpr int64_t kDecodeTasks = 16, kDecodeTaskRows = 4;

// Shared by the formats (bits 8, 4, 5); `row_bytes` is 64 (int8), 32 (4-bit) or 40 (5-bit) per panel row.
ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, const void* q, ffi::Span<const int64_t> qd,
                 int64_t row_bytes, ffi::Buffer<ffi::F16> s, ffi::Buffer<ffi::F16> z,
                 ffi::ResultBuffer<ffi::F32> y, int bits) {
  if (qd.size() != 3 || qd[2] != row_bytes) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "q must be packed as [Np/64, K, 64, 32 or 40 bytes]");
  }
  const int64_t panels = qd[0], K = qd[1];
  auto sd = s.dimensions();
  if (sd.size() != 3 || sd[0] != panels || sd[1] <= 0 || K % sd[1] || sd[2] != SKIPPY_PANEL ||
      (z.element_count() != s.element_count() && z.element_count() != 0)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "s and z must be [Np/64, groups dividing K, 64] (z or empty)");
  }
  const bool offsets = z.element_count() != 0;   // none: every offset 0 (GGUF Q8_0), or -16 s (5-bit panels)
  SkippyDenseArgs args{x.typed_data(), q, reinterpret_cast<const uint16_t*>(s.untyped_data()),
                       offsets ? reinterpret_cast<const uint16_t*>(z.untyped_data()) : nullptr, y->typed_data(),
                       K ? static_cast<int64_t>(x.element_count()) / K : 0, K, panels * SKIPPY_PANEL, K / sd[1],
                       nullptr, nullptr, nullptr};
  const Isa* isa = g_isa.load(std::memory_order_relaxed);
  const SkippyPanelFn fn = bits == 4 ? isa->q4 : bits == 5 ? isa->q5 : isa->int8;
  // int8 activations: x quantised once per call, read by every panel. Buffers are per
  // thread (XLA may run two dense calls at once) and outlive the call's panels, which
  // all finish before this function returns.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  if (isa->int8_panels && K % SKIPPY_XBLOCK == 0 && args.group % SKIPPY_XBLOCK == 0 && args.M > 0) {
    const int64_t blocks = args.M * (K / SKIPPY_XBLOCK);
    xq.resize(args.M * K), xd.resize(blocks), xs.resize(blocks);
    isa->quantize(args.x, args.M, K, xq.data(), xd.data(), xs.data());
    args.xq = xq.data(), args.xd = xd.data(), args.xs = xs.data();
  }
  // Panels are spread over the caller and the hot helpers (RunTasks) from g_min_parallel multiply-adds.
  RunTasks(pool, panels, args.M * K * args.Np, [fn, args](int64_t p) { fn(&args, p); });
  return ffi::Error::Success();
}

// GGUF blocks in place (block_kernel_isa.cc): y[M, N] = x[M, K] @ W.T, W [N, row bytes] of `type`.
ffi::Error BlockDense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> y, int64_t type) {
  int64_t block = 0, bytes = 0;   // weights and bytes per block
  switch (type) {
    case SKIPPY_GGML_Q5_0: block = 32, bytes = 22; break;
    case SKIPPY_GGML_Q8_0: block = 32, bytes = 34; break;
    case SKIPPY_GGML_Q4_K: block = 256, bytes = 144; break;
    case SKIPPY_GGML_Q5_K: block = 256, bytes = 176; break;
    case SKIPPY_GGML_Q6_K: block = 256, bytes = 210; break;
    default:
      if (!skippy_more_block(type, &block, &bytes))
        return ffi::Error(ffi::ErrorCode::kInvalidArgument, "blocks: not a GGML type the kernel reads");
  }
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] % block || wd[1] != xd[1] / block * bytes ||
      yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "blocks: x [M, K], w [N, K / block * bytes], y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const Isa* isa = g_isa.load(std::memory_order_relaxed);
  // int8 activations (avx512vnni, avx2int8): the calls of any size of the types the ISA lists (int8_block),
  // x quantised once per call as Dense does (per-thread buffers that outlive the call's tasks), so a row's
  // result does not depend on how many rows share its call. Every other type keeps the float loops.
  const bool int8 = isa->int8_block && isa->int8_block(static_cast<int32_t>(type)) && M > 0;
  // x's float sums per 16 inputs, for the blocks' minimums: every float loop reads them, of the int8 loops
  // only Q2_K's (its minimums come per 16). Per thread: XLA may run two calls at once; every task ends
  // before this returns.
  thread_local std::vector<float> xsum;
  const float* xs = x.typed_data();
  if (!int8 || type == SKIPPY_GGML_Q2_K) {
    xsum.assign(M * (K / 16), 0.0f);
    for (int64_t i = 0; i < M * (K / 16); ++i)
      for (int j = 0; j < 16; ++j) xsum[i] += xs[i * 16 + j];
  }
  SkippyBlockArgs args{xs, !int8 || type == SKIPPY_GGML_Q2_K ? xsum.data() : nullptr, w.typed_data(),
                       y->typed_data(), M, K, N, wd[1], static_cast<int32_t>(type), nullptr, nullptr, nullptr};
  thread_local std::vector<int8_t> xq8;
  thread_local std::vector<float> xq_step, xq_sum;
  if (int8) {
    const int64_t blocks = M * (K / SKIPPY_XBLOCK);   // (K a multiple of every block type's 32 or 256)
    xq8.resize(M * K), xq_step.resize(blocks), xq_sum.resize(blocks);
    isa->quantize(xs, M, K, xq8.data(), xq_step.data(), xq_sum.data());
    args.xq = xq8.data(), args.xd = xq_step.data(), args.xs = xq_sum.data();
  }
  const SkippyBlockFn fn = isa->blocks;
  // Decode-sized calls run in at most kDecodeTasks tasks of whole SKIPPY_BLOCK_ROWS chunks (see kDecodeTasks).
  const int64_t chunks = (N + SKIPPY_BLOCK_ROWS - 1) / SKIPPY_BLOCK_ROWS;
  const int64_t group = M > kDecodeTaskRows ? 1 : (chunks + kDecodeTasks - 1) / kDecodeTasks;
  RunTasks(pool, (chunks + group - 1) / group, M * K * N, [fn, args, group, chunks](int64_t t) {
    for (int64_t c = t * group, end = std::min(chunks, c + group); c < end; ++c) fn(&args, c);
  });
  return ffi::Error::Success();
}

ffi::Error Int8Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                     ffi::Buffer<ffi::F16> s, ffi::Buffer<ffi::F16> z, ffi::ResultBuffer<ffi::F32> y) {
  return Dense(pool, x, q.typed_data(), q.dimensions(), SKIPPY_PANEL, s, z, y, 8);
}

ffi::Error Q4Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                   ffi::Buffer<ffi::F16> s, ffi::Buffer<ffi::F16> z, ffi::ResultBuffer<ffi::F32> y) {
  return Dense(pool, x, q.typed_data(), q.dimensions(), SKIPPY_PANEL / 2, s, z, y, 4);
}

ffi::Error Q5Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                   ffi::Buffer<ffi::F16> s, ffi::Buffer<ffi::F16> z, ffi::ResultBuffer<ffi::F32> y) {
  return Dense(pool, x, q.typed_data(), q.dimensions(), SKIPPY_PANEL / 2 + SKIPPY_PANEL / 8, s, z, y, 5);
}

// A weight stacked over experts: q [E, Np/64, K, row_bytes], s and z [E, Np/64, groups, 64].
struct Stacked {
  const uint8_t* q;
  const uint16_t* s;
  const uint16_t* z;
  int64_t experts = 0, panels = 0, K = 0, groups = 0;
  int64_t row_bytes = 0;

  template <class B>
  static Stacked Of(const B& q, ffi::Buffer<ffi::F16>& s, ffi::Buffer<ffi::F16>& z, int64_t row_bytes) {
    Stacked st{reinterpret_cast<const uint8_t*>(q.untyped_data()), reinterpret_cast<const uint16_t*>(s.untyped_data()),
               reinterpret_cast<const uint16_t*>(z.untyped_data())};
    auto qd = q.dimensions(), sd = s.dimensions();
    if (qd.size() == 4 && qd[3] == row_bytes && sd.size() == 4 && sd[0] == qd[0] && sd[1] == qd[1] && sd[2] > 0 &&
        qd[2] % sd[2] == 0 && sd[3] == SKIPPY_PANEL && z.element_count() == s.element_count()) {
      st.experts = qd[0], st.panels = qd[1], st.K = qd[2], st.groups = sd[2], st.row_bytes = row_bytes;
    }
    return st;
  }
  bool ok() const { return experts > 0; }
  int64_t width() const { return panels * SKIPPY_PANEL; }

  // out[m, width] = x[m, K] @ expert e, on the panel loops (the pool helps when the work is worth it)
  void Run(ffi::ThreadPool& pool, SkippyPanelFn fn, int64_t e, const float* x, int64_t m, float* out) const {
    const int64_t scales = panels * groups * SKIPPY_PANEL;
    SkippyDenseArgs a{x, q + e * panels * K * row_bytes, s + e * scales, z + e * scales, out, m, K, width(),
                      K / groups, nullptr, nullptr, nullptr};
    RunTasks(pool, panels, m * K * width(), [fn, a](int64_t p) { fn(&a, p); });
  }
};

// The routed experts of an MoE layer in one call: y[n] = sum_k w[n, k] * down_e(silu(gate_e(x[n])) *
// up_e(x[n])), e = ids[n, k]. Pairs are grouped by expert, so each chosen expert's three matrices
// are read once for all the rows that chose it, in place in the stacks; an expert no row chose is
// never touched. `ffn` is the experts' intermediate width (the gate and up outputs' real columns).
ffi::Error MoeFfn(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& ids,
                  ffi::Buffer<ffi::F32>& w, const Stacked& g, const Stacked& u, const Stacked& d,
                  ffi::ResultBuffer<ffi::F32>& y, int64_t ffn, bool q4) {
  auto xd = x.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || w.element_count() != ids.element_count() ||
      !g.ok() || !u.ok() || !d.ok() || g.experts != u.experts || g.experts != d.experts || g.K != xd[1] ||
      u.K != xd[1] || u.panels != g.panels || d.K != ffn || ffn > g.width() || d.width() < xd[1] ||
      y->element_count() != x.element_count()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "moe ffn: x [N, D], ids and w [N, K], gate/up [E, Fp/64, D, b], down [E, Dp/64, F, b]");
  }
  const int64_t N = xd[0], D = xd[1], K = id[1], E = g.experts, pairs = N * K;
  const int32_t* chosen = ids.typed_data();
  std::vector<int64_t> start(E + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    if (chosen[p] < 0 || chosen[p] >= E) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expert out of range");
    ++start[chosen[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[fill[chosen[p]]++] = p;
  const Isa* isa = g_isa.load(std::memory_order_relaxed);
  const SkippyPanelFn fn = q4 ? isa->q4 : isa->int8;
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* out = y->typed_data();
  // One task per chosen expert (the pool's threads take them: a decode step's experts are too
  // small to split by panels, and one expert per core reads both cores' share of memory); each
  // writes its rows' down projections into its own slots of `down`, summed into y after.
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  std::vector<float> down(pairs * d.width());
  auto expert = [&, fn](int64_t i) {
    const int64_t e = used[i], m = start[e + 1] - start[e];
    thread_local std::vector<float> xb, gb, ub, hb;
    xb.resize(m * D), gb.resize(m * g.width()), ub.resize(m * g.width()), hb.resize(m * ffn);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t token = order[start[e] + r] / K;
      std::copy(xs + token * D, xs + (token + 1) * D, xb.data() + r * D);
    }
    g.Run(pool, fn, e, xb.data(), m, gb.data());
    u.Run(pool, fn, e, xb.data(), m, ub.data());
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < ffn; ++j) {
        const float a = gb[r * g.width() + j];
        hb[r * ffn + j] = a / (1.0f + std::exp(-a)) * ub[r * g.width() + j];
      }
    }
    d.Run(pool, fn, e, hb.data(), m, down.data() + start[e] * d.width());
  };
  RunTasks(pool, static_cast<int64_t>(used.size()), pairs * D * ffn * 3, expert);
  std::fill(out, out + N * D, 0.0f);
  for (int64_t i = 0; i < pairs; ++i) {   // in expert order, as the pairs were grouped
    const int64_t p = order[i];
    const float weight = ws[p];
    float* row = out + (p / K) * D;
    const float* src = down.data() + i * d.width();
    for (int64_t j = 0; j < D; ++j) row[j] += weight * src[j];
  }
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error MoeFfnOf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                    ffi::Buffer<T> gq, ffi::Buffer<ffi::F16> gs, ffi::Buffer<ffi::F16> gz, ffi::Buffer<T> uq,
                    ffi::Buffer<ffi::F16> us, ffi::Buffer<ffi::F16> uz, ffi::Buffer<T> dq, ffi::Buffer<ffi::F16> ds,
                    ffi::Buffer<ffi::F16> dz, ffi::ResultBuffer<ffi::F32> y, int64_t ffn) {
  constexpr bool q4 = T == ffi::DataType::U8;
  constexpr int64_t rb = q4 ? SKIPPY_PANEL / 2 : SKIPPY_PANEL;
  return MoeFfn(pool, x, ids, w, Stacked::Of(gq, gs, gz, rb), Stacked::Of(uq, us, uz, rb), Stacked::Of(dq, ds, dz, rb),
                y, ffn, q4);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lanes, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, float scale, int64_t limit) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v.element_count() != k.element_count() || kd[3] != qd[2] || kd[1] <= 0 ||
      qd[1] % kd[1] || qd[1] / kd[1] > SKIPPY_ATTEND_MAX_GROUP || qd[2] > SKIPPY_ATTEND_MAX_DIM ||
      qd[2] % 16 || lanes.element_count() != qd[0] || positions.element_count() != qd[0] || kd[0] <= 0 ||
      limit < 1 || limit > kd[2]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "decode attention: q [B, H, D], k and v [lanes, KVH, C, D], H a multiple of KVH, "
                      "D a multiple of 16, 1 <= limit <= C");
  }
  const SkippyAttendArgs args{q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
                              lanes.typed_data(), positions.typed_data(), qd[0], qd[1], kd[1], kd[0], kd[2],
                              qd[2], limit, scale};
  const SkippyAttendFn fn = g_isa.load(std::memory_order_relaxed)->attend;
  RunTasks(pool, args.B * args.KVH, args.B * args.H * limit * args.D * 2, [fn, args](int64_t t) { fn(&args, t); });
  return ffi::Error::Success();
}

}  // namespace

// Chooses the loops every later call runs: `want` is "auto" (the best ISA this
// CPU supports with float activations) or an ISA name. int8 activations
// (avx512vnni, avx2int8) are never picked by "auto": they part greedy output from
// transformers' within a few tokens on the parity prompts (the float loops
// match every token), so they are a choice a user makes by name. Returns the
// chosen name, or nullptr (and changes nothing) when `want` is unknown, not
// built, or unsupported here.
extern "C" const char* skippy_kernel_select(const char* want) {
  const bool any = std::strcmp(want, "auto") == 0;
  for (const Isa& isa : kIsas) {
    if ((any ? isa.quantize == nullptr : std::strcmp(want, isa.name) == 0) && isa.supported()) {
      g_isa.store(&isa, std::memory_order_relaxed);
      return isa.name;
    }
  }
  return nullptr;
}

// out[0..2] = calls shared with helpers, tasks the helpers ran, backoffs (a caller kept waiting).
extern "C" void skippy_kernel_helper_stats(int64_t* out) {
  out[0] = g_shared_calls.load(), out[1] = g_helper_tasks.load(), out[2] = g_backoffs.load();
}

// Sets the multiply-adds from which a call spreads its tasks over XLA's pool; returns the old value.
// A new setting starts without a backoff.
extern "C" int64_t skippy_kernel_set_min_parallel(int64_t work) {
  g_backoff.store(0);
  return g_min_parallel.exchange(work);
}

// Whether loops named `name` are built into this library and this CPU can run them (1) or
// not (0). Changes nothing: the loops later calls run stay those skippy_kernel_select chose.
extern "C" int skippy_kernel_supports(const char* name) {
  for (const Isa& isa : kIsas) {
    if (std::strcmp(name, isa.name) == 0) return isa.supported() ? 1 : 0;
  }
  return 0;
}

#define SKIPPY_BIND(T)                          \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::ThreadPool>()                   \
      .Arg<ffi::Buffer<ffi::F32>>()             \
      .Arg<ffi::Buffer<T>>()                    \
      .Arg<ffi::Buffer<ffi::F16>>()             \
      .Arg<ffi::Buffer<ffi::F16>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_block_dense, BlockDense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_int8_dense, Int8Dense, SKIPPY_BIND(ffi::S8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_q4_dense, Q4Dense, SKIPPY_BIND(ffi::U8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_q5_dense, Q5Dense, SKIPPY_BIND(ffi::U8));

// x, the experts chosen per row and their weights, then gate, up and down: levels, scales, offsets
#define SKIPPY_BIND_MOE(T)                                                            \
  ffi::Ffi::Bind()                                                                    \
      .Ctx<ffi::ThreadPool>()                                                         \
      .Arg<ffi::Buffer<ffi::F32>>()                                                   \
      .Arg<ffi::Buffer<ffi::S32>>()                                                   \
      .Arg<ffi::Buffer<ffi::F32>>()                                                   \
      .Arg<ffi::Buffer<T>>().Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::F16>>() \
      .Arg<ffi::Buffer<T>>().Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::F16>>() \
      .Arg<ffi::Buffer<T>>().Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::F16>>() \
      .Ret<ffi::Buffer<ffi::F32>>()                                                   \
      .Attr<int64_t>("ffn")

XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_int8_moe_ffn, MoeFfnOf<ffi::S8>, SKIPPY_BIND_MOE(ffi::S8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_q4_moe_ffn, MoeFfnOf<ffi::U8>, SKIPPY_BIND_MOE(ffi::U8));

XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("limit"));
