// Products with bfloat16 weights in float32 arithmetic on CPU, as XLA FFI handlers (see cpu_kernels.py).
//
// Each weight is read once in its stored width (bf16: 2 bytes, int8 / int4 codes: 1 / 0.5) and
// widened to float32 in registers or in an L1-sized panel, then multiplied in float32. XLA:CPU instead
// converts the whole weight to float32 in a separate pass before its dot, which costs more than the
// product itself when few rows multiply it (decode) and is still a large share at prefill row counts.
//
//   gemma4_bf16_cols: out[M, N] = x[M, K] @ w[K, N]    w stored [in, out] (nnx.Linear kernels)
//   gemma4_bf16_rows: out[M, N] = x[M, K] @ w[N, K]^T  w stored [out, in] (the tied embedding table)
//   gemma4_bf16_take: out[i] = float32(table[ids[i]])  (the token lookup)
//   gemma4_q_rows:     out[M, N] = x[M, K] @ deq(w)[N, K]^T  w int8 / int4 codes + group scales (quant.py),
//                      or GGUF blocks as a file stores them (`block`: read in place by the decode rows,
//                      `qdot_raw`; decoded a few rows at a time by the others);
//                      act8: below kGemmRowsT rows, x rounded to int8 per 32 columns, integer dots
//                      (int4 codes: AVX512-VNNI or AVX2; symmetric int8 codes: AVX2); with blocks,
//                      llama.cpp's arithmetic on them in place (Q8_K / Q8_0 / Q8_1 activations, `llama_rows`)
//   gemma4_q_dequant:  deq(w) as float32 [N, K]  (the backward pass of a quantized product)
//   gemma4_attend:     attention of few queries over a [B, T, K, H] KV cache or a paged pool, visible slots only
//   gemma4_kv_write:   new K / V / positions into their cache slots, in place
//
// Each has two algorithms chosen by the number of rows M: below kGemmRowsCols / kGemmRowsT (decode) a weight row is
// read once and multiplied with every row of x; from there on (prefill) a blocked product (`gemm`,
// `gemm_t`) reuses each widened panel across register tiles of x.
// Work is split over XLA's intra-op thread pool. Written with GCC/Clang vector extensions, so the
// compiler maps the 16-lane vectors to what -march=native offers (AVX-512, NEON); with AVX2 and no
// AVX-512 a 16-lane vector is two 8-lane halves, with half the rows of x per register block (16 vector
// registers, not 32), and the code widenings are written with AVX2 intrinsics.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef __linux__
#include <sched.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

using Matrix = ffi::Buffer<ffi::F32, 2>;
using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using MatrixOut = ffi::ResultBuffer<ffi::F32, 2>;
using Index = ffi::Buffer<ffi::S32, 0>;
using Positions = ffi::Buffer<ffi::S32, 2>;  // [B, T] or [B, S] token positions / slots
using Heads = ffi::Buffer<ffi::F32, 4>;      // [B, S, N, H]
using HeadsOut = ffi::ResultBuffer<ffi::F32, 4>;
using PositionsOut = ffi::ResultBuffer<ffi::S32, 2>;
using CachePositions = ffi::Buffer<ffi::S32>;  // [B, T], [P, S] or a stack's [R, X, Y]
using CachePositionsOut = ffi::ResultBuffer<ffi::S32>;

namespace {

// The first of `count` rows of a [rows, ...] weight that `start` (a traced scalar) selects, clamped into
// range as XLA's dynamic-slice clamps its start: a block of the weight read in place (the training loss's
// vocabulary blocks: XLA:CPU slices a bf16 array in float32, from a float32 copy of the whole table).
int64_t block_start(const Index& start, int64_t rows, int64_t count) {
  return std::clamp<int64_t>(start.typed_data()[0], 0, std::max<int64_t>(0, rows - count));
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 without AVX-512: 16 lanes as two 8-lane halves. GCC lowers a 64-byte vector type on this target
// through the stack, element pairs moved one by one (an int8 product of one row ran at 0.6 G codes/s
// on an AMD EPYC); two 32-byte vectors stay in registers.
typedef float f32x8 __attribute__((vector_size(32)));
struct f32x16 {
  f32x8 lo, hi;
  float operator[](int j) const { return j < 8 ? lo[j] : hi[j - 8]; }
  f32x16& operator+=(const f32x16& o) {
    lo += o.lo, hi += o.hi;
    return *this;
  }
};
inline f32x16 operator+(f32x16 a, f32x16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline f32x16 operator-(f32x16 a, f32x16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline f32x16 operator*(f32x16 a, f32x16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline f32x16 operator+(f32x16 a, float b) { return {a.lo + b, a.hi + b}; }
inline f32x16 operator*(f32x16 a, float b) { return {a.lo * b, a.hi * b}; }
inline f32x16 operator*(float a, f32x16 b) { return {a * b.lo, a * b.hi}; }
inline f32x16 load_f32(const float* p) {
  return {reinterpret_cast<f32x8>(_mm256_loadu_ps(p)), reinterpret_cast<f32x8>(_mm256_loadu_ps(p + 8))};
}
inline void store_f32(float* p, f32x16 v) {
  _mm256_storeu_ps(p, reinterpret_cast<__m256>(v.lo));
  _mm256_storeu_ps(p + 8, reinterpret_cast<__m256>(v.hi));
}
inline float hsum(f32x16 v) { return hsum8(reinterpret_cast<__m256>(v.lo + v.hi)); }
inline f32x16 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i a = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16);
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16);
  return {reinterpret_cast<f32x8>(_mm256_castsi256_ps(a)), reinterpret_cast<f32x8>(_mm256_castsi256_ps(b))};
}
#else
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load_bf16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_f32(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(f32x16 v) {
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += v[j];
  return s;
}
#endif
inline float widen(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Rows of x held in registers at once by the decode kernels: 8 with AVX-512's 32 vector registers,
// 4 with AVX2's 16 (8 rows of 16-lane sums spill there and measured slower on an AMD EPYC).
// Likewise the blocked product's register tile: kTileRows rows by 32 columns (or 2 * kTileRows by 16).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kRowBlock = 4;
constexpr int kTileRows = 3;
#else
constexpr int kRowBlock = 8;
constexpr int kTileRows = 12;
#endif

// block(std::integral_constant<int, MB>{}, m) over rows [m, m + MB) of M, in as few blocks as kRowBlock
// allows, of sizes that differ by at most one (13 rows: 6 + 7, not 8 + 4 + 1): each block reads the weight
// once, and a block of one or two rows pays that read for little arithmetic. Every row's sums are the same
// in any block (each row has its own accumulators, summed in the same order).
template <int MB, typename Block>
void row_block(int64_t rows, int64_t m, Block& block) {
  if constexpr (MB > 1)
    if (rows < MB) return row_block<MB - 1>(rows, m, block);
  block(std::integral_constant<int, MB>{}, m);
}

template <typename Block>
void for_row_blocks(int64_t M, Block&& block) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t rows = (M - m) / (blocks - b);
    row_block<kRowBlock>(rows, m, block);
    m += rows;
  }
}

// fn(t) for t in [0, n) on the calling thread and XLA's intra-op pool. Tasks are claimed from an
// atomic counter and the caller waits only until every task has *finished*; a helper that starts
// late (or never, while the pool runs other work) finds nothing left, so a call can neither stall
// on a busy pool nor deadlock when several calls run at once.
struct Tasks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  int64_t n = 0;
  std::function<void(int64_t)> fn;
  void run() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      fn(t);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// The cores this process may run on (its affinity mask: `taskset`, a container's CPU set).
int64_t usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// The threads a call's tasks run on: the calling thread (XLA's executor, not a thread of the pool, which
// has one per core) and at most one helper fewer than the cores. One helper per pool thread put cores + 1
// busy threads on the cores, and a task claimed by a thread the OS then set aside held the whole call up
// until it ran again (the short products of a prompt or a decode step ran slower by phases, as if one
// core fewer helped). The one count both for `parallel_for` and for sizing tasks (`rows_per_task`, the
// blocked products' panels per task, the column form's partial sums): planning for the pool's threads + 1
// while fewer ran left the last round of tasks to part of the cores.
int64_t workers(ffi::ThreadPool& pool) {
  static const int64_t cores = usable_cores();
  return 1 + std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), cores - 1));
}

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  const int64_t helpers = std::min<int64_t>(workers(pool) - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  auto tasks = std::make_shared<Tasks>();
  tasks->n = n;
  tasks->fn = std::forward<F>(fn);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([tasks] { tasks->run(); });
  tasks->run();
  while (tasks->finished.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Whether row x[0:K] is all zeros (+0 or -0). A live row usually stops the scan at its first element.
inline bool zero_row(const float* x, int64_t K) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(x);
  for (int64_t k = 0; k < K; ++k)
    if (u[k] << 1) return false;
  return true;
}

// The products skip the rows of x [M, K] that are all zero: the padding tokens of a prompt batch (a
// prompt padded to its bucket, rows that pad the batch), whose rows Gemma4 keeps zero through the whole
// network, and the finished rows of a decode step. Their rows of out [M, N] are written as zeros, what
// the product gives with finite weights. fn(x', out', M') runs the product, with the algorithm the
// caller chose from the full M (so every live row's result is bit-for-bit what it was), on the live rows:
// in place when they are the first M' rows (a right-padded prompt), else packed into a copy.
template <typename Fn>
void on_live_rows(const float* X, float* Y, int64_t M, int64_t K, int64_t N, Fn&& fn) {
  std::vector<int64_t> live;
  live.reserve(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m)
    if (!zero_row(X + m * K, K)) live.push_back(m);
  const int64_t L = static_cast<int64_t>(live.size());
  if (L == M) {
    fn(X, Y, M);
    return;
  }
  if (L == 0 || live[L - 1] == L - 1) {
    if (L > 0) fn(X, Y, L);
    std::fill(Y + L * N, Y + M * N, 0.f);
    return;
  }
  std::vector<float> xc(static_cast<size_t>(L * K)), yc(static_cast<size_t>(L * N));
  for (int64_t i = 0; i < L; ++i) std::memcpy(xc.data() + i * K, X + live[i] * K, sizeof(float) * K);
  fn(static_cast<const float*>(xc.data()), yc.data(), L);
  std::fill(Y, Y + M * N, 0.f);
  for (int64_t i = 0; i < L; ++i) std::memcpy(Y + live[i] * N, yc.data() + i * N, sizeof(float) * N);
}

// Rows of a weight per task for the decode kernels, which stream the weight row by row: at least four
// tasks per worker when each still reads 16 KB or more (the projections of small models are a few
// hundred KB: one ~1 MB task per call left the other cores idle, and 5 tasks on 3 workers left one
// idle for the last), at most ~1 MB of weight per task.
int64_t rows_per_task(ffi::ThreadPool& pool, int64_t N, int64_t row_bytes) {
  row_bytes = std::max<int64_t>(row_bytes, 1);
  const int64_t most = std::max<int64_t>(16, (int64_t{1} << 20) / row_bytes);
  const int64_t least = std::max<int64_t>(1, (int64_t{1} << 14) / row_bytes);
  const int64_t even = (N + 4 * workers(pool) - 1) / (4 * workers(pool));
  return std::max(least, std::min(most, even));
}

// acc[M, N] = x[M, k0:k1] @ w[k0:k1, N]. Four rows of w are widened together and folded into each
// accumulator row at once, so acc is loaded and stored once per four rows of w.
void cols_task(const float* __restrict__ x, const uint16_t* __restrict__ w, float* __restrict__ acc, int64_t M,
               int64_t K, int64_t N, int64_t k0, int64_t k1) {
  std::memset(acc, 0, sizeof(float) * M * N);
  const int64_t nv = N / 16 * 16;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const uint16_t* w0 = w + k * N;
    const uint16_t* w1 = w0 + N;
    const uint16_t* w2 = w1 + N;
    const uint16_t* w3 = w2 + N;
    for (int64_t n = 0; n < nv; n += 16) {
      // The hardware prefetcher alone leaves one core short of the memory bandwidth: ask for the
      // same columns of the next four rows (measured faster on a 2-core Xeon).
      __builtin_prefetch(w0 + 4 * N + n);
      __builtin_prefetch(w1 + 4 * N + n);
      __builtin_prefetch(w2 + 4 * N + n);
      __builtin_prefetch(w3 + 4 * N + n);
      const f32x16 a0 = load_bf16(w0 + n), a1 = load_bf16(w1 + n), a2 = load_bf16(w2 + n), a3 = load_bf16(w3 + n);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        float* am = acc + m * N + n;
        store_f32(am, load_f32(am) + xm[0] * a0 + xm[1] * a1 + xm[2] * a2 + xm[3] * a3);
      }
    }
    for (int64_t n = nv; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        acc[m * N + n] += xm[0] * widen(w0[n]) + xm[1] * widen(w1[n]) + xm[2] * widen(w2[n]) + xm[3] * widen(w3[n]);
      }
  }
  for (; k < k1; ++k) {
    const uint16_t* w0 = w + k * N;
    for (int64_t n = 0; n < nv; n += 16) {
      const f32x16 a0 = load_bf16(w0 + n);
      for (int64_t m = 0; m < M; ++m) {
        float* am = acc + m * N + n;
        store_f32(am, load_f32(am) + x[m * K + k] * a0);
      }
    }
    for (int64_t n = nv; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) acc[m * N + n] += x[m * K + k] * widen(w0[n]);
  }
}

// ---------------------------------------------------------------------------- many rows (prefill)
// out[M, N] = x[M, K] @ W[K, N] for any stored form of W, as a blocked matrix product: a panel of W
// (kKc rows of K by kNr = 32 columns) is widened into a float32 buffer that stays in L1, and every
// group of MR rows of x is multiplied with it in registers (2 * MR accumulators of 16 lanes, one
// broadcast of x and two loads of the panel per k). The weight is read once per call in its stored
// width and never exists as a whole float32 matrix; products are exact float32 products of the stored
// values, summed in increasing k (XLA's dot sums in another order: relative differences ~1e-6).
// `Pack` fills panel[kk * kNr + j] = W[k0 + kk, n0 + j] for kk < kc, j < kNr (zero past N).
constexpr int64_t kNr = 32;
constexpr int64_t kKc = 256;
constexpr int64_t kMc = 192;  // rows of x per task: kMc x kKc floats (192 KB) stay in L2

template <int MR, int NV = 2>  // NV vectors of 16 columns: 32 (NV = 2) or 16
inline void gemm_tile(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel, int64_t kc,
                      float* __restrict__ c, int64_t ldc, int64_t ncols, bool first) {
  constexpr int64_t W = 16 * NV;  // the panel's row length
  f32x16 acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    if (first) {
      for (int v = 0; v < NV; ++v) acc[m][v] = f32x16{};
    } else {
      alignas(64) float t[W] = {};
      const float* src = c + m * ldc;
      if (ncols < W) src = static_cast<const float*>(std::memcpy(t, src, sizeof(float) * ncols));
      for (int v = 0; v < NV; ++v) acc[m][v] = load_f32(src + 16 * v);
    }
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    f32x16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load_f32(panel + kk * W + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + kk];
      for (int v = 0; v < NV; ++v) acc[m][v] += xv * b[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (ncols == W) {
      for (int v = 0; v < NV; ++v) store_f32(c + m * ldc + 16 * v, acc[m][v]);
    } else {
      alignas(64) float t[W];
      for (int v = 0; v < NV; ++v) store_f32(t + 16 * v, acc[m][v]);
      std::memcpy(c + m * ldc, t, sizeof(float) * ncols);
    }
  }
}

// fn(m0, m1, n0, ncols) over blocks of kMc rows of x by kNr-column panels of W, split into tasks of a
// few panels each (enough tasks to balance the pool) for one block of rows of x.
template <typename Fn>
void for_each_panel(ffi::ThreadPool& pool, int64_t M, int64_t N, Fn&& fn) {
  const int64_t panels = (N + kNr - 1) / kNr, mblocks = (M + kMc - 1) / kMc;
  const int64_t per_task = std::max<int64_t>(1, panels / (8 * workers(pool)));
  const int64_t ptasks = (panels + per_task - 1) / per_task;
  parallel_for(pool, ptasks * mblocks, [&](int64_t t) {
    const int64_t m0 = (t % mblocks) * kMc, m1 = std::min(M, m0 + kMc);
    const int64_t p0 = (t / mblocks) * per_task, p1 = std::min(panels, p0 + per_task);
    for (int64_t p = p0; p < p1; ++p) fn(m0, m1, p * kNr, std::min(kNr, N - p * kNr));
  });
}

