// y[r, o] = sum_k x[r, k] * w[o, k] (+ b[o]) for a few rows r, float32, weights as they are ([out, in],
// row-major). Each output is summed in one fixed order (VL-lane partial sums over k, a fixed tree over
// the lanes, then the k tail), whatever the number of rows or threads: a row's result is the same bits
// alone or beside others. Written for memory speed: a tile of OB weight rows is read once for up to RB
// input rows, its next tile prefetched. Portable C++ (GCC/Clang vector extensions); -march=native picks
// the vectors. See few_rows.py.
#include <stdint.h>
#include <string.h>

// a tile: OB weight rows by RB input rows, its OB * RB accumulators and RB inputs kept in registers
#if defined(__AVX512F__)
#define VL 16
#define RB 8
#define OB 2
#else
#define VL 8
#define RB 2
#define OB 4
#endif

typedef float vec __attribute__((vector_size(VL * 4)));

static inline vec load(const float* p) {
  vec v;
  memcpy(&v, p, sizeof v);
  return v;
}

// a fixed tree, in registers: lanes i and i + h added for h = VL/2, ..., 1
#if VL == 16
typedef float vec8 __attribute__((vector_size(32)));
static inline vec8 halves(vec v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
typedef vec vec8;
static inline vec8 halves(vec v) { return v; }
#endif
typedef float vec4 __attribute__((vector_size(16)));
typedef float vec2 __attribute__((vector_size(8)));
static inline float lanes_sum(vec v) {
  const vec8 a = halves(v);
  const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vec2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

template <int ob, int rb>
static inline void tile(const float* x, const float* w, float* y, const float* bias, int64_t K, int64_t O,
                        int64_t o, int64_t r) {
  const int64_t Kv = K - K % VL;
  vec acc[ob][rb];
#pragma GCC unroll 16
  for (int i = 0; i < ob; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) acc[i][j] = vec{};
  for (int64_t k = 0; k < Kv; k += VL) {
    vec xv[rb];
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) xv[j] = load(x + (r + j) * K + k);
#pragma GCC unroll 16
    for (int i = 0; i < ob; ++i) {
      const vec wv = load(w + (o + i) * K + k);
      // the next tile's row (a prefetch past the end is harmless), to L2 only: on the project's CPU
      // that overlaps the reads with the arithmetic of 8 to 16 rows better than a prefetch to L1
      __builtin_prefetch(w + (o + i + OB) * K + k, 0, 1);
#pragma GCC unroll 16
      for (int j = 0; j < rb; ++j) acc[i][j] += wv * xv[j];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < ob; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (int64_t k = Kv; k < K; ++k) s += x[(r + j) * K + k] * w[(o + i) * K + k];
      if (bias) s += bias[o + i];
      y[(r + j) * O + o + i] = s;
    }
}

template <int ob>
static void rows(const float* x, const float* w, float* y, const float* bias, int64_t R, int64_t K, int64_t O,
                 int64_t o) {
  int64_t r = 0;
  for (; r + RB <= R; r += RB) tile<ob, RB>(x, w, y, bias, K, O, o, r);
  switch (R - r) {
#if RB > 4
    case 7: tile<ob, 7>(x, w, y, bias, K, O, o, r); break;
    case 6: tile<ob, 6>(x, w, y, bias, K, O, o, r); break;
    case 5: tile<ob, 5>(x, w, y, bias, K, O, o, r); break;
    case 4: tile<ob, 4>(x, w, y, bias, K, O, o, r); break;
    case 3: tile<ob, 3>(x, w, y, bias, K, O, o, r); break;
    case 2: tile<ob, 2>(x, w, y, bias, K, O, o, r); break;
#endif
    case 1: tile<ob, 1>(x, w, y, bias, K, O, o, r); break;
    default: break;
  }
}

static void outputs(const float* x, const float* w, float* y, const float* bias, int64_t R, int64_t K, int64_t O,
                    int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + OB <= o1; o += OB) rows<OB>(x, w, y, bias, R, K, O, o);
  for (; o < o1; ++o) rows<1>(x, w, y, bias, R, K, O, o);
}

extern "C" void few_rows_linear(const float* x, const float* w, const float* bias, float* y, int64_t R, int64_t K,
                                int64_t O, int threads) {
  if (threads <= 1) {
    outputs(x, w, y, bias, R, K, O, 0, O);
    return;
  }
  // outputs split between threads in whole tiles: each output is still summed by one thread, in one order
  const int64_t per = ((O + threads - 1) / threads + OB - 1) / OB * OB;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; ++t) {
    const int64_t a = t * per, b = a + per < O ? a + per : O;
    if (a < b) outputs(x, w, y, bias, R, K, O, a, b);
  }
}