template <typename Pack>
void gemm(ffi::ThreadPool& pool, const float* X, float* Y, int64_t M, int64_t K, int64_t N, Pack&& pack) {
  for_each_panel(pool, M, N, [&](int64_t m0, int64_t m1, int64_t n0, int64_t ncols) {
    alignas(64) float panel[kKc * kNr];
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      pack(panel, n0, ncols, k0, kc);
      const float* xk = X + k0;
      float* c = Y + n0;
      int64_t m = m0;
      for (; m + kTileRows <= m1; m += kTileRows)
        gemm_tile<kTileRows>(xk + m * K, K, panel, kc, c + m * N, N, ncols, k0 == 0);
      if constexpr (kTileRows > 4)
        for (; m + 4 <= m1; m += 4) gemm_tile<4>(xk + m * K, K, panel, kc, c + m * N, N, ncols, k0 == 0);
      for (; m < m1; ++m) gemm_tile<1>(xk + m * K, K, panel, kc, c + m * N, N, ncols, k0 == 0);
    }
  });
}

#if defined(__AVX512BF16__)
// The same blocked product with activations rounded to bf16 (round to nearest even) and the
// AVX512-BF16 dot instruction: vdpbf16ps adds two bf16 products per float32 lane, twice the multiply
// rate of float32 FMAs; sums stay float32. Chosen per model (`Matmul(bf16_products=True)`), for the
// column form (bf16 [in, out] kernels) from kGemmRowsCols rows. The panel holds pairs of rows of W:
// lane j of pair i is W[2i, j] | W[2i + 1, j] << 16, the matching x pair is broadcast as one 32-bit word.
inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u) return (u >> 16) | ((u & 0xFFFF) ? 0x40 : 0);  // inf, NaN stays NaN
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

template <int MR>
inline void gemm_tile_bf16(const uint32_t* __restrict__ xb, int64_t ldx, const uint32_t* __restrict__ panel,
                           int64_t pairs, float* __restrict__ c, int64_t ldc, int64_t ncols, bool first) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) {
    if (first) {
      acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    } else {
      alignas(64) float t[kNr] = {};
      const float* src = c + m * ldc;
      if (ncols < kNr) src = static_cast<const float*>(std::memcpy(t, src, sizeof(float) * ncols));
      acc[m][0] = _mm512_loadu_ps(src), acc[m][1] = _mm512_loadu_ps(src + 16);
    }
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + i * kNr);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + i * kNr + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[m * ldx + i]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float t[kNr];
    float* dst = ncols == kNr ? c + m * ldc : t;
    _mm512_storeu_ps(dst, acc[m][0]), _mm512_storeu_ps(dst + 16, acc[m][1]);
    if (ncols < kNr) std::memcpy(c + m * ldc, t, sizeof(float) * ncols);
  }
}

// out[M, N] = bf16(x)[M, K] @ W[K, N] for bf16 W, float32 sums.
void gemm_bf16(ffi::ThreadPool& pool, const float* X, const uint16_t* W, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t P = (K + 1) / 2;  // pairs of k (an odd K ends with a zero)
  std::vector<uint32_t> xb(static_cast<size_t>(M * P));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < P; ++i) {
      const uint32_t lo = bf16_bits(X[m * K + 2 * i]);
      const uint32_t hi = 2 * i + 1 < K ? bf16_bits(X[m * K + 2 * i + 1]) : 0u;
      xb[m * P + i] = lo | hi << 16;
    }
  constexpr int64_t kPc = kKc / 2;  // pairs per panel
  for_each_panel(pool, M, N, [&](int64_t m0, int64_t m1, int64_t n0, int64_t ncols) {
    alignas(64) uint32_t panel[kPc * kNr];
    for (int64_t i0 = 0; i0 < P; i0 += kPc) {
      const int64_t pc = std::min(kPc, P - i0);
      for (int64_t i = 0; i < pc; ++i) {
        const int64_t k = 2 * (i0 + i);
        const uint16_t* r0 = W + k * N + n0;
        const uint16_t* r1 = k + 1 < K ? r0 + N : nullptr;
        uint32_t* dst = panel + i * kNr;
        if (ncols == kNr && r1) {
          for (int v = 0; v < 2; ++v) {
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * v)));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * v)));
            _mm512_store_si512(dst + 16 * v, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
          }
        } else {
          for (int64_t j = 0; j < kNr; ++j)
            dst[j] = j < ncols ? (uint32_t{r0[j]} | (r1 ? uint32_t{r1[j]} << 16 : 0u)) : 0u;
        }
      }
      const uint32_t* xk = xb.data() + i0;
      float* c = Y + n0;
      int64_t m = m0;
      for (; m + 12 <= m1; m += 12) gemm_tile_bf16<12>(xk + m * P, P, panel, pc, c + m * N, N, ncols, i0 == 0);
      for (; m + 4 <= m1; m += 4) gemm_tile_bf16<4>(xk + m * P, P, panel, pc, c + m * N, N, ncols, i0 == 0);
      for (; m < m1; ++m) gemm_tile_bf16<1>(xk + m * P, P, panel, pc, c + m * N, N, ncols, i0 == 0);
    }
  });
}

// out[M, N] = bf16(x)[M, K] @ W[N, K]^T for bf16 W stored by rows and an even K (the backward of the
// column form: the input gradient g @ W^T of an [in, out] kernel). The same tile with the roles
// swapped, as `gemm_t` swaps them: a row of W is already its own pairs (32-bit words), broadcast one at a
// time; blocks of kNr rows of x are rounded and packed once per call into pairs [K / 2][kNr] (lane j:
// row j of the block). A task owns a range of rows of W and accumulates out^T[rows of W, rows of x] over
// panels of kKc / 2 pairs, written back transposed at the end.
void gemm_t_bf16(ffi::ThreadPool& pool, const float* X, const uint16_t* W, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t P = K / 2, mblocks = (M + kNr - 1) / kNr;
  // 64-byte aligned (the tile's panel loads are aligned): one spare line to align the start
  std::vector<uint32_t> xbuf(static_cast<size_t>(mblocks * P * kNr + 16));
  uint32_t* xp = xbuf.data() + ((64 - reinterpret_cast<uintptr_t>(xbuf.data()) % 64) % 64) / 4;
  parallel_for(pool, mblocks, [&](int64_t b) {
    const int64_t m0 = b * kNr, rows = std::min(kNr, M - m0);
    uint32_t* dst = xp + b * P * kNr;
    for (int64_t j = 0; j < kNr; ++j) {
      const float* x = X + (m0 + j) * K;
      for (int64_t i = 0; i < P; ++i)
        dst[i * kNr + j] = j < rows ? (bf16_bits(x[2 * i]) | bf16_bits(x[2 * i + 1]) << 16) : 0u;
    }
  });
  const uint32_t* Wp = reinterpret_cast<const uint32_t*>(W);
  constexpr int64_t kPc = kKc / 2, R = 24;
  const int64_t blocks = (N + R - 1) / R;
  const int64_t per_task = std::max<int64_t>(1, std::min<int64_t>(16, blocks / (8 * workers(pool))));
  parallel_for(pool, (blocks + per_task - 1) / per_task, [&](int64_t t) {
    const int64_t n_begin = t * per_task * R, n_end = std::min(N, n_begin + per_task * R), nn = n_end - n_begin;
    std::vector<float> ct(static_cast<size_t>(mblocks * nn * kNr));  // block b: [nn, kNr]
    for (int64_t n = n_begin; n < n_end; n += R) {
      const int64_t nr = std::min(R, n_end - n);
      for (int64_t i0 = 0; i0 < P; i0 += kPc) {
        const int64_t pc = std::min(kPc, P - i0);
        for (int64_t b = 0; b < mblocks; ++b) {
          const uint32_t* panel = xp + (b * P + i0) * kNr;
          float* c = ct.data() + (b * nn + n - n_begin) * kNr;
          const uint32_t* w = Wp + n * P + i0;
          const bool first = i0 == 0;
          int64_t r = 0;
          for (; r + 12 <= nr; r += 12) gemm_tile_bf16<12>(w + r * P, P, panel, pc, c + r * kNr, kNr, kNr, first);
          for (; r + 4 <= nr; r += 4) gemm_tile_bf16<4>(w + r * P, P, panel, pc, c + r * kNr, kNr, kNr, first);
          for (; r < nr; ++r) gemm_tile_bf16<1>(w + r * P, P, panel, pc, c + r * kNr, kNr, kNr, first);
        }
      }
    }
    for (int64_t b = 0; b < mblocks; ++b) {
      const int64_t m0 = b * kNr, rows = std::min(kNr, M - m0);
      const float* c = ct.data() + b * nn * kNr;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t n = n_begin; n < n_end; ++n) Y[(m0 + i) * N + n] = c[(n - n_begin) * kNr + i];
    }
  });
}
constexpr bool kHasBf16Dot = true;
#else
void gemm_bf16(ffi::ThreadPool&, const float*, const uint16_t*, float*, int64_t, int64_t, int64_t) {}
void gemm_t_bf16(ffi::ThreadPool&, const float*, const uint16_t*, float*, int64_t, int64_t, int64_t) {}
constexpr bool kHasBf16Dot = false;
#endif

// out[M, N] = x[M, K] @ W[N, K]^T for a weight stored by rows (the token table, quantized codes): the
// same tile with the roles swapped. Each block of kXBlock (or, for the last few, 16) rows of x is transposed
// once per call into xt[k * width + i] (zero past the block's rows). A task owns a range of rows of W
// and takes them 24 at a time: for each kKc-wide slice of K those rows are widened / dequantized once
// into a small contiguous buffer (`row(n, k0, kc, dst)`: no transposed stores of the weight) and
// multiplied with the slice of every block of x (tiles of 12 rows of W by 32 rows of x, or 24 by 16),
// so each weight element is dequantized once per call. The tiles accumulate out^T[rows of W, rows of
// x] in `ct` over the whole of K, written back transposed at the end.
// Rows of x per block of `gemm_t`: 32 (tiles of kTileRows rows of W by 32), or 16 with AVX2 and no
// AVX-512, where a 3 x 32 tile needs 12 accumulators, 4 panel vectors and a broadcast: more than the 16
// vector registers (it spilled: 15-30% slower per row than the 6 x 16 tile on an AMD EPYC). The sums are
// the same either way (each output sums its products in increasing k).
constexpr int64_t kXBlock = kRowBlock == 4 ? 16 : kNr;

template <typename Row>
void gemm_t(ffi::ThreadPool& pool, const float* X, float* Y, int64_t M, int64_t K, int64_t N, Row&& row) {
  const int64_t mblocks = (M + kXBlock - 1) / kXBlock;
  auto width = [&](int64_t b) { return std::min(kXBlock, M - b * kXBlock) > 16 ? kNr : int64_t{16}; };
  std::vector<float> xt(static_cast<size_t>(mblocks * K * kXBlock));
  const int64_t kchunks = (K + kKc - 1) / kKc;
  parallel_for(pool, mblocks * kchunks, [&](int64_t t) {
    const int64_t b = t / kchunks, k0 = (t % kchunks) * kKc, k1 = std::min(K, k0 + kKc);
    const int64_t m0 = b * kXBlock, rows = std::min(kXBlock, M - m0), w = width(b);
    float* dst = xt.data() + b * K * kXBlock;
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t i = 0; i < rows; ++i) dst[k * w + i] = X[(m0 + i) * K + k];
      for (int64_t i = rows; i < w; ++i) dst[k * w + i] = 0.f;
    }
  });
  constexpr int64_t R = 24;  // rows of W dequantized together: whole tiles of kTileRows or 2 * kTileRows
  const int64_t blocks = (N + R - 1) / R;
  const int64_t per_task = std::max<int64_t>(1, std::min<int64_t>(16, blocks / (8 * workers(pool))));
  parallel_for(pool, (blocks + per_task - 1) / per_task, [&](int64_t t) {
    const int64_t n_begin = t * per_task * R, n_end = std::min(N, n_begin + per_task * R), nn = n_end - n_begin;
    std::vector<float> ct(static_cast<size_t>(mblocks * nn * kXBlock));  // block b: [nn, width(b)]
    alignas(64) float wbuf[R * kKc];
    for (int64_t n = n_begin; n < n_end; n += R) {
      const int64_t nr = std::min(R, n_end - n);
      for (int64_t k0 = 0; k0 < K; k0 += kKc) {
        const int64_t kc = std::min(kKc, K - k0);
        for (int64_t r = 0; r < nr; ++r) row(n + r, k0, kc, wbuf + r * kc);
        for (int64_t b = 0; b < mblocks; ++b) {
          const int64_t w = width(b);
          const float* panel = xt.data() + b * K * kXBlock + k0 * w;
          float* c = ct.data() + b * nn * kXBlock + (n - n_begin) * w;
          const bool first = k0 == 0;
          if (w == kNr) {
            int64_t r = 0;
            for (; r + kTileRows <= nr; r += kTileRows)
              gemm_tile<kTileRows, 2>(wbuf + r * kc, kc, panel, kc, c + r * w, w, w, first);
            for (; r < nr; ++r) gemm_tile<1, 2>(wbuf + r * kc, kc, panel, kc, c + r * w, w, w, first);
          } else if (nr == R) {
            for (int64_t r = 0; r < R; r += 2 * kTileRows)
              gemm_tile<2 * kTileRows, 1>(wbuf + r * kc, kc, panel, kc, c + r * w, w, w, first);
          } else {
            for (int64_t r = 0; r < nr; ++r) gemm_tile<1, 1>(wbuf + r * kc, kc, panel, kc, c + r * w, w, w, first);
          }
        }
      }
    }
    for (int64_t b = 0; b < mblocks; ++b) {
      const int64_t w = width(b), m0 = b * kXBlock, rows = std::min(kXBlock, M - m0);
      const float* c = ct.data() + b * nn * kXBlock;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t n = n_begin; n < n_end; ++n) Y[(m0 + i) * N + n] = c[(n - n_begin) * w + i];
    }
  });
}

// Rows of x from which a product runs as `gemm` / `gemm_t` rather than the decode kernels below
// (which read x once per weight row: the column form keeps [M, N] partial sums, slow from ~8 rows;
// the row forms hold 8 rows of x in registers and stay fast longer). Measured on 1536 x 6144 here,
// see cpu_kernels.py (GEMM_ROWS_COLS, GEMM_ROWS_T).
constexpr int64_t kGemmRowsCols = 8;
constexpr int64_t kGemmRowsT = 24;
// The float products of codes (not the int8-activation ones) switch earlier with AVX2 and no AVX-512:
// their decode form widens and scales the codes once per 4 rows of x (not 8), and from ~10 rows the
// blocked product's 6 x 16 tiles are faster (13 rows of the 270M's 2048 x 640 Q5_0 codes: 505 -> 380 us).
constexpr int64_t kGemmRowsTFloatCodes = kRowBlock == 4 ? 12 : kGemmRowsT;

// out[M, N] = x[M, K] @ w[start : start + K, :] (w [>= K, N]; all of w when it has K rows).
ffi::Error Cols(ffi::ThreadPool pool, Matrix x, Bf16Matrix w, Index start, MatrixOut out, bool bf16) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  if (w.dimensions()[0] < K) return ffi::Error::InvalidArgument("gemma4_bf16_cols: x [M, K] and w [>= K, N] disagree");
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.typed_data()) + block_start(start, w.dimensions()[0], K) * N;
  if (M * N == 0) return ffi::Error::Success();
  on_live_rows(x.typed_data(), out->typed_data(), M, K, N, [&](const float* X, float* Y, int64_t rows) {
    if (M >= kGemmRowsCols && bf16 && kHasBf16Dot) {
      gemm_bf16(pool, X, W, Y, rows, K, N);
      return;
    }
    if (M >= kGemmRowsCols) {
      gemm(pool, X, Y, rows, K, N, [&](float* panel, int64_t n0, int64_t ncols, int64_t k0, int64_t kc) {
        for (int64_t kk = 0; kk < kc; ++kk) {
          const uint16_t* src = W + (k0 + kk) * N + n0;
          float* dst = panel + kk * kNr;
          if (ncols == kNr) {
            store_f32(dst, load_bf16(src)), store_f32(dst + 16, load_bf16(src + 16));
          } else {
            for (int64_t j = 0; j < kNr; ++j) dst[j] = j < ncols ? widen(src[j]) : 0.f;
          }
        }
      });
      return;
    }
    // Each task streams a contiguous block of rows of w (in memory order) into its own [rows, N] partial
    // sum; the partial sums are added at the end (two per worker: their count, and so the order of the
    // sums, follows the cores, never the rows of x).
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(2 * workers(pool), K / 128));
    std::vector<float> part(static_cast<size_t>(nt * rows * N));
    parallel_for(pool, nt, [&](int64_t t) {
      cols_task(X, W, part.data() + t * rows * N, rows, K, N, K * t / nt, K * (t + 1) / nt);
    });
    for (int64_t i = 0; i < rows * N; ++i) {
      float s = part[i];
      for (int64_t t = 1; t < nt; ++t) s += part[t * rows * N + i];
      Y[i] = s;
    }
  });
  return ffi::Error::Success();
}

// out[m0:m0+MB, n0:n1] for rows n0..n1 of w [N, K]: each row of w is widened once per MB rows of x.
template <int MB>
void rows_block(const float* __restrict__ x, const uint16_t* __restrict__ w, float* __restrict__ out, int64_t K,
                int64_t N, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t kv = K / 16 * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    f32x16 s[MB];
    for (int m = 0; m < MB; ++m) s[m] = f32x16{};
    for (int64_t k = 0; k < kv; k += 16) {
      __builtin_prefetch(wr + 2 * K + k);  // two rows ahead (see cols_task)
      const f32x16 wv = load_bf16(wr + k);
      for (int m = 0; m < MB; ++m) s[m] += load_f32(x + (m0 + m) * K + k) * wv;
    }
    for (int m = 0; m < MB; ++m) {
      float total = hsum(s[m]);
      for (int64_t k = kv; k < K; ++k) total += x[(m0 + m) * K + k] * widen(wr[k]);
      out[(m0 + m) * N + n] = total;
    }
  }
}

// out[M, N] = x[M, K] @ w[start : start + N, :]^T (w [>= N, K]; all of w when it has N rows).
// bf16: from kGemmRowsT rows and for an even K, x is rounded to bf16 and multiplied with vdpbf16ps
// (`gemm_t_bf16`; the backward of a bf16 column product), like Cols' bf16.
ffi::Error Rows(ffi::ThreadPool pool, Matrix x, Bf16Matrix w, Index start, MatrixOut out, bool bf16) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = out->dimensions()[1];
  if (w.dimensions()[1] != K || w.dimensions()[0] < N)
    return ffi::Error::InvalidArgument("gemma4_bf16_rows: x [M, K] and w [>= N, K] disagree");
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.typed_data()) + block_start(start, w.dimensions()[0], N) * K;
  if (M * N == 0) return ffi::Error::Success();
  on_live_rows(x.typed_data(), out->typed_data(), M, K, N, [&](const float* X, float* Y, int64_t rows) {
    if (M >= kGemmRowsT && bf16 && kHasBf16Dot && K % 2 == 0) {
      gemm_t_bf16(pool, X, W, Y, rows, K, N);
      return;
    }
    if (M >= kGemmRowsT) {
      gemm_t(pool, X, Y, rows, K, N, [&](int64_t n, int64_t k0, int64_t kc, float* dst) {
        const uint16_t* src = W + n * K + k0;
        int64_t j = 0;
        for (; j + 16 <= kc; j += 16) store_f32(dst + j, load_bf16(src + j));
        for (; j < kc; ++j) dst[j] = widen(src[j]);
      });
      return;
    }
    const int64_t per_task = rows_per_task(pool, N, 2 * K);
    const int64_t nt = (N + per_task - 1) / per_task;
    parallel_for(pool, nt, [&](int64_t t) {
      const int64_t n0 = t * per_task, n1 = std::min(N, n0 + per_task);
      for_row_blocks(rows, [&](auto mb, int64_t m) { rows_block<decltype(mb)::value>(X, W, Y, K, N, n0, n1, m); });
    });
  });
  return ffi::Error::Success();
}

// out[i, :] = float32(table[ids[i], :]) for a bf16 table [V, D]: the token lookup reads only the rows
// it needs (XLA:CPU gathers bf16 from a converted or bit-cast copy of the whole table). Negative ids
// count from the end, ids outside [-V, V) give NaN rows (jnp.take's "fill").
ffi::Error Take(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids, Bf16Matrix table, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t V = table.dimensions()[0], D = table.dimensions()[1];
  const int32_t* I = ids.typed_data();
  const uint16_t* T = reinterpret_cast<const uint16_t*>(table.typed_data());
  float* Y = out->typed_data();
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = I[i];
    if (id < 0) id += V;
    float* dst = Y + i * D;
    if (id < 0 || id >= V) {
      for (int64_t j = 0; j < D; ++j) dst[j] = __builtin_nanf("");
      continue;
    }
    const uint16_t* src = T + id * D;
    int64_t j = 0;
    for (; j + 16 <= D; j += 16) store_f32(dst + j, load_bf16(src + j));
    for (; j < D; ++j) dst[j] = widen(src[j]);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- quantized weights
// out[M, N] = x[M, K] @ deq(w)[N, K]^T for a weight stored as group-quantized codes (gemma4_nnx.model.quant):
// row n of w is codes[n] (int8 [K], uint8 [K] when asymmetric, or two nibbles a byte [K/2]) with one
// float32 scale (and min) per `group` columns: w[n, k] = code * scale - min. Each row is dequantized
// once into a float32 buffer in L1 and multiplied with up to eight rows of x at a time, so a weight
// is read from memory once per call at 1 or 0.5 bytes.
template <int MB>
inline void dot_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int64_t K,
                     int64_t N, int64_t n, int64_t m0) {
  const int64_t kv = K / 16 * 16;
  f32x16 s[MB];
  for (int m = 0; m < MB; ++m) s[m] = f32x16{};
  for (int64_t k = 0; k < kv; k += 16) {
    const f32x16 wv = load_f32(w + k);
    for (int m = 0; m < MB; ++m) s[m] += load_f32(x + (m0 + m) * K + k) * wv;
  }
  for (int m = 0; m < MB; ++m) {
    float total = hsum(s[m]);
    for (int64_t k = kv; k < K; ++k) total += x[(m0 + m) * K + k] * w[k];
    out[(m0 + m) * N + n] = total;
  }
}

// `block` != 0: codes are GGUF blocks as a file stores them (uint8 [N, row_bytes], GGML type number
// `block`; bits / group / asym are those of the decoded codes). The decode kernels read them in place
// (`qdot_block`'s RAW; with act8 `llama_rows`); the other products decode a chunk of rows at a time
// (`over_rows`) into the codes + scales layout, a view whose first row is `row0`.
struct QWeight {
  const uint8_t* codes;
  const float* scales;
  const float* mins;
  int64_t N, K, group, code_cols;
  int bits;
  bool asym;
  int block = 0;
  int64_t row0 = 0;
  const uint8_t* row_codes(int64_t n) const { return codes + (n - row0) * code_cols; }
  const float* row_scales(int64_t n) const { return scales + (n - row0) * (K / group); }
  const float* row_mins(int64_t n) const { return asym ? mins + (n - row0) * (K / group) : nullptr; }
};

// ---------------------------------------------------------------------------- GGUF blocks
// Decoded exactly as gemma4_nnx.model.blocks.decode (the float32 scales are the same float32
// products), so a product of blocks is bit for bit the product of their decoded codes and scales.
struct BlockType {
  int id, elements, bytes;
};
constexpr BlockType kBlockTypes[] = {{2, 32, 18}, {3, 32, 20}, {6, 32, 22}, {8, 32, 34},
                                     {12, 256, 144}, {13, 256, 176}, {14, 256, 210}};
const BlockType* block_type(int64_t id) {
  for (const auto& t : kBlockTypes)
    if (t.id == id) return &t;
  return nullptr;
}

// float16 (two little-endian bytes) -> float32, exactly: F16C's instruction where the kernels are built for
// it, else the bit manipulation of the FP16 library (normals rescaled by 2^-112, subnormals by a magic bias).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t w = static_cast<uint32_t>(h) << 16, two_w = w + w;
  uint32_t norm_bits = (two_w >> 4) + (0xE0u << 23), denorm_bits = (two_w >> 17) | (126u << 23), out;
  float norm, denorm;
  std::memcpy(&norm, &norm_bits, 4);
  std::memcpy(&denorm, &denorm_bits, 4);
  norm *= 0x1.0p-112f;
  denorm -= 0.5f;
  std::memcpy(&out, two_w < (1u << 27) ? static_cast<const void*>(&denorm) : static_cast<const void*>(&norm), 4);
  out |= w & 0x80000000u;
  float f;
  std::memcpy(&f, &out, 4);
  return f;
#endif
}

// bytes i of kBit4[b]: 0x10 where bit i of b is set (the fifth bits of 8 Q5_0 codes)
struct Bit4Table {
  uint64_t v[256];
  Bit4Table() {
    for (int b = 0; b < 256; ++b) {
      v[b] = 0;
      for (int i = 0; i < 8; ++i)
        if (b >> i & 1) v[b] |= uint64_t{0x10} << (8 * i);
    }
  }
};
const Bit4Table kBit4;

typedef uint8_t u8x16v __attribute__((vector_size(16)));
inline u8x16v load16(const uint8_t* p) {
  u8x16v v;
  std::memcpy(&v, p, 16);
  return v;
}
inline void store16(uint8_t* p, u8x16v v) { std::memcpy(p, &v, 16); }

// The even and the odd bytes of p[0:32].
inline void even_odd(const uint8_t* p, u8x16v& e, u8x16v& o) {
  const u8x16v a = load16(p), b = load16(p + 16);
#if defined(__clang__)
  e = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  o = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  e = __builtin_shuffle(a, b, u8x16v{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30});
  o = __builtin_shuffle(a, b, u8x16v{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#endif
}

// Our int4 order (byte j: element 2j low, 2j + 1 high) from GGUF's, where byte i of a run of 16 holds
// element i low and element i + 16 high: out[0:16] for 32 elements, `flip` 0x88 for Q4_0's offset of 8.
inline void reorder_nibbles(const uint8_t* qs, uint8_t* out, uint8_t flip) {
  for (int j = 0; j < 8; ++j) {
    out[j] = static_cast<uint8_t>(((qs[2 * j] & 0x0F) | (qs[2 * j + 1] << 4)) ^ flip);
    out[8 + j] = static_cast<uint8_t>(((qs[2 * j] >> 4) | (qs[2 * j + 1] & 0xF0)) ^ flip);
  }
}

// Q4_K / Q5_K: scale j and min j (6 bits each) of a block's 12 packed bytes, times d and dmin.
inline void k_scales(const uint8_t* src, float* sc, float* mn) {
  const float d = half_to_float(src), dmin = half_to_float(src + 2);
  const uint8_t* s = src + 4;
  for (int j = 0; j < 8; ++j) {
    const int a = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    sc[j] = d * static_cast<float>(a), mn[j] = dmin * static_cast<float>(m);
  }
}

// Q5_0: d, 32 fifth bits, 16 bytes of nibbles (element i low, i + 16 high) -> 32 int8 codes q - 16; d.
inline float decode_q5_0(const uint8_t* src, uint8_t* codes) {
  const uint64_t h[4] = {kBit4.v[src[2]], kBit4.v[src[3]], kBit4.v[src[4]], kBit4.v[src[5]]};
  u8x16v hl, hh;
  std::memcpy(&hl, h, 16);
  std::memcpy(&hh, h + 2, 16);
  const u8x16v q = load16(src + 6);
  store16(codes, ((q & 0x0F) | hl) - 16);
  store16(codes + 16, ((q >> 4) | hh) - 16);
  return half_to_float(src);
}

// `count` blocks of type `t` at src -> codes (quant.py's layout, from the first block's first element),
// float32 scales and (asymmetric) mins, one per group. Written with 16-byte vectors (SSE / NEON on every
// ISA path): the decode must cost little beside reading the blocks from memory.
void decode_blocks(const BlockType& t, const uint8_t* src, int64_t count, uint8_t* codes, float* sc, float* mn) {
  switch (t.id) {
    case 8:  // Q8_0: d, 32 int8 codes
      for (int64_t b = 0; b < count; ++b, src += 34) sc[b] = half_to_float(src), std::memcpy(codes + 32 * b, src + 2, 32);
      return;
    case 6:
      for (int64_t b = 0; b < count; ++b, src += 22) sc[b] = decode_q5_0(src, codes + 32 * b);
      return;
    case 2:  // Q4_0: d, 16 bytes of nibbles; codes q - 8 (the nibble's top bit flipped)
    case 3:  // Q4_1: d, m, 16 bytes of nibbles; min -m
      for (int64_t b = 0; b < count; ++b, src += t.bytes) {
        sc[b] = half_to_float(src);
        if (t.id == 3) mn[b] = -half_to_float(src + 2);
        reorder_nibbles(src + (t.id == 3 ? 4 : 2), codes + 16 * b, t.id == 2 ? 0x88 : 0);
      }
      return;
    case 12:  // Q4_K: d, dmin, scales, 4 runs of 32 bytes (low nibbles sub-block 2r, high 2r + 1)
      for (int64_t b = 0; b < count; ++b, src += 144) {
        k_scales(src, sc + 8 * b, mn + 8 * b);
        for (int r = 0; r < 4; ++r) {
          u8x16v e, o;
          even_odd(src + 16 + 32 * r, e, o);
          store16(codes + 128 * b + 32 * r, (e & 0x0F) | (o << 4));
          store16(codes + 128 * b + 32 * r + 16, (e >> 4) | (o & 0xF0));
        }
      }
      return;
    case 13:  // Q5_K: d, dmin, scales, qh[32] (bit j: sub-block j), 4 runs of 32 bytes of nibbles
      for (int64_t b = 0; b < count; ++b, src += 176) {
        k_scales(src, sc + 8 * b, mn + 8 * b);
        for (int r = 0; r < 4; ++r)
          for (int i = 0; i < 32; i += 16) {
            const u8x16v q = load16(src + 48 + 32 * r + i), h = load16(src + 16 + i);
            uint8_t* out = codes + 256 * b + 64 * r + i;
            store16(out, (q & 0x0F) | (((h >> (2 * r)) & 1) << 4));
            store16(out + 32, (q >> 4) | (((h >> (2 * r + 1)) & 1) << 4));
          }
      }
      return;
    case 14:  // Q6_K: ql[128], qh[64], int8 sc[16], d; codes q - 32
      for (int64_t b = 0; b < count; ++b, src += 210) {
        const float d = half_to_float(src + 208);
        for (int g = 0; g < 16; ++g) sc[16 * b + g] = d * static_cast<float>(static_cast<int8_t>(src[192 + g]));
        for (int h = 0; h < 2; ++h)
          for (int t4 = 0; t4 < 4; ++t4)  // elements 128h + 32 t4 + i
            for (int i = 0; i < 32; i += 16) {
              const u8x16v ql = load16(src + 64 * h + 32 * (t4 % 2) + i), qh = load16(src + 128 + 32 * h + i);
              const u8x16v lo = (ql >> (4 * (t4 / 2))) & 0x0F, hi = (qh >> (2 * t4)) & 3;
              store16(codes + 256 * b + 128 * h + 32 * t4 + i, (lo | (hi << 4)) - 32);
            }
      }
      return;
  }
}

struct Decoded {
  std::vector<uint8_t> codes;
  std::vector<float> scales, mins;
};

// Rows [n0, n1) of a weight of GGUF blocks decoded into `d`: a view of those rows (row0 = n0).
QWeight decode_block_rows(const QWeight& q, int64_t n0, int64_t n1, Decoded& d) {
  const BlockType& t = *block_type(q.block);
  const int64_t rows = n1 - n0, G = q.K / q.group, cols = q.K * q.bits / 8, per_row = q.K / t.elements;
  d.codes.resize(static_cast<size_t>(rows * cols));
  d.scales.resize(static_cast<size_t>(rows * G));
  d.mins.resize(q.asym ? static_cast<size_t>(rows * G) : 0);
  for (int64_t r = 0; r < rows; ++r)
    decode_blocks(t, q.codes + (n0 + r) * q.code_cols, per_row, d.codes.data() + r * cols, d.scales.data() + r * G,
                  q.asym ? d.mins.data() + r * G : nullptr);
  QWeight v = q;
  v.codes = d.codes.data(), v.scales = d.scales.data(), v.mins = d.mins.data();
  v.code_cols = cols, v.block = 0, v.row0 = n0;
  return v;
}

// fn(view, a, b) over rows [n0, n1) of q: q itself, or its blocks decoded some 16 KB of codes at a time.
template <typename Fn>
void over_rows(const QWeight& q, int64_t n0, int64_t n1, Fn&& fn) {
  if (!q.block) {
    fn(q, n0, n1);
    return;
  }
  Decoded d;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, q.K * q.bits / 8));
  for (int64_t a = n0; a < n1; a += chunk) {
    const int64_t b = std::min(n1, a + chunk);
    fn(decode_block_rows(q, a, b, d), a, b);
  }
}

// deq(w)[n, k0:k1] of one row into buf (k0 a multiple of the blocks, k1 - k0 at most 256 for blocks).
void dequant_span(const uint8_t* c, const float* sc, const float* mn, int64_t k0, int64_t k1, int64_t group, int bits,
                  bool asym, float* buf);
void dequant_row_span(const QWeight& q, int64_t n, int64_t k0, int64_t k1, float* buf) {
  if (!q.block) {
    dequant_span(q.row_codes(n), q.row_scales(n), q.row_mins(n), k0, k1, q.group, q.bits, q.asym, buf);
    return;
  }
  const BlockType& t = *block_type(q.block);
  uint8_t codes[256];
  float sc[16], mn[16];
  for (int64_t k = k0; k < k1; k += t.elements) {  // one block at a time
    const int64_t e = std::min(k1, k + t.elements);
    decode_blocks(t, q.codes + n * q.code_cols + k / t.elements * t.bytes, 1, codes, sc, mn);
    dequant_span(codes, sc, mn, 0, e - k, q.group, q.bits, q.asym, buf + (k - k0));
  }
}

ffi::Error check_q(const ffi::AnyBuffer& codes, const Matrix& scales, const Matrix& mins, int64_t bits, bool asym,
                   int64_t K, QWeight* q, int64_t block = 0) {
  auto cd = codes.dimensions();
  if (cd.size() != 2) return ffi::Error::InvalidArgument("gemma4_q: codes must be 2-D");
  const auto t = codes.element_type();
  if (block) {
    const BlockType* bt = block_type(block);
    if (!bt || t != ffi::DataType::U8 || K % bt->elements || cd[1] != K / bt->elements * bt->bytes)
      return ffi::Error::InvalidArgument("gemma4_q: blocks must be uint8 [N, K / elements * bytes] of a kept type");
    const int64_t group = block == 14 ? 16 : 32;
    *q = QWeight{static_cast<const uint8_t*>(codes.untyped_data()), nullptr, nullptr, cd[0], K, group, cd[1],
                 static_cast<int>(bits), asym, static_cast<int>(block)};
    return ffi::Error::Success();
  }
  if (!((bits == 8 && !asym && t == ffi::DataType::S8) || ((bits == 4 || asym) && t == ffi::DataType::U8)))
    return ffi::Error::InvalidArgument("gemma4_q: codes dtype does not match bits/asym");
  const int64_t N = cd[0], code_cols = cd[1];
  if (code_cols * (bits == 4 ? 2 : 1) != K) return ffi::Error::InvalidArgument("gemma4_q: codes width != K");
  const int64_t G = scales.dimensions()[1];
  if (scales.dimensions()[0] != N || G <= 0 || K % G) return ffi::Error::InvalidArgument("gemma4_q: bad scales");
  if (asym && (mins.dimensions()[0] != N || mins.dimensions()[1] != G))
    return ffi::Error::InvalidArgument("gemma4_q: mins must match scales");
  *q = QWeight{static_cast<const uint8_t*>(codes.untyped_data()), scales.typed_data(), mins.typed_data(), N, K,
               K / G, code_cols, static_cast<int>(bits), asym};
  return ffi::Error::Success();
}

// 16 codes widened to float32. With AVX-512 these are the one-instruction widenings (vpmovsxbd /
// vpmovzxbd, shifts on 32-bit lanes for nibbles): GCC's generic vector conversions of the same were
// measured several times slower in this loop. Other CPUs take the generic code.
#if defined(__AVX512F__)
inline __m512i bytes_to_i32(const uint8_t* p, bool sign) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}
inline f32x16 to_f32(__m512i v) { return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(v)); }
inline f32x16 widen_codes8(const uint8_t* p, bool asym) { return to_f32(bytes_to_i32(p, !asym)); }
inline void widen_codes4(const uint8_t* p, bool asym, f32x16& lo, f32x16& hi) {
  const __m512i v = bytes_to_i32(p, false);
  if (asym) {
    lo = to_f32(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    hi = to_f32(_mm512_srli_epi32(v, 4));
  } else {  // two's-complement nibbles: move each to the top of the lane, shift back arithmetically
    lo = to_f32(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28));
    hi = to_f32(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 28));
  }
}
inline float hsum_q(f32x16 v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
// dst[0:32] = lo[0], hi[0], lo[1], hi[1], ... (the nibbles of 16 bytes back in memory order)
inline void interleave(f32x16 lo, f32x16 hi, float* dst) {
  const __m512 a = reinterpret_cast<__m512>(lo), b = reinterpret_cast<__m512>(hi);
  const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, i0, b));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(a, i1, b));
}
#elif defined(__AVX2__)
// AVX2: the same widenings on the two 8-lane halves.
inline f32x16 join_i32(__m256i a, __m256i b) {
  return {reinterpret_cast<f32x8>(_mm256_cvtepi32_ps(a)), reinterpret_cast<f32x8>(_mm256_cvtepi32_ps(b))};
}
inline void bytes_to_i32(const uint8_t* p, bool sign, __m256i& a, __m256i& b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), h = _mm_unpackhi_epi64(v, v);
  a = sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  b = sign ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
}
inline f32x16 widen_codes8(const uint8_t* p, bool asym) {
  __m256i a, b;
  bytes_to_i32(p, !asym, a, b);
  return join_i32(a, b);
}
inline void widen_codes4(const uint8_t* p, bool asym, f32x16& lo, f32x16& hi) {
  __m256i a, b;
  bytes_to_i32(p, false, a, b);
  if (asym) {
    const __m256i m = _mm256_set1_epi32(0x0F);
    lo = join_i32(_mm256_and_si256(a, m), _mm256_and_si256(b, m));
    hi = join_i32(_mm256_srli_epi32(a, 4), _mm256_srli_epi32(b, 4));
  } else {
    lo = join_i32(_mm256_srai_epi32(_mm256_slli_epi32(a, 28), 28), _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28));
    hi = join_i32(_mm256_srai_epi32(_mm256_slli_epi32(a, 24), 28), _mm256_srai_epi32(_mm256_slli_epi32(b, 24), 28));
  }
}
#else
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
inline f32x16 widen_codes8(const uint8_t* p, bool asym) {
  u8x16 u;
  std::memcpy(&u, p, 16);
  return asym ? __builtin_convertvector(u, f32x16) : __builtin_convertvector(reinterpret_cast<i8x16&>(u), f32x16);
}
inline void widen_codes4(const uint8_t* p, bool asym, f32x16& lo, f32x16& hi) {
  u8x16 b;
  std::memcpy(&b, p, 16);
  if (asym) {
    lo = __builtin_convertvector(b & 0x0F, f32x16);
    hi = __builtin_convertvector(b >> 4, f32x16);
  } else {
    const i8x16 v = reinterpret_cast<i8x16&>(b);
    lo = __builtin_convertvector((i8x16)(v << 4) >> 4, f32x16);
    hi = __builtin_convertvector(v >> 4, f32x16);
  }
}
#endif
#if !defined(__AVX512F__)  // AVX2 and generic
inline float hsum_q(f32x16 v) { return hsum(v); }
inline void interleave(f32x16 lo, f32x16 hi, float* dst) {
  for (int j = 0; j < 16; ++j) dst[2 * j] = lo[j], dst[2 * j + 1] = hi[j];
}
#endif

// deq(w)[n, k0:k1] of one row into buf[0 : k1 - k0]; for int4, k0, k1 and the group are even.
void dequant_span(const uint8_t* __restrict__ c, const float* __restrict__ sc, const float* __restrict__ mn, int64_t k0,
                  int64_t k1, int64_t group, int bits, bool asym, float* __restrict__ buf) {
  for (int64_t k = k0, g = k0 / group; k < k1; ++g) {
    const int64_t e = std::min(k1, (g + 1) * group);
    const float s = sc[g], m = asym ? mn[g] : 0.f;  // asym: code * s - m
    float* b = buf + (k - k0);
    int64_t j0 = 0;  // elements done with 16-lane vectors
    const f32x16 sv = f32x16{} + s, mv = f32x16{} + m;
    if (bits == 8) {
      for (; j0 + 16 <= e - k; j0 += 16) store_f32(b + j0, widen_codes8(c + k + j0, asym) * sv - mv);
    } else {
      for (; j0 + 32 <= e - k; j0 += 32) {
        f32x16 lo, hi;
        widen_codes4(c + (k + j0) / 2, asym, lo, hi);
        interleave(lo * sv - mv, hi * sv - mv, b + j0);
      }
    }
    if (bits == 8) {
      if (asym) {
        for (int64_t j = j0; j < e - k; ++j) b[j] = static_cast<float>(c[k + j]) * s - m;
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(c) + k;
        for (int64_t j = j0; j < e - k; ++j) b[j] = static_cast<float>(q[j]) * s;
      }
    } else {
      const uint8_t* q = c + (k + j0) / 2;
      b += j0;
      if (asym) {
        for (int64_t j = 0; j < (e - k - j0) / 2; ++j) {
          b[2 * j] = static_cast<float>(q[j] & 0x0F) * s - m;
          b[2 * j + 1] = static_cast<float>(q[j] >> 4) * s - m;
        }
      } else {
        for (int64_t j = 0; j < (e - k - j0) / 2; ++j) {
          const int8_t v = static_cast<int8_t>(q[j]);
          b[2 * j] = static_cast<float>(static_cast<int8_t>(v << 4) >> 4) * s;
          b[2 * j + 1] = static_cast<float>(v >> 4) * s;
        }
      }
    }
    k = e;
  }
}
inline void dequant_row(const uint8_t* c, const float* sc, const float* mn, int64_t K, int64_t group, int bits,
                        bool asym, float* buf) {
  dequant_span(c, sc, mn, 0, K, group, bits, asym, buf);
}

// The fused product for decode row counts: codes are widened 16 at a time in registers and multiplied
// with x; each group's partial sums take its scale once (and, asymmetric, subtract min * sum(x over the
// group), precomputed per row of x). For int4 the 16 low nibbles of 16 bytes are elements 0, 2, .., 30
// of a 32-wide chunk and the high nibbles 1, 3, .., 31, so x is permuted once per call to match.
// RAW (a GGML type number; Q4_0, Q4_1 and Q5_K here, the others take `qdot_raw` below): GGUF blocks, each
// decoded on the stack when the loop reaches it (`decode_blocks`: codes, scales and mins of its groups), so
// no row passes through a buffer in memory.
template <int MB, int BITS, bool ASYM, int RAW = 0>
void qdot_block(const QWeight& q, const float* __restrict__ xp, const float* __restrict__ xsum,
                float* __restrict__ out, int64_t N, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t K = q.K, G = K / q.group;
  constexpr int EL = RAW == 12 || RAW == 13 || RAW == 14 ? 256 : 32;  // elements of a block
  constexpr int BY = RAW == 8 ? 34 : RAW == 6 ? 22 : RAW == 2 ? 18 : RAW == 3 ? 20 : RAW == 12 ? 144 : RAW == 13 ? 176 : 210;
  const BlockType* bt = RAW ? block_type(RAW) : nullptr;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.row_codes(n);
    const float* sc = RAW ? nullptr : q.row_scales(n);
    const float* mn = RAW ? nullptr : q.row_mins(n);
    alignas(16) uint8_t tmp[EL];  // a decoded block: codes, scales and mins of its groups
    float stmp[EL / 16], mtmp[EL / 16];
    const uint8_t* cw = c;  // column k's code at cw + (k - off) (int4: byte (k - off) / 2)
    const float *sw = sc, *mw = mn;  // group g's scale at sw[g - goff]
    int64_t off = 0, goff = 0;
    f32x16 acc[MB];
    float corr[MB];
    for (int m = 0; m < MB; ++m) acc[m] = f32x16{}, corr[m] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      f32x16 ga[MB];
      for (int m = 0; m < MB; ++m) ga[m] = f32x16{};
      const int64_t k0 = g * q.group;
      if constexpr (RAW == 8) {
        cw = c + 34 * g + 2, off = k0;
      } else if constexpr (RAW != 0) {
        if (k0 % EL == 0) {
          if constexpr (RAW == 6)
            stmp[0] = decode_q5_0(c + k0 / EL * BY, tmp);
          else
            decode_blocks(*bt, c + k0 / EL * BY, 1, tmp, stmp, mtmp);
          cw = tmp, sw = stmp, mw = mtmp, off = k0, goff = g;
        }
      }
      if constexpr (BITS == 8) {
        for (int64_t k = k0; k < k0 + q.group; k += 16) {
          __builtin_prefetch(c + 2 * q.code_cols + (RAW ? k / EL * BY : k));  // two rows ahead (see cols_task)
          const f32x16 wv = widen_codes8(cw + (k - off), ASYM);
          for (int m = 0; m < MB; ++m) ga[m] += wv * load_f32(xp + (m0 + m) * K + k);
        }
      } else {
        for (int64_t k = k0; k < k0 + q.group; k += 32) {
          __builtin_prefetch(c + 2 * q.code_cols + (RAW ? k / EL * BY : k / 2));
          f32x16 lo, hi;
          widen_codes4(cw + (k - off) / 2, ASYM, lo, hi);
          for (int m = 0; m < MB; ++m) {
            const float* xm = xp + (m0 + m) * K + k;
            ga[m] += lo * load_f32(xm) + hi * load_f32(xm + 16);
          }
        }
      }
      const float s = RAW == 8 ? half_to_float(c + 34 * g) : sw[g - goff];
      for (int m = 0; m < MB; ++m) {
        acc[m] += ga[m] * s;
        if constexpr (ASYM) corr[m] += mw[g - goff] * xsum[(m0 + m) * G + g];
      }
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = hsum_q(acc[m]) - corr[m];
  }
}

// ---------------------------------------------------------------------------- K-quant / Q5_0 blocks in registers
// The decode kernel's fused product for GGUF blocks held as stored (Q4_K, Q6_K, Q5_0: the bulk of a
// Q4_K_M file besides its Q8_0 table), reading each block's bytes straight into 32-bit lanes: no block
// is decoded to memory first. Lane for lane, group for group, the float32 arithmetic of `qdot_block` on
// the decoded codes and scales (same codes in the same lanes, same x, same order of sums), so the result
// is bit for bit the decoded layout's:
//  - Q4_K: 4 runs of 32 bytes, low nibbles sub-block 2r, high 2r + 1. Read as 16 little-endian u16
//    lanes, lane j holds bytes 2j and 2j + 1: elements 2j and 2j + 1 of both sub-blocks, i.e. the lo /
//    hi halves of our int4 order (the permuted x of the int4 path matches them);
//  - Q6_K: group g of 16 = 16 bytes of ql (a nibble) and 16 of qh (two bits), code - 32;
//  - Q5_0: 16 bytes of nibbles (low: elements 0-15, high: 16-31) and the fifth bits of a u32.
#if defined(__AVX512F__)
typedef __m512i i32x16;
inline i32x16 lanes_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline i32x16 lanes_u16(const uint8_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline i32x16 lanes_and(i32x16 a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline i32x16 lanes_or(i32x16 a, i32x16 b) { return _mm512_or_si512(a, b); }
inline i32x16 lanes_shr(i32x16 a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline i32x16 lanes_shl(i32x16 a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline i32x16 lanes_srlv(i32x16 a, i32x16 n) { return _mm512_srlv_epi32(a, n); }
inline i32x16 lanes_set(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline i32x16 lanes_iota(int base) {
  return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(base));
}
inline f32x16 lanes_f32(i32x16 a, int minus) { return to_f32(_mm512_sub_epi32(a, _mm512_set1_epi32(minus))); }
#elif defined(__AVX2__)
struct i32x16 {
  __m256i lo, hi;
};
inline i32x16 lanes_u8(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))};
}
inline i32x16 lanes_u16(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
inline i32x16 lanes_and(i32x16 a, int m) {
  const __m256i v = _mm256_set1_epi32(m);
  return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)};
}
inline i32x16 lanes_or(i32x16 a, i32x16 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline i32x16 lanes_shr(i32x16 a, int n) {
  const __m128i c = _mm_cvtsi32_si128(n);
  return {_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c)};
}
inline i32x16 lanes_shl(i32x16 a, int n) {
  const __m128i c = _mm_cvtsi32_si128(n);
  return {_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c)};
}
inline i32x16 lanes_srlv(i32x16 a, i32x16 n) { return {_mm256_srlv_epi32(a.lo, n.lo), _mm256_srlv_epi32(a.hi, n.hi)}; }
inline i32x16 lanes_set(uint32_t v) { return {_mm256_set1_epi32(static_cast<int>(v)), _mm256_set1_epi32(static_cast<int>(v))}; }
inline i32x16 lanes_iota(int base) {
  const __m256i b = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(base));
  return {b, _mm256_add_epi32(b, _mm256_set1_epi32(8))};
}
inline f32x16 lanes_f32(i32x16 a, int minus) {
  const __m256i m = _mm256_set1_epi32(minus);
  return join_i32(_mm256_sub_epi32(a.lo, m), _mm256_sub_epi32(a.hi, m));
}
#else
typedef int32_t i32x16 __attribute__((vector_size(64)));
inline i32x16 lanes_u8(const uint8_t* p) {
  u8x16 b;
  std::memcpy(&b, p, 16);
  return __builtin_convertvector(b, i32x16);
}
inline i32x16 lanes_u16(const uint8_t* p) {
  u16x16 h;
  std::memcpy(&h, p, 32);
  return __builtin_convertvector(h, i32x16);
}
inline i32x16 lanes_and(i32x16 a, int m) { return a & m; }
inline i32x16 lanes_or(i32x16 a, i32x16 b) { return a | b; }
inline i32x16 lanes_shr(i32x16 a, int n) { return a >> n; }  // lanes hold small non-negative values
inline i32x16 lanes_shl(i32x16 a, int n) { return a << n; }
inline i32x16 lanes_srlv(i32x16 a, i32x16 n) { return a >> n; }
inline i32x16 lanes_set(uint32_t v) { return i32x16{} + static_cast<int32_t>(v); }
inline i32x16 lanes_iota(int base) {
  return i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + base;
}
inline f32x16 lanes_f32(i32x16 a, int minus) { return __builtin_convertvector(a - minus, f32x16); }
#endif

// kHalf.v[h] = the float32 value of float16 bits h (exact, as half_to_float): a Q8_0 / Q5_0 block's d read
// as one table load folded into the product, where a conversion per 32 weights was half again the work
// of a Q8_0 decode product (256 KB; the d values of a matrix touch few of its lines).
struct HalfTable {
  float v[65536];
  HalfTable() {
    for (uint32_t h = 0; h < 65536; ++h) {
      const uint8_t b[2] = {static_cast<uint8_t>(h & 0xFF), static_cast<uint8_t>(h >> 8)};
      v[h] = half_to_float(b);
    }
  }
};
const HalfTable kHalf;

// f(std::integral_constant<int, i>{}) for i = 0 .. N - 1: the block's groups with constant shifts and offsets.
template <typename F, int... I>
inline void static_for_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void static_for(F&& f) {
  static_for_seq(f, std::make_integer_sequence<int, N>{});
}

template <int MB, int RAW>
void qdot_raw(const QWeight& q, const float* __restrict__ xp, const float* __restrict__ xsum, float* __restrict__ out,
              int64_t N, int64_t n0, int64_t n1, int64_t m0) {
  static_assert(RAW == 12 || RAW == 14 || RAW == 6 || RAW == 8, "Q4_K, Q6_K, Q5_0 or Q8_0");
  constexpr bool KQ = RAW == 12 || RAW == 14;
  constexpr int EL = KQ ? 256 : 32, BY = RAW == 12 ? 144 : RAW == 14 ? 210 : RAW == 6 ? 22 : 34;
  constexpr int GPB = RAW == 12 ? 8 : RAW == 14 ? 16 : 1;  // groups per block
  const int64_t K = q.K, G = K / q.group, B = K / EL;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.row_codes(n);
    f32x16 acc[MB];
    float corr[MB];
    for (int m = 0; m < MB; ++m) acc[m] = f32x16{}, corr[m] = 0.f;
    // block b with its groups' scales scb (and mins mnb): the float32 products decode forms
    auto block = [&](int64_t b, const float* scb, const float* mnb) {
      const uint8_t* src = c + b * BY;
      __builtin_prefetch(src + 2 * q.code_cols);  // two rows ahead (see cols_task)
      if constexpr (BY > 64) __builtin_prefetch(src + 2 * q.code_cols + 64);
      if constexpr (BY > 128) __builtin_prefetch(src + 2 * q.code_cols + 128);
      if constexpr (BY > 192) __builtin_prefetch(src + 2 * q.code_cols + 192);
      static_for<GPB>([&](auto gb_c) {
        constexpr int gb = decltype(gb_c)::value;
        const int64_t g = b * GPB + gb, k = g * q.group;
        f32x16 ga[MB];
        for (int m = 0; m < MB; ++m) ga[m] = f32x16{};
        if constexpr (RAW == 12) {  // sub-blocks 2r (gb even: low nibbles) and 2r + 1 (high)
          const i32x16 v = lanes_u16(src + 16 + 32 * (gb / 2)), w = gb % 2 ? lanes_shr(v, 4) : v;
          const f32x16 lo = lanes_f32(lanes_and(w, 0x0F), 0), hi = lanes_f32(lanes_and(lanes_shr(w, 8), 0x0F), 0);
          for (int m = 0; m < MB; ++m) {
            const float* xm = xp + (m0 + m) * K + k;
            ga[m] += lo * load_f32(xm) + hi * load_f32(xm + 16);
          }
        } else if constexpr (RAW == 14) {  // elements 128h + 32 t4 + 16 (gb % 2) + i
          const int h = gb / 8, t4 = gb % 8 / 2, i0 = 16 * (gb % 2);
          const i32x16 lo = lanes_and(lanes_shr(lanes_u8(src + 64 * h + 32 * (t4 % 2) + i0), 4 * (t4 / 2)), 0x0F);
          const i32x16 hi = lanes_and(lanes_shr(lanes_u8(src + 128 + 32 * h + i0), 2 * t4), 3);
          const f32x16 wv = lanes_f32(lanes_or(lo, lanes_shl(hi, 4)), 32);
          for (int m = 0; m < MB; ++m) ga[m] += wv * load_f32(xp + (m0 + m) * K + k);
        } else if constexpr (RAW == 8) {  // Q8_0: 32 int8 codes after d
#if defined(__AVX512F__)  // one 32-byte load (the codes sit at 2 + 34 b: fewer loads split over cache lines)
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2));
          const f32x16 wv2[2] = {to_f32(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))),
                                 to_f32(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)))};
#else
          const f32x16 wv2[2] = {widen_codes8(src + 2, false), widen_codes8(src + 18, false)};
#endif
          for (int half = 0; half < 2; ++half)
            for (int m = 0; m < MB; ++m) ga[m] += wv2[half] * load_f32(xp + (m0 + m) * K + k + 16 * half);
        } else {  // Q5_0: elements 0-15 low nibbles, 16-31 high; bit j of qh: element j's fifth bit
          uint32_t qh;
          std::memcpy(&qh, src + 2, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)  // as bytes: code = nibble, less 16 where the bit is clear
          const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 6)), f = _mm_set1_epi8(0x0F);
          const __m128i nib[2] = {_mm_and_si128(qs, f), _mm_and_si128(_mm_srli_epi16(qs, 4), f)};
          const __mmask16 clear[2] = {static_cast<__mmask16>(~qh), static_cast<__mmask16>(~(qh >> 16))};
          for (int half = 0; half < 2; ++half) {
            const __m128i code = _mm_mask_sub_epi8(nib[half], clear[half], nib[half], _mm_set1_epi8(16));
            const f32x16 wv = to_f32(_mm512_cvtepi8_epi32(code));
            for (int m = 0; m < MB; ++m) ga[m] += wv * load_f32(xp + (m0 + m) * K + k + 16 * half);
          }
#else
          const i32x16 qs = lanes_u8(src + 6), hv = lanes_set(qh);
          for (int half = 0; half < 2; ++half) {
            const i32x16 nib = half ? lanes_shr(qs, 4) : lanes_and(qs, 0x0F);
            const i32x16 fifth = lanes_and(lanes_srlv(hv, lanes_iota(16 * half)), 1);
            const f32x16 wv = lanes_f32(lanes_or(nib, lanes_shl(fifth, 4)), 16);
            for (int m = 0; m < MB; ++m) ga[m] += wv * load_f32(xp + (m0 + m) * K + k + 16 * half);
          }
#endif
        }
        for (int m = 0; m < MB; ++m) {
          acc[m] += ga[m] * scb[gb];
          if constexpr (RAW == 12) corr[m] += mnb[gb] * xsum[(m0 + m) * G + g];
        }
      });
    };
    if constexpr (KQ) {
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* src = c + b * BY;
        alignas(64) float sc[16], mn[8];  // the groups' scales (and mins): the float32 products decode forms
        if constexpr (RAW == 12) {  // the 6-bit scales and mins unpacked as llama.cpp does (kmask1..3)
          uint32_t u[4];
          std::memcpy(u, src + 4, 12);
          u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
          const uint32_t m4 = u[1] & 0x3F3F3F3F;
          u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
          u[2] = m4, u[0] &= 0x3F3F3F3F;  // bytes: scales 0-7, then mins 0-7
          store_f32(sc, widen_codes8(reinterpret_cast<const uint8_t*>(u), true));
          const float d = half_to_float(src), dmin = half_to_float(src + 2);
          for (int j = 0; j < 8; ++j) mn[j] = dmin * sc[8 + j], sc[j] = d * sc[j];
        } else {
          store_f32(sc, widen_codes8(src + 192, false) * half_to_float(src + 208));
        }
        block(b, sc, mn);
      }
    } else {  // d: a float16 looked up (kHalf) into the product's broadcast operand
      for (int64_t b = 0; b < B; ++b) {
        uint16_t h;
        std::memcpy(&h, c + b * BY, 2);
        block(b, kHalf.v + h, nullptr);
      }
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = hsum_q(acc[m]) - corr[m];
  }
}

// ---------------------------------------------------------------------------- int8 activations
// Opt-in (`act8`, Matmul(int8_activations=True)) at decode row counts: each row of x is quantized to
// int8 per block of 32 columns, as llama.cpp's Q8_0 (s = max|x| / 127, q = round-half-even(x * (127 /
// max|x|))), and multiplied with the codes as integers: byte products summed in fours into int32 lanes
// (AVX512-VNNI `vpdpbusd`, 64 bytes an instruction; AVX2 `vpmaddubsw` then `vpmaddwd` with ones, 32),
// where a float32 FMA multiplies 16 (or 8) codes after widening them. The result is deq(w) @ (q * s) up
// to float32 summation. Each lane's integer sum spans columns of one weight group and one activation
// block, and is scaled once. Both instructions multiply unsigned by signed bytes.
//  - int4 codes, chunks of 128 columns: 64 bytes of codes give 64 low nibbles (the even columns) and 64
//    high nibbles (the odd ones); x is permuted once per call to match, so lane l spans the columns
//    [8l, 8l + 8). The weights take the unsigned side (symmetric codes offset by 8, and 8 * sum(q) over
//    the lane taken back in the accumulator's start).
//  - symmetric int8 codes (AVX2 only; AVX-512 keeps the float32 product, measured at the memory
//    bandwidth there), chunks of 32 columns in memory order, lane l spanning [4l, 4l + 4): |w| takes the
//    unsigned side and x * sign(w) the signed one (`vpsignb`), so each pair of products fits the int16
//    that `vpmaddubsw` saturates at (2 * 128 * 127). Asymmetric int8 codes (up to 255) would not.
#if defined(__AVX512VNNI__)
constexpr bool kHasInt8Dot = true, kInt8Codes = false;
#elif defined(__AVX2__)
constexpr bool kHasInt8Dot = true, kInt8Codes = true;
#else
constexpr bool kHasInt8Dot = false, kInt8Codes = false;
#endif
constexpr int64_t kAct8Span = 128;  // columns of an int4 chunk
struct ActChunk {                // one row of x, 128 columns (int4 codes)
  alignas(64) int8_t q[128];     // [even columns | odd columns]
  alignas(64) int32_t bias[16];  // -8 * sum of q over each lane (symmetric codes)
  alignas(64) float sx[16];      // the activation scale of each lane
  alignas(64) float sq[16];      // sx * sum of q over each lane (asymmetric codes: the mins' term)
};
struct ActBlock {           // one row of x, 32 columns (int8 codes)
  alignas(32) int8_t q[32];
  float sx;
};

// Whether the int8-activation product takes this weight: whole chunks, each lane inside one group.
bool act8_layout(const QWeight& q) {
  if (q.bits == 4)
    return kHasInt8Dot && q.K % kAct8Span == 0 && q.group % 8 == 0 &&
           (q.group % kAct8Span == 0 || kAct8Span % q.group == 0);
  return kInt8Codes && !q.asym && q.K % 32 == 0 && q.group % 4 == 0 && (q.group % 32 == 0 || 32 % q.group == 0);
}

// x[0:32] rounded as Q8_0 into q[0:32]; returns the block's scale. A NaN or an infinity in x gives the
// scale NaN (and q 0 where x is not a number), so the product is NaN as the float product is.
float round_q8_block(const float* x, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) {  // a NaN wins the max
    const float v = std::fabs(x[j]);
    amax = v > amax || v != v ? v : amax;
  }
  const bool finite = amax <= std::numeric_limits<float>::max();
  const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 32; ++j) {
    const float r = std::nearbyint(x[j] * inv);
    q[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, r == r ? r : 0.f)));
  }
  return finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
}

void quantize_rows_q8(const float* X, int64_t M, int64_t K, bool asym, ActChunk* out) {
  const int64_t C = K / kAct8Span;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c) {
      const float* x = X + m * K + c * kAct8Span;
      int8_t q[kAct8Span];
      float s[kAct8Span / 32];
      for (int b = 0; b < kAct8Span / 32; ++b) s[b] = round_q8_block(x + 32 * b, q + 32 * b);
      ActChunk& a = out[m * C + c];
      for (int j = 0; j < 64; ++j) a.q[j] = q[2 * j], a.q[64 + j] = q[2 * j + 1];
      for (int l = 0; l < 16; ++l) {
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += a.q[4 * l + j] + a.q[64 + 4 * l + j];
        a.sx[l] = s[8 * l / 32];
        a.bias[l] = asym ? 0 : -8 * sum;
        a.sq[l] = a.sx[l] * static_cast<float>(sum);
      }
    }
  }
}

#if defined(__AVX512VNNI__)
template <int MB, bool ASYM>
void act8_block(const QWeight& q, const ActChunk* act, float* __restrict__ out, int64_t N, int64_t n0, int64_t n1,
                int64_t m0) {
  const int64_t C = q.K / kAct8Span, G = q.K / q.group;
  alignas(64) int32_t idx[16];  // each lane's group within the chunk
  for (int l = 0; l < 16; ++l) idx[l] = q.group >= kAct8Span ? 0 : static_cast<int32_t>(8 * l / q.group);
  const __m512i lane_group = _mm512_load_si512(idx);
  const __mmask16 groups = static_cast<__mmask16>((1u << (q.group >= kAct8Span ? 1 : kAct8Span / q.group)) - 1);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.row_codes(n);
    const float* sc = q.row_scales(n);
    const float* mn = q.row_mins(n);
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t ch = 0; ch < C; ++ch) {
      __m512i lo = _mm512_loadu_si512(c + 64 * ch);
      if constexpr (!ASYM) lo = _mm512_xor_si512(lo, _mm512_set1_epi8(static_cast<char>(0x88)));  // code + 8
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(lo, 4), nib);
      lo = _mm512_and_si512(lo, nib);
      const int64_t g0 = kAct8Span * ch / q.group;
      const __m512 sw = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(groups, sc + g0));
      __m512 mw;
      if constexpr (ASYM) mw = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(groups, mn + g0));
      for (int m = 0; m < MB; ++m) {
        const ActChunk& a = act[(m0 + m) * C + ch];
        __m512i sum = _mm512_dpbusd_epi32(_mm512_load_si512(a.bias), lo, _mm512_load_si512(a.q));
        sum = _mm512_dpbusd_epi32(sum, hi, _mm512_load_si512(a.q + 64));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sw, _mm512_load_ps(a.sx)), acc[m]);
        if constexpr (ASYM) acc[m] = _mm512_fnmadd_ps(mw, _mm512_load_ps(a.sq), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

#elif defined(__AVX2__)
// Eight lanes of `lane_cols` columns each (one 32-byte product), each given its weight group's value.
struct LaneGroups {
  __m256i index, mask;
  int64_t group;
  bool one;  // the 8 lanes lie in one group
  LaneGroups(int64_t group_, int64_t lane_cols) : group(group_), one(group_ % (8 * lane_cols) == 0) {
    alignas(32) int32_t idx[8], msk[8];
    const int64_t groups = one ? 1 : 8 * lane_cols / group;
    for (int l = 0; l < 8; ++l) idx[l] = one ? 0 : static_cast<int32_t>(lane_cols * l / group), msk[l] = l < groups ? -1 : 0;
    index = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(msk));
  }
  // the values of a row's groups `v` for the lanes starting at column c0
  __m256 of(const float* v, int64_t c0) const {
    const float* p = v + c0 / group;
    return one ? _mm256_broadcast_ss(p) : _mm256_permutevar8x32_ps(_mm256_maskload_ps(p, mask), index);
  }
};

// 32 unsigned by 32 signed bytes, products summed in fours into 8 int32 lanes (each pair of products must
// fit an int16).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <int MB, bool ASYM>
void act8_block(const QWeight& q, const ActChunk* act, float* __restrict__ out, int64_t N, int64_t n0, int64_t n1,
                int64_t m0) {
  const int64_t C = q.K / kAct8Span, G = q.K / q.group;
  const LaneGroups lanes(q.group, 8);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.row_codes(n);
    const float* sc = q.row_scales(n);
    const float* mn = q.row_mins(n);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t ch = 0; ch < C; ++ch) {
      for (int h = 0; h < 2; ++h) {  // 32 bytes: lanes 8h .. 8h + 7, columns [64h, 64h + 64) of the chunk
        __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * ch + 32 * h));
        if constexpr (!ASYM) lo = _mm256_xor_si256(lo, _mm256_set1_epi8(static_cast<char>(0x88)));  // code + 8
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(lo, 4), nib);
        lo = _mm256_and_si256(lo, nib);
        const int64_t c0 = kAct8Span * ch + 64 * h;
        const __m256 sw = lanes.of(sc, c0);
        __m256 mw;
        if constexpr (ASYM) mw = lanes.of(mn, c0);
        for (int m = 0; m < MB; ++m) {
          const ActChunk& a = act[(m0 + m) * C + ch];
          // codes <= 15: both nibbles' pair sums together stay within int16 (2 * 2 * 15 * 127)
          const __m256i p = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q + 32 * h))),
              _mm256_maddubs_epi16(hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q + 64 + 32 * h))));
          const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)),
                                               _mm256_load_si256(reinterpret_cast<const __m256i*>(a.bias + 8 * h)));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sw, _mm256_load_ps(a.sx + 8 * h)), acc[m]);
          if constexpr (ASYM) acc[m] = _mm256_fnmadd_ps(mw, _mm256_load_ps(a.sq + 8 * h), acc[m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = hsum8(acc[m]);
  }
}

// Symmetric int8 codes: |w| . (x * sign(w)) per 32 columns.
template <int MB>
void act8_block8(const QWeight& q, const ActBlock* act, float* __restrict__ out, int64_t N, int64_t n0, int64_t n1,
                 int64_t m0) {
  const int64_t C = q.K / 32, G = q.K / q.group;
  const LaneGroups lanes(q.group, 4);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.row_codes(n);
    const float* sc = q.row_scales(n);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t ch = 0; ch < C; ++ch) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * ch));
      const __m256i uw = _mm256_abs_epi8(w);  // -128 -> 0x80, read as the unsigned 128
      const __m256 sw = lanes.of(sc, 32 * ch);
      for (int m = 0; m < MB; ++m) {
        const ActBlock& a = act[(m0 + m) * C + ch];
        const __m256i sum =
            dot_u8s8(uw, _mm256_sign_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.q)), w));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sw, _mm256_set1_ps(a.sx)), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = hsum8(acc[m]);
  }
}
#endif

#if defined(__AVX512VNNI__) || defined(__AVX2__)
void act8_rows(ffi::ThreadPool& pool, const float* X, float* Y, int64_t M, const QWeight& q, int64_t per_task) {
  const int64_t N = q.N, nt = (N + per_task - 1) / per_task;
  std::vector<ActChunk> act4;
  std::vector<ActBlock> act8;
  if (q.bits == 4) {
    act4.resize(static_cast<size_t>(M * (q.K / kAct8Span)));
    quantize_rows_q8(X, M, q.K, q.asym, act4.data());
  } else {
    act8.resize(static_cast<size_t>(M * (q.K / 32)));
    for (int64_t i = 0; i < static_cast<int64_t>(act8.size()); ++i) act8[i].sx = round_q8_block(X + 32 * i, act8[i].q);
  }
  auto run = [&](auto asym_c) {
    constexpr bool A = decltype(asym_c)::value;
    parallel_for(pool, nt, [&](int64_t t) {
      over_rows(q, t * per_task, std::min(N, (t + 1) * per_task), [&](const QWeight& v, int64_t n0, int64_t n1) {
        for_row_blocks(M, [&](auto mb, int64_t m) {
          constexpr int MB = decltype(mb)::value;
          if (v.bits == 4) {
            act8_block<MB, A>(v, act4.data(), Y, N, n0, n1, m);
          } else {
#if !defined(__AVX512VNNI__)
            act8_block8<MB>(v, act8.data(), Y, N, n0, n1, m);
#endif
          }
        });
      });
    });
  };
  q.asym ? run(std::true_type{}) : run(std::false_type{});
}
#else
void act8_rows(ffi::ThreadPool&, const float*, float*, int64_t, const QWeight&, int64_t) {}
#endif

// ---------------------------------------------------------------------------- llama.cpp's integer dots
// act8 with GGUF blocks held as stored (`block`), below kGemmRowsT rows: llama.cpp's CPU arithmetic on the
// same blocks, read in place (each weight block unpacked on the stack once for the rows of x it meets).
// Activations are rounded as llama.cpp rounds them for that weight type (its `vec_dot_type`):
//  - Q4_K, Q5_K, Q6_K: Q8_K, per 256 columns (quantize_row_q8_K_ref, which x86 also runs): max = the value
//    with the largest |x| (the first of equals), iscale = -127 / max, q = min(127, round-half-even(iscale *
//    x)), d = 1 / iscale (float32), and the sums of q over each 32 columns (its bsums, in pairs).
//  - Q8_0, Q5_0, Q4_0: Q8_0 per 32 columns as its AVX2 quantize_row_q8_0 (`round_q8_block`'s codes), d =
//    float16(max|x| / 127); Q4_1: Q8_1, the same codes and d, and s = float16(max|x| / 127 * sum(q)).
// The weight codes are llama.cpp's integers (Q4_0 q - 8, Q5_0 q - 16, Q6_K q - 32, Q4_1 / Q4_K / Q5_K q;
// Q8_0's bytes as they are), multiplied with q as integers per block (K-quants: per sub-block times its
// integer 6-bit scale, or Q6_K's int8 one), then in float32:
//   Q8_0 / Q5_0 / Q4_0: d_w * d_x * sumi;  Q4_1: d_w * d_x * sumi + m_w * s_x;
//   Q4_K / Q5_K: (d_w * d_x) * sum_j sc_j sumi_j - (dmin_w * d_x) * sum_j m_j bsum_j;  Q6_K: (d_w * d_x) * sum_j sc_j sumi_j
// (ggml_vec_dot_q8_0_q8_0, q5_0_q8_0, q4_0_q8_0, q4_1_q8_1, q4_K_q8_K, q5_K_q8_K, q6_K_q8_K): the same
// rounding of the activations and the same integer sums; only the float32 summation order differs.
// Products of 32 signed codes w with 32 activations: |w| (once per weight block) . (x * sign(w)) per row
// (`vpsignb`; each pair of byte products within the int16 `vpmaddubsw` saturates at: 2 * 128 * 127),
// unsigned codes (Q4_1, Q4_K, Q5_K) as they are, summed in fours into 8 int32 lanes: AVX512-VNNI
// `vpdpbusd` on 32 bytes, AVX2 `vpmaddubsw` + `vpmaddwd` with ones; the K-quants' sub-block scales enter
// as `vpmaddwd`'s int16 factor instead of the ones (on both: as llama.cpp's AVX2 / AVX-512 q4_K does);
// plain integer code on the generic path. A NaN or an infinity in a block of x makes its d NaN, so the
// row's products are NaN (as the float product).
struct Q8Block {  // 32 columns of a row of x, as Q8_0 / Q8_1
  alignas(32) int8_t q[32];
  float d, s;
};
struct Q8KBlock {  // 256 columns of a row of x, as Q8_K
  alignas(32) int8_t q[256];
  float d;
  int32_t bsum[8];  // sums of q over each 32 columns
};

// float32 -> float16 (round to nearest even) -> float32: F16C's instruction where built for it, else the
// FP16 library's bit manipulation (what ggml's generic GGML_FP32_TO_FP16 does).
inline float round_half(float f) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(f, 0));
#else
  uint32_t w, t;
  std::memcpy(&w, &f, 4);
  const uint32_t shl1 = w + w, sign = w & 0x80000000u;
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1 & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  t = (bias >> 1) + 0x07800000u;
  float b;
  std::memcpy(&b, &t, 4);
  base = b + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint16_t h = static_cast<uint16_t>(
      (sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu)));
  uint8_t p[2];
  std::memcpy(p, &h, 2);
  return half_to_float(p);
#endif
}

void quantize_q8_0(const float* x, Q8Block& a) {
  const float s = round_q8_block(x, a.q);  // max|x| / 127, or NaN
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) sum += a.q[j];
  a.d = round_half(s), a.s = round_half(s * static_cast<float>(sum));
}

void quantize_q8_K(const float* x, Q8KBlock& a) {
  float amax = 0.f, max = 0.f;
  bool finite = true;
  for (int j = 0; j < 256; ++j) {
    const float v = std::fabs(x[j]);
    if (v > amax) amax = v, max = x[j];
    finite &= v <= std::numeric_limits<float>::max();
  }
  const float iscale = finite && amax > 0.f ? -127.f / max : 0.f;
  for (int j = 0; j < 256; ++j)
    a.q[j] = finite ? static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * x[j]))) : int8_t{0};
  for (int j = 0; j < 8; ++j) {
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += a.q[32 * j + i];
    a.bsum[j] = sum;
  }
  a.d = !finite ? std::numeric_limits<float>::quiet_NaN() : amax > 0.f ? 1.f / iscale : 0.f;
}

// A block's 32 codes (W32) are assembled in registers from 16-byte halves: stored to the stack as two
// 16-byte halves and read back as one 32-byte load, every block stalled on the failed store forwarding.
#if defined(__AVX2__)
typedef __m256i W32;
typedef __m256i I32x8;
typedef __m256i S16;  // int16 scales, one per pair of bytes
typedef __m256 F32x8;
inline W32 w32_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline W32 w32_join(u8x16v lo, u8x16v hi) {
  return _mm256_set_m128i(reinterpret_cast<__m128i>(hi), reinterpret_cast<__m128i>(lo));
}
inline W32 w32_abs(W32 w) { return _mm256_abs_epi8(w); }
inline W32 w32_sign(W32 x, W32 w) { return _mm256_sign_epi8(x, w); }  // x * sign(w)
// u (unsigned) . s (signed) summed in fours into 8 int32 lanes (each pair of products within int16)
inline I32x8 dot4(W32 u, W32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// the same times a scale per 16 columns (lanes 0-3: lo, 4-7: hi): the pair sums times int16 scales
inline S16 scale16(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
}
inline I32x8 dot4_scaled(W32 u, W32 s, S16 sc) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc); }
inline I32x8 i32_zero() { return _mm256_setzero_si256(); }
inline I32x8 i32_add(I32x8 a, I32x8 b) { return _mm256_add_epi32(a, b); }
inline F32x8 f32_zero() { return _mm256_setzero_ps(); }
inline F32x8 f32_fma(I32x8 v, float s, F32x8 acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc); }
inline float f32_sum(F32x8 v) { return hsum8(v); }
#else
typedef int8_t W32 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef int32_t S16 __attribute__((vector_size(32)));  // (plain code: the scale of each int32 lane)
typedef float F32x8 __attribute__((vector_size(32)));
inline W32 w32_load(const void* p) {
  W32 v;
  std::memcpy(&v, p, 32);
  return v;
}
inline W32 w32_join(u8x16v lo, u8x16v hi) {
  uint8_t b[32];
  std::memcpy(b, &lo, 16);
  std::memcpy(b + 16, &hi, 16);
  return w32_load(b);
}
inline W32 w32_abs(W32 w) { return w < 0 ? -w : w; }  // -128 stays 0x80: the unsigned 128 in dot4
inline W32 w32_sign(W32 x, W32 w) { return w < 0 ? -x : w == 0 ? W32{} : x; }
inline I32x8 dot4(W32 u, W32 s) {
  I32x8 r;
  for (int l = 0; l < 8; ++l) {
    int32_t t = 0;
    for (int i = 4 * l; i < 4 * l + 4; ++i) t += int32_t{static_cast<uint8_t>(u[i])} * int32_t{s[i]};
    r[l] = t;
  }
  return r;
}
inline S16 scale16(int lo, int hi) { return S16{lo, lo, lo, lo, hi, hi, hi, hi}; }
inline I32x8 dot4_scaled(W32 u, W32 s, S16 sc) { return dot4(u, s) * sc; }
inline I32x8 i32_zero() { return I32x8{}; }
inline I32x8 i32_add(I32x8 a, I32x8 b) { return a + b; }
inline F32x8 f32_zero() { return F32x8{}; }
inline F32x8 f32_fma(I32x8 v, float s, F32x8 acc) { return __builtin_convertvector(v, F32x8) * s + acc; }
inline float f32_sum(F32x8 v) {
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}
#endif

// Q4_K / Q5_K: the integer scales and mins of a block's 12 packed bytes (`k_scales` without d, dmin).
inline void k_scale_ints(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 8; ++j) {
    sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One weight block of GGUF type T as llama.cpp's integers: its codes in column order (|w| where the
// codes are signed, their signs apart), and its scales.
template <int T>
struct Unpacked {
  static constexpr bool KQ = T == 12 || T == 13 || T == 14;
  static constexpr int EL = KQ ? 256 : 32;  // elements of a block
  static constexpr int BY = T == 8 ? 34 : T == 6 ? 22 : T == 2 ? 18 : T == 3 ? 20 : T == 12 ? 144 : T == 13 ? 176 : 210;
  static constexpr bool SIGNED = T != 3 && T != 12 && T != 13;  // Q4_1 / Q4_K / Q5_K codes are unsigned
  W32 w[EL / 32];
  W32 signs[SIGNED ? EL / 32 : 1];
  S16 scv[KQ ? 8 : 1];  // K-quants: each 32 columns' int16 scales (Q6_K: its two sub-blocks')
  int mn[KQ ? 8 : 1];   // Q4_K / Q5_K: the sub-blocks' integer mins
  float dw, mw;         // d; and dmin (Q4_K / Q5_K) or m (Q4_1)
};

template <int T>
inline void unpack_block(const uint8_t* src, Unpacked<T>& u) {
  if constexpr (Unpacked<T>::KQ) {
    int sc[16];
    if constexpr (T == 14) {  // ql[128], qh[64], int8 scales[16], d
      u.dw = half_to_float(src + 208), u.mw = 0.f;
      for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(src[192 + g]);
      for (int h = 0; h < 2; ++h)
        for (int t4 = 0; t4 < 4; ++t4) {  // columns 128h + 32 t4 + [0, 32)
          u8x16v half[2];
          for (int i = 0; i < 2; ++i) {
            const u8x16v ql = load16(src + 64 * h + 32 * (t4 % 2) + 16 * i), qh = load16(src + 128 + 32 * h + 16 * i);
            half[i] = (((ql >> (4 * (t4 / 2))) & 0x0F) | (((qh >> (2 * t4)) & 3) << 4)) - 32;
          }
          u.w[4 * h + t4] = w32_join(half[0], half[1]);
        }
    } else {  // d, dmin, scales[12], (Q5_K: qh[32]), 4 runs of 32 bytes of nibbles
      u.dw = half_to_float(src), u.mw = half_to_float(src + 2);
      k_scale_ints(src + 4, sc, u.mn);
      constexpr int QS = T == 13 ? 48 : 16;
      const u8x16v h0 = load16(src + 16), h1 = load16(src + 32);  // Q5_K's fifth bits
      for (int r = 0; r < 4; ++r) {
        const u8x16v v0 = load16(src + QS + 32 * r), v1 = load16(src + QS + 32 * r + 16);
        u8x16v lo0 = v0 & 0x0F, lo1 = v1 & 0x0F, hi0 = v0 >> 4, hi1 = v1 >> 4;
        if constexpr (T == 13) {
          lo0 |= ((h0 >> (2 * r)) & 1) << 4, lo1 |= ((h1 >> (2 * r)) & 1) << 4;
          hi0 |= ((h0 >> (2 * r + 1)) & 1) << 4, hi1 |= ((h1 >> (2 * r + 1)) & 1) << 4;
        }
        u.w[2 * r] = w32_join(lo0, lo1), u.w[2 * r + 1] = w32_join(hi0, hi1);
      }
    }
    // 32 columns: Q6_K's sub-blocks 2j and 2j + 1, the others' sub-block j
    for (int j = 0; j < 8; ++j) u.scv[j] = T == 14 ? scale16(sc[2 * j], sc[2 * j + 1]) : scale16(sc[j], sc[j]);
  } else {
    u.mw = 0.f;
    if constexpr (T == 8) {
      u.w[0] = w32_load(src + 2);
    } else if constexpr (T == 6) {  // (q | fifth bit) - 16; the fifth bits of 8 columns a table entry
      typedef uint64_t u64x2v __attribute__((vector_size(16)));
      const u8x16v hl = reinterpret_cast<u8x16v>(u64x2v{kBit4.v[src[2]], kBit4.v[src[3]]});
      const u8x16v hh = reinterpret_cast<u8x16v>(u64x2v{kBit4.v[src[4]], kBit4.v[src[5]]});
      const u8x16v v = load16(src + 6);
      u.w[0] = w32_join(((v & 0x0F) | hl) - 16, ((v >> 4) | hh) - 16);
    } else {  // Q4_0: q - 8; Q4_1: q
      const u8x16v v = load16(src + (T == 3 ? 4 : 2));
      const u8x16v off = T == 2 ? u8x16v{} + 8 : u8x16v{};
      u.w[0] = w32_join((v & 0x0F) - off, (v >> 4) - off);
      if constexpr (T == 3) u.mw = half_to_float(src + 2);
    }
    u.dw = half_to_float(src);
  }
  if constexpr (Unpacked<T>::SIGNED)  // the sign moves to x (`w32_sign`), |w| takes the unsigned side
    for (int j = 0; j < Unpacked<T>::EL / 32; ++j) u.signs[j] = u.w[j], u.w[j] = w32_abs(u.w[j]);
}

// acc[m] (and corr[m], subtracted at the end: the mins' terms, Q4_1's with the sign flipped) += block b
// of a weight row times block b of rows m0 .. m0 + MB of x. corr's terms are explicit fused multiply-adds:
// left to the compiler, `corr += a * b` was fused in some row-block sizes and not in others (a row's
// result then depended on the block it was multiplied in).
template <int MB, int T>
inline void dot_block(const Unpacked<T>& u, const Q8Block* x32, const Q8KBlock* x256, int64_t B, int64_t b, int64_t m0,
                      F32x8* acc, float* corr) {
  using U = Unpacked<T>;
  for (int m = 0; m < MB; ++m) {
    if constexpr (U::KQ) {
      const Q8KBlock& a = x256[(m0 + m) * B + b];
      I32x8 s = i32_zero();
      for (int j = 0; j < 8; ++j) {
        const W32 x = w32_load(a.q + 32 * j);
        s = i32_add(s, dot4_scaled(u.w[j], U::SIGNED ? w32_sign(x, u.signs[j]) : x, u.scv[j]));
      }
      acc[m] = f32_fma(s, u.dw * a.d, acc[m]);
      if constexpr (T != 14) {
        int32_t summ = 0;
        for (int j = 0; j < 8; ++j) summ += u.mn[j] * a.bsum[j];
        corr[m] = std::fma(u.mw * a.d, static_cast<float>(summ), corr[m]);
      }
    } else {
      const Q8Block& a = x32[(m0 + m) * B + b];
      const W32 x = w32_load(a.q);
      acc[m] = f32_fma(dot4(u.w[0], U::SIGNED ? w32_sign(x, u.signs[0]) : x), u.dw * a.d, acc[m]);
      if constexpr (T == 3) corr[m] = std::fma(-u.mw, a.s, corr[m]);
    }
  }
}

// out[m0:m0+MB, n0:n1] for GGUF blocks of type T (rows of q.codes) and rows of x rounded as llama.cpp does:
// each block unpacked where the loop meets it (in registers), for one group of rows of x.
template <int MB, int T>
void llama_block_rows(const QWeight& q, const Q8Block* x32, const Q8KBlock* x256, float* __restrict__ out, int64_t N,
                      int64_t n0, int64_t n1, int64_t m0) {
  const int64_t B = q.K / Unpacked<T>::EL;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.codes + n * q.code_cols;
    F32x8 acc[MB];
    float corr[MB];
    for (int m = 0; m < MB; ++m) acc[m] = f32_zero(), corr[m] = 0.f;
    for (int64_t b = 0; b < B; ++b) {
      __builtin_prefetch(c + b * Unpacked<T>::BY + 2 * q.code_cols);  // two rows ahead (see cols_task)
      Unpacked<T> u;
      unpack_block<T>(c + b * Unpacked<T>::BY, u);
      dot_block<MB, T>(u, x32, x256, B, b, m0, acc, corr);
    }
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = f32_sum(acc[m]) - corr[m];
  }
}

// The same for every row of x at once: each weight row unpacked once into `row` (B blocks, in L1 for the
// widths of Gemma's projections), then multiplied with each group of rows of x (`for_row_blocks`), where
// unpacking in registers would unpack each block once per group.
template <int T>
void llama_buffered_rows(const QWeight& q, const Q8Block* x32, const Q8KBlock* x256, float* __restrict__ out,
                         int64_t N, int64_t n0, int64_t n1, int64_t M) {
  const int64_t B = q.K / Unpacked<T>::EL;
  std::vector<Unpacked<T>> row(static_cast<size_t>(B));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = q.codes + n * q.code_cols;
    for (int64_t b = 0; b < B; ++b) unpack_block<T>(c + b * Unpacked<T>::BY, row[b]);
    __builtin_prefetch(c + 2 * q.code_cols);
    for_row_blocks(M, [&](auto mb, int64_t m0) {
      constexpr int MB = decltype(mb)::value;
      F32x8 acc[MB];
      float corr[MB];
      for (int m = 0; m < MB; ++m) acc[m] = f32_zero(), corr[m] = 0.f;
      for (int64_t b = 0; b < B; ++b) dot_block<MB, T>(row[b], x32, x256, B, b, m0, acc, corr);
      for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = f32_sum(acc[m]) - corr[m];
    });
  }
}

void llama_rows(ffi::ThreadPool& pool, const float* X, float* Y, int64_t M, const QWeight& q, int64_t per_task) {
  const bool kq = q.block == 12 || q.block == 13 || q.block == 14;
  const int64_t N = q.N, B = q.K / (kq ? 256 : 32), nt = (N + per_task - 1) / per_task;
  std::vector<Q8Block> x32(kq ? 0 : static_cast<size_t>(M * B));
  std::vector<Q8KBlock> x256(kq ? static_cast<size_t>(M * B) : 0);
  for (int64_t i = 0; i < M * B; ++i) kq ? quantize_q8_K(X + 256 * i, x256[i]) : quantize_q8_0(X + 32 * i, x32[i]);
  const Q8Block* a = x32.data();
  const Q8KBlock* k = x256.data();
  // One group of rows of x (up to kRowBlock: decode steps): each block unpacked in registers where
  // the loop meets it. More groups (a 13-token prompt: 6 + 7): each weight row unpacked once for the
  // types whose unpacking costs (the 5th / 6th bits of Q5_0, Q5_K, Q6_K), not for nibbles and bytes,
  // where the row buffer's stores and loads cost more than unpacking again (measured: docs/benchmarks-notes.md,
  // "Kernel tuning notes").
  const bool one_group = M <= kRowBlock;
  auto run = [&](auto type) {
    constexpr int T = decltype(type)::value;
    constexpr bool costly_unpack = T == 6 || T == 13 || T == 14;
    parallel_for(pool, nt, [&](int64_t t) {
      const int64_t n0 = t * per_task, n1 = std::min(N, n0 + per_task);
      if (costly_unpack && !one_group) return llama_buffered_rows<T>(q, a, k, Y, N, n0, n1, M);
      for_row_blocks(M, [&](auto mb, int64_t m) { llama_block_rows<decltype(mb)::value, T>(q, a, k, Y, N, n0, n1, m); });
    });
  };
  switch (q.block) {
    case 8: return run(std::integral_constant<int, 8>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 12: return run(std::integral_constant<int, 12>{});
    case 13: return run(std::integral_constant<int, 13>{});
    case 14: return run(std::integral_constant<int, 14>{});
  }
}

// out[M, N] = x[M, K] @ deq(w)^T by the algorithm for `rows_for_choice` rows (the call's full row count).
void q_product(ffi::ThreadPool& pool, const QWeight& q, const float* X, float* Y, int64_t M, int64_t rows_for_choice,
               bool act8) {
  const int64_t K = q.K, N = q.N, G = K / q.group;
  const int bits = q.bits;
  const bool asym = q.asym;
  const bool int8_product = act8 && act8_layout(q);
  if (act8 && q.block && rows_for_choice < kGemmRowsT) {  // llama.cpp's integer dots on the blocks in place
    llama_rows(pool, X, Y, M, q, rows_per_task(pool, N, q.code_cols));
    return;
  }
  if (rows_for_choice >= (int8_product ? kGemmRowsT : kGemmRowsTFloatCodes)) {
    gemm_t(pool, X, Y, M, K, N,
           [&](int64_t n, int64_t k0, int64_t kc, float* dst) { dequant_row_span(q, n, k0, k0 + kc, dst); });
    return;
  }
  const int64_t per_task = rows_per_task(pool, N, q.code_cols);
  if (int8_product) {
    act8_rows(pool, X, Y, M, q, per_task);
    return;
  }
  const int64_t nt = (N + per_task - 1) / per_task;
  const bool fused = q.group % (bits == 4 ? 32 : 16) == 0;
  if (fused) {
    // x permuted for the int4 nibble order, and sum(x) per group for the asymmetric form
    std::vector<float> xp(X, X + M * K), xsum(static_cast<size_t>(M * G), 0.f);
    if (bits == 4)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 32)
          for (int j = 0; j < 16; ++j) {
            xp[m * K + k + j] = X[m * K + k + 2 * j];
            xp[m * K + k + 16 + j] = X[m * K + k + 2 * j + 1];
          }
    if (asym)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xsum[m * G + k / q.group] += X[m * K + k];
    if (q.block) {  // GGUF blocks: read in place
      parallel_for(pool, nt, [&](int64_t t) {
        const int64_t n0 = t * per_task, n1 = std::min(N, n0 + per_task);
        for_row_blocks(M, [&](auto mb, int64_t m) {
          constexpr int MB = decltype(mb)::value;
          const float *x = xp.data(), *xs = xsum.data();
          switch (q.block) {
            case 8: return qdot_raw<MB, 8>(q, x, xs, Y, N, n0, n1, m);
            case 6: return qdot_raw<MB, 6>(q, x, xs, Y, N, n0, n1, m);
            case 2: return qdot_block<MB, 4, false, 2>(q, x, xs, Y, N, n0, n1, m);
            case 3: return qdot_block<MB, 4, true, 3>(q, x, xs, Y, N, n0, n1, m);
            case 12: return qdot_raw<MB, 12>(q, x, xs, Y, N, n0, n1, m);
            case 13: return qdot_block<MB, 8, true, 13>(q, x, xs, Y, N, n0, n1, m);
            case 14: return qdot_raw<MB, 14>(q, x, xs, Y, N, n0, n1, m);
          }
        });
      });
      return;
    }
    auto run = [&](auto bits_c, auto asym_c) {
      constexpr int B = decltype(bits_c)::value;
      constexpr bool A = decltype(asym_c)::value;
      parallel_for(pool, nt, [&](int64_t t) {
        over_rows(q, t * per_task, std::min(N, (t + 1) * per_task), [&](const QWeight& v, int64_t n0, int64_t n1) {
          for_row_blocks(M, [&](auto mb, int64_t m) {
            qdot_block<decltype(mb)::value, B, A>(v, xp.data(), xsum.data(), Y, N, n0, n1, m);
          });
        });
      });
    };
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    if (bits == 4)
      asym ? run(I4{}, std::true_type{}) : run(I4{}, std::false_type{});
    else
      asym ? run(I8{}, std::true_type{}) : run(I8{}, std::false_type{});
    return;
  }
  // other group sizes: each weight row dequantized once into an L1 buffer, then multiplied
  parallel_for(pool, nt, [&](int64_t t) {
    std::vector<float> buf(static_cast<size_t>(K));
    over_rows(q, t * per_task, std::min(N, (t + 1) * per_task), [&](const QWeight& v, int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        __builtin_prefetch(v.row_codes(n) + 2 * v.code_cols);
        dequant_row(v.row_codes(n), v.row_scales(n), v.row_mins(n), K, v.group, v.bits, v.asym, buf.data());
        for_row_blocks(M, [&](auto mb, int64_t m) { dot_rows<decltype(mb)::value>(X, buf.data(), Y, K, N, n, m); });
      }
    });
  });
}

ffi::Error QRows(ffi::ThreadPool pool, Matrix x, ffi::AnyBuffer codes, Matrix scales, Matrix mins, MatrixOut out,
                 int64_t bits, bool asym, bool act8, int64_t block) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  QWeight q;
  if (auto e = check_q(codes, scales, mins, bits, asym, K, &q, block); e.failure()) return e;
  if (M * q.N == 0) return ffi::Error::Success();
  on_live_rows(x.typed_data(), out->typed_data(), M, K, q.N,
               [&](const float* X, float* Y, int64_t rows) { q_product(pool, q, X, Y, rows, M, act8); });
  return ffi::Error::Success();
}

// deq(w) as a float32 [N, K] matrix (many rows: the product is then XLA's float32 dot).
ffi::Error QDequant(ffi::ThreadPool pool, ffi::AnyBuffer codes, Matrix scales, Matrix mins, MatrixOut out,
                    int64_t bits, bool asym, int64_t block) {
  const int64_t K = out->dimensions()[1];
  QWeight q;
  if (auto e = check_q(codes, scales, mins, bits, asym, K, &q, block); e.failure()) return e;
  const int64_t N = q.N;
  float* Y = out->typed_data();
  const int64_t per_task = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(K, 1));
  parallel_for(pool, (N + per_task - 1) / per_task, [&](int64_t t) {
    over_rows(q, t * per_task, std::min(N, (t + 1) * per_task), [&](const QWeight& v, int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        dequant_row(v.row_codes(n), v.row_scales(n), v.row_mins(n), K, v.group, v.bits, v.asym, Y + n * K);
    });
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- attention over a KV cache
// The attention of few queries (decode steps, speculative verification, short prompts) over a KV
// cache, and the cache write, without XLA's copies: XLA:CPU fuses the cache's dynamic-update-slice into
// each reshaping consumer (the dots want [T, H] views of the [B, T, K, H] cache), so a decode step
// copied every layer's whole cache several times, at every step and at every cache length.
//
// out[b, s, n] = sum_t p_t v[b, t, n / G] with p = softmax_t(scale * q[b, s, n] . k[b, t, n / G]) over
// the visible slots t: kpos >= 0, kpos <= qpos[b, s] and, with a window W, kpos > qpos - W (what
// attention.visibility computes). Only visible slots are read; a query that sees none gives zeros.
// The cache may have more rows than q (the decode core steps the first B rows of a larger cache):
// query row b reads cache row b.
// K / V float32 or bfloat16, summed in float32 in slot order within each slot range of the split below,
// the ranges merged in order (XLA sums in another order: ~1e-7).
template <typename A, typename B>
bool same_dims(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}
template <typename E>
inline float kv_elem(const E* p, int64_t j) {
  if constexpr (std::is_same_v<E, float>) return p[j];
  else if constexpr (std::is_same_v<E, int8_t>) return static_cast<float>(p[j]);
  else return widen(p[j]);
}
template <typename E>
inline f32x16 kv_load(const E* p) {
  if constexpr (std::is_same_v<E, float>) return load_f32(p);
  else if constexpr (std::is_same_v<E, int8_t>) return widen_codes8(reinterpret_cast<const uint8_t*>(p), false);
  else return load_bf16(p);
}

// Attention of the G query heads q[G, H] that share one KV head over slots [t0, t1) of the cache, as an
// online softmax: per head the largest score m, the sum l of exp(score - m) and acc[H] = the sum of
// exp(score - m) v. Each visible key and value is read once for all G heads (a task per query head read
// them G times), and no buffer of the range's length is kept. The scores go in blocks of kAttendBlock
// visible slots, so the running maximum (and the rescaling of acc when it rises) is paid per block,
// not per key. A head that sees nothing ends with m = -inf, l = 0, acc = 0.
constexpr int64_t kAttendBlock = 32;

// Where a row's key slot t lives. A dense row: slot t of the row's own cache (k, v, kpos point at the
// row). A paged row: offset t % S of block blocks[t / S] of the pool (k, v, kpos point at the pool), and
// only while that slot holds position t (a block that changed owners keeps stale positions); a table
// entry >= P means no block. at(t) is that slot, or -1 when there is no key.
struct RowSlots {
  const int32_t* kpos;
  const int32_t* blocks = nullptr;  // the row's table entries; nullptr: dense
  int64_t shift = 0, P = 0;         // log2(S), pool blocks
  inline int64_t at(int64_t t) const {
    if (blocks == nullptr) return t;
    const int64_t blk = blocks[t >> shift];
    if (blk < 0 || blk >= P) return -1;
    const int64_t slot = (blk << shift) | (t & ((int64_t{1} << shift) - 1));
    return kpos[slot] == t ? slot : -1;
  }
  // the position of slot t's key, or -1
  inline int32_t pos(int64_t t) const {
    const int64_t a = at(t);
    return a < 0 ? -1 : kpos[a];
  }
};

// int8 K / V (ks, vs not null): codes, with a scale per slot and KV head at ks[slot * KH] (the pointers
// at this head): a score is scale * ks (q . codes), a value weighs p * vs.
template <typename E>
void attend_range(const float* __restrict__ q, const E* __restrict__ k, const E* __restrict__ v,
                  const RowSlots& slots, int64_t t0, int64_t t1, int64_t row, int64_t G, int64_t H,
                  int32_t qp, int64_t window, float scale, float* __restrict__ m, float* __restrict__ l,
                  float* __restrict__ acc, const float* ks = nullptr, const float* vs = nullptr, int64_t KH = 1) {
  const int64_t hv = H / 16 * 16;
  thread_local std::vector<float> buf;  // p[g * kAttendBlock + i]: scores, then their exponentials
  if (static_cast<int64_t>(buf.size()) < G * kAttendBlock) buf.resize(G * kAttendBlock);
  float* __restrict__ p = buf.data();
  int64_t seen[kAttendBlock];
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.f);
  std::fill(acc, acc + G * H, 0.f);
  for (int64_t t = t0; t < t1;) {
    int64_t n = 0;
    for (; t < t1 && n < kAttendBlock; ++t) {
      const int64_t a = slots.at(t);
      if (a < 0) continue;
      const int32_t pos = slots.kpos[a];
      if (pos < 0 || pos > qp || (window > 0 && int64_t{pos} <= int64_t{qp} - window)) continue;
      seen[n++] = a;
    }
    for (int64_t i = 0; i < n; ++i) {
      const E* kt = k + seen[i] * row;
      // The value rows are read 16 columns at a time across the block below: fetched into L2 now.
      const char* vb = reinterpret_cast<const char*>(v + seen[i] * row);
      for (int64_t j = 0; j < H * int64_t{sizeof(E)}; j += 64) __builtin_prefetch(vb + j, 0, 2);
      for_row_blocks(G, [&](auto mb, int64_t g0) {
        constexpr int MB = decltype(mb)::value;
        f32x16 s[MB] = {};
        for (int64_t j = 0; j < hv; j += 16) {
          const f32x16 kc = kv_load(kt + j);
          for (int r = 0; r < MB; ++r) s[r] += load_f32(q + (g0 + r) * H + j) * kc;
        }
        const float sc = ks == nullptr ? scale : scale * ks[seen[i] * KH];
        for (int r = 0; r < MB; ++r) {
          float d = hsum(s[r]);
          for (int64_t j = hv; j < H; ++j) d += q[(g0 + r) * H + j] * kv_elem(kt, j);
          p[(g0 + r) * kAttendBlock + i] = d * sc;
        }
      });
    }
    for (int64_t g = 0; g < G; ++g) {
      float* pg = p + g * kAttendBlock;
      float top = m[g];
      for (int64_t i = 0; i < n; ++i) top = std::max(top, pg[i]);
      if (top > m[g]) {
        if (l[g] > 0.f) {  // earlier keys were weighed against a smaller maximum
          const float c = std::exp(m[g] - top);
          l[g] *= c;
          for (int64_t j = 0; j < H; ++j) acc[g * H + j] *= c;
        }
        m[g] = top;
      }
      for (int64_t i = 0; i < n; ++i) l[g] += (pg[i] = std::exp(pg[i] - top));
      if (vs != nullptr)
        for (int64_t i = 0; i < n; ++i) pg[i] *= vs[seen[i] * KH];  // the values' scales, after the sum
    }
    // Each 16 columns of acc stay in registers over the block's values: one store per block instead
    // of one per value (a 64-byte store takes two cycles on Zen 4; per value, the stores bounded it).
    const E* vr[kAttendBlock];
    for (int64_t i = 0; i < n; ++i) vr[i] = v + seen[i] * row;
    for_row_blocks(G, [&](auto mb, int64_t g0) {
      constexpr int MB = decltype(mb)::value;
      const float* w = p + g0 * kAttendBlock;
      int64_t j = 0;
      for (; j < hv; j += 16) {
        f32x16 a[MB];
        for (int r = 0; r < MB; ++r) a[r] = load_f32(acc + (g0 + r) * H + j);
        for (int64_t i = 0; i < n; ++i) {
          const f32x16 vc = kv_load(vr[i] + j);
          for (int r = 0; r < MB; ++r) a[r] += w[r * kAttendBlock + i] * vc;
        }
        for (int r = 0; r < MB; ++r) store_f32(acc + (g0 + r) * H + j, a[r]);
      }
      for (; j < H; ++j)
        for (int r = 0; r < MB; ++r)
          for (int64_t i = 0; i < n; ++i) acc[(g0 + r) * H + j] += w[r * kAttendBlock + i] * kv_elem(vr[i], j);
    });
  }
}

// Slots [lo, hi) around the slots visible to a query at qp: the first and the last visible one.
inline std::pair<int64_t, int64_t> visible_span(const RowSlots& slots, int64_t T, int32_t qp, int64_t window) {
  auto visible = [&](int64_t t) {
    const int32_t p = slots.pos(t);
    return p >= 0 && p <= qp && (window <= 0 || int64_t{p} > int64_t{qp} - window);
  };
  int64_t lo = 0, hi = T;
  while (lo < T && !visible(lo)) ++lo;
  while (hi > lo && !visible(hi - 1)) --hi;
  return {lo, hi};
}

// Split-K (flash decoding): each query's visible span (its first to its last visible slot, not the cache
// length: a global cache of 32K slots at depth 1K has its keys in the first 1K) is cut into ranges of
// about kRangeSlots slots, one task each, so batch-1 decode (one unit per KV head: one on the Gemma 3
// 270M and E2B) still spreads over the pool, a sliding layer's 512-slot window over 2 tasks. The cut
// depends on that query's span alone, and each range leaves its own (m, l, acc), merged in range
// order: a row's result does not depend on the batch it is in, the other rows or the thread count.
// 256 slots: a range's merge costs G * H multiply-adds, ~0.2% of its G * H * 2 * 256; 128 measured no
// faster at 1K-32K (bench/attend_depth.py), and a split chosen from the task count (fewer, longer
// ranges at large batches) made a row's sums depend on its batch.
constexpr int64_t kRangeSlots = 256;

// Paged (table != nullptr): K / V are a pool [P, PS, KH, H] with positions kpos [P, PS], row b's slot t
// is found through table[b, t / PS] (`RowSlots`), T = M * PS; the same ranges and sums as a dense cache
// holding those slots.
template <typename E>
void attend(ffi::ThreadPool& pool, const float* Q, const E* K, const E* V, const int32_t* kpos, const int32_t* qpos,
            float* out, int64_t B, int64_t S, int64_t N, int64_t T, int64_t KH, int64_t H, int64_t window,
            float scale, const int32_t* table = nullptr, int64_t M = 0, int64_t shift = 0, int64_t blocks = 0,
            const float* KS = nullptr, const float* VS = nullptr) {
  const int64_t G = N / KH, row = KH * H, units = B * S * KH;  // a unit: a query and its KV head's G heads
  auto row_slots = [&](int64_t b) {
    return table == nullptr ? RowSlots{kpos + b * T} : RowSlots{kpos, table + b * M, shift, blocks};
  };
  const int64_t row_step = table == nullptr ? T * row : 0;  // where row b's K / V begin
  std::vector<std::pair<int64_t, int64_t>> span(static_cast<size_t>(B * S));
  for (int64_t bs = 0; bs < B * S; ++bs) span[bs] = visible_span(row_slots(bs / S), T, qpos[bs], window);
  std::vector<int64_t> first(static_cast<size_t>(units + 1), 0);  // the first range (task) of each unit
  for (int64_t u = 0; u < units; ++u) {
    const auto [lo, hi] = span[u / KH];
    first[u + 1] = first[u] + std::max<int64_t>(1, (hi - lo + kRangeSlots / 2) / kRangeSlots);
  }
  const int64_t tasks = first[units], part = G * (H + 2);  // one range's m[G], l[G], acc[G, H]
  std::vector<float> parts(static_cast<size_t>(tasks * part));
  std::vector<int64_t> unit_of(static_cast<size_t>(tasks));
  for (int64_t u = 0; u < units; ++u) std::fill(unit_of.begin() + first[u], unit_of.begin() + first[u + 1], u);
  auto task = [&](int64_t i) {
    const int64_t u = unit_of[i], r = i - first[u], P = first[u + 1] - first[u];
    const int64_t kh = u % KH, bs = u / KH, b = bs / S;
    const auto [lo, hi] = span[bs];
    float* pt = parts.data() + i * part;
    const int64_t so = b * (row_step / H) + kh;  // this row and head's first scale
    attend_range(Q + (bs * N + kh * G) * H, K + b * row_step + kh * H, V + b * row_step + kh * H, row_slots(b),
                 lo + (hi - lo) * r / P, lo + (hi - lo) * (r + 1) / P, row, G, H, qpos[bs], window, scale, pt,
                 pt + G, pt + 2 * G, KS == nullptr ? nullptr : KS + so, VS == nullptr ? nullptr : VS + so, KH);
  };
  // below ~1 M multiply-adds in all the pool costs more than it saves (same arithmetic either way)
  if (B * S * N * T * H < (int64_t{1} << 20)) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
  } else {
    parallel_for(pool, tasks, task);
  }
  for (int64_t u = 0; u < units; ++u) {
    const int64_t kh = u % KH, bs = u / KH, P = first[u + 1] - first[u];
    const float* pu = parts.data() + first[u] * part;
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + (bs * N + kh * G + g) * H;
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t r = 0; r < P; ++r) top = std::max(top, pu[r * part + g]);
      std::fill(o, o + H, 0.f);
      if (top == -std::numeric_limits<float>::infinity()) continue;  // no range saw a key: zeros
      for (int64_t r = 0; r < P; ++r) {
        const float* pr = pu + r * part;
        const float c = std::exp(pr[g] - top);  // 0 for a range that saw nothing (m = -inf)
        total += c * pr[G + g];
        const float* a = pr + 2 * G + g * H;
        for (int64_t j = 0; j < H; ++j) o[j] += c * a[j];
      }
      for (int64_t j = 0; j < H; ++j) o[j] /= total;
    }
  }
}

ffi::Error Attend(ffi::ThreadPool pool, Heads q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  CachePositions kpos, Positions qpos, Positions table, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                  HeadsOut out, int64_t window, float scale, bool paged) {
  auto qd = q.dimensions(), kd0 = k.dimensions(), pd0 = kpos.dimensions();
  // a stacked cache ([R, B, T, K, H] / [R, P, S, K, H], kpos [R, B, T]): its layers' rows (blocks) one after another
  const bool stacked = kd0.size() == 5 && pd0.size() == 3;
  if ((kd0.size() != 4 && !stacked) || !same_dims(v.dimensions(), kd0) || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("gemma4_attend: k and v must be [B, T, K, H] (or [P, S, K, H]) of one dtype");
  const int64_t kd[4] = {stacked ? kd0[0] * kd0[1] : kd0[0], kd0[stacked + 1], kd0[stacked + 2], kd0[stacked + 3]};
  const int64_t pd[2] = {stacked ? pd0[0] * pd0[1] : pd0[0], pd0[stacked + 1]};
  const int64_t B = qd[0], S = qd[1], N = qd[2], H = qd[3], KH = kd[2];
  int64_t T = kd[1], M = 0, shift = 0;
  if (paged) {  // k: a pool [P, PS, KH, H]; table [>= B, M]
    const int64_t PS = kd[1];
    M = table.dimensions()[1];
    T = M * PS;
    while ((int64_t{1} << shift) < PS) ++shift;
    if ((int64_t{1} << shift) != PS || table.dimensions()[0] < B || pd[0] != kd[0] || pd[1] != PS)
      return ffi::Error::InvalidArgument("gemma4_attend: a pool [P, S (a power of two), K, H], kpos [P, S], table [>= B, M]");
  }
  // not paged: table [1, 1] holds the cache row query row 0 reads (a stacked cache's layer: its rows from there)
  const int64_t first = paged || table.element_count() < 1 ? 0 : table.typed_data()[0];
  if (!paged && (first < 0 || first + B > kd[0] || pd[0] != kd[0] || pd[1] != T))
    return ffi::Error::InvalidArgument(
        "gemma4_attend: q [B, S, N, H], k [Bc >= first + B, T, K, H] and kpos [Bc, T] disagree");
  if (kd[3] != H || KH < 1 || N % KH != 0 || qpos.dimensions()[0] != B || qpos.dimensions()[1] != S)
    return ffi::Error::InvalidArgument("gemma4_attend: q [B, S, N, H], k [., ., K, H] and qpos [B, S] disagree");
  const int32_t* tbl = paged ? table.typed_data() : nullptr;
  const int64_t skip = first * T * KH;  // elements of the rows before `first`, per head dim (scales: per slot head)
  const int32_t* kp = kpos.typed_data() + first * T;
  if (k.element_type() == ffi::DataType::F32)
    attend(pool, q.typed_data(), reinterpret_cast<const float*>(k.untyped_data()) + skip * H,
           reinterpret_cast<const float*>(v.untyped_data()) + skip * H, kp, qpos.typed_data(), out->typed_data(), B,
           S, N, T, KH, H, window, scale, tbl, M, shift, kd[0]);
  else if (k.element_type() == ffi::DataType::BF16)
    attend(pool, q.typed_data(), reinterpret_cast<const uint16_t*>(k.untyped_data()) + skip * H,
           reinterpret_cast<const uint16_t*>(v.untyped_data()) + skip * H, kp, qpos.typed_data(),
           out->typed_data(), B, S, N, T, KH, H, window, scale, tbl, M, shift, kd[0]);
  else if (k.element_type() == ffi::DataType::S8) {
    // scales [Bc, T, KH] (or [P, PS, KH]) float32: one per slot and KV head
    if (k_scale.element_type() != ffi::DataType::F32 || v_scale.element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(k_scale.element_count()) * H != static_cast<int64_t>(k.element_count()) ||
        v_scale.element_count() != k_scale.element_count())
      return ffi::Error::InvalidArgument("gemma4_attend: int8 k / v need float32 scales [..., K] per slot and head");
    attend(pool, q.typed_data(), reinterpret_cast<const int8_t*>(k.untyped_data()) + skip * H,
           reinterpret_cast<const int8_t*>(v.untyped_data()) + skip * H, kp, qpos.typed_data(), out->typed_data(), B,
           S, N, T, KH, H, window, scale, tbl, M, shift, kd[0],
           reinterpret_cast<const float*>(k_scale.untyped_data()) + skip,
           reinterpret_cast<const float*>(v_scale.untyped_data()) + skip);
  } else
    return ffi::Error::InvalidArgument("gemma4_attend: k / v must be float32, bfloat16 or int8");
  return ffi::Error::Success();
}

// The cache write, in place: k_out / v_out / pos_out alias the cache's k / v / pos (XLA hands the
// cache's own buffers over when nothing else reads them afterwards). Row s of b's new entries goes to
// slot slots[b, s]; a slot outside [0, T) drops it. The new entries may cover only the first rows of
// the cache (new [Bn <= B, S, ...]); the other rows are left as they are. flat (a block pool [P, PS,
// ...]): slots index the pool's P * PS slots as one row, whatever row the entry came from. K / V may
// have any trailing dims ([.., K, H] values, [.., K] int8 scales); a slot is their product.
ffi::Error KvWrite(ffi::AnyBuffer k, ffi::AnyBuffer v, CachePositions pos, ffi::AnyBuffer k_new,
                   ffi::AnyBuffer v_new, Positions pos_new, Positions slots,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                   CachePositionsOut pos_out, bool flat) {
  auto kd = k.dimensions(), nd = k_new.dimensions();
  // flat: any cache whose positions have one entry per slot (a pool [P, PS, ...]; a stack [R, X, Y, ...])
  const size_t lead = flat ? pos.dimensions().size() : 2;  // the cache's slot axes
  if (kd.size() < lead || nd.size() != kd.size() - lead + 2 || !same_dims(v.dimensions(), kd) ||
      !same_dims(v_new.dimensions(), nd) || k_new.element_type() != k.element_type() ||
      v_new.element_type() != k.element_type() || v.element_type() != k.element_type())
    return ffi::Error::InvalidArgument("gemma4_kv_write: cache [B, T, ...] and new [B, S, ...] of one dtype");
  int64_t B = kd[0], T = 1;
  for (size_t i = 1; i < lead; ++i) T *= kd[i];
  const int64_t S = nd[1], Bn = nd[0];
  bool same = true;
  for (size_t i = lead; i < kd.size(); ++i) same = same && nd[i - lead + 2] == kd[i];
  for (size_t i = 0; i < lead; ++i) same = same && pos.dimensions()[i] == kd[i];
  if (!same || (!flat && Bn > B) || slots.dimensions()[0] != Bn || slots.dimensions()[1] != S ||
      pos_new.dimensions()[0] != Bn || pos_new.dimensions()[1] != S)
    return ffi::Error::InvalidArgument("gemma4_kv_write: shapes disagree");
  char* ko = static_cast<char*>(k_out->untyped_data());
  char* vo = static_cast<char*>(v_out->untyped_data());
  int32_t* po = pos_out->typed_data();
  // Not aliased (XLA chose to copy): start from the old cache.
  if (ko != k.untyped_data()) std::memcpy(ko, k.untyped_data(), k.size_bytes());
  if (vo != v.untyped_data()) std::memcpy(vo, v.untyped_data(), v.size_bytes());
  if (po != pos.typed_data()) std::memcpy(po, pos.typed_data(), pos.size_bytes());
  if (B * T == 0) return ffi::Error::Success();
  const int64_t row = static_cast<int64_t>(k.size_bytes()) / (B * T);  // bytes of one slot
  const int64_t span = flat ? B * T : T;  // the slots one entry may go to
  const char* kn = static_cast<const char*>(k_new.untyped_data());
  const char* vn = static_cast<const char*>(v_new.untyped_data());
  for (int64_t b = 0; b < Bn; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int32_t slot = slots.typed_data()[b * S + s];
      if (slot < 0 || slot >= span) continue;
      const int64_t at = flat ? slot : b * T + slot;
      std::memcpy(ko + at * row, kn + (b * S + s) * row, row);
      std::memcpy(vo + at * row, vn + (b * S + s) * row, row);
      po[at] = pos_new.typed_data()[b * S + s];
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Bf16Cols, Cols,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<Index>()
                                  .Ret<Matrix>()
                                  .Attr<bool>("bf16"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Bf16Rows, Rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<Index>()
                                  .Ret<Matrix>()
                                  .Attr<bool>("bf16"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Bf16Take, Take,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<Bf16Matrix>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4QRows, QRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("asym")
                                  .Attr<bool>("act8")
                                  .Attr<int64_t>("block"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4QDequant, QDequant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("asym")
                                  .Attr<int64_t>("block"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Attend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Heads>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<CachePositions>()
                                  .Arg<Positions>()
                                  .Arg<Positions>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Heads>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<bool>("paged"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4KvWrite, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<CachePositions>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Positions>()
                                  .Arg<Positions>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<CachePositions>()
                                  .Attr<bool>("flat"));
