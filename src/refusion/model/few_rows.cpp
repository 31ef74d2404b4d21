// y[r, o] = sum_k x[r, k] * w[o, k] (+ b[o]) for a few rows r, float32, weights as they are ([out, in],
// row-major). Each output is summed in one fixed order (VL-lane partial sums over k, a fixed tree over
// the lanes, then the k tail), whatever the number of rows or threads: a row's result is the same bits
// alone or beside others. Written for memory speed: a tile of OB weight rows is read once for up to RB
// input rows (the shape chosen by the number of rows), its next tile prefetched. Portable C++ (GCC/Clang
// vector extensions, C++17); -march=native picks the vectors. See few_rows.py.
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define SPLIT 4  // (shaped's tiles have OB 2 or 4)

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

// A tile: OB weight rows by rb input rows, OB * rb accumulators and rb inputs held in registers. The next
// tile's weight rows are prefetched at locality LOC (3: into L1; 1: into L2 only, which on the project's
// CPU overlaps the reads with the arithmetic of 8 to 16 rows better).
template <int OB, int rb, int LOC>
static inline void tile(const float* x, const float* w, float* y, const float* bias, int64_t K, int64_t O,
                        int64_t o, int64_t r) {
  const int64_t Kv = K - K % VL;
  vec acc[OB][rb];
#pragma GCC unroll 16
  for (int i = 0; i < OB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) acc[i][j] = vec{};
  for (int64_t k = 0; k < Kv; k += VL) {
    vec xv[rb];
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) xv[j] = load(x + (r + j) * K + k);
#pragma GCC unroll 16
    for (int i = 0; i < OB; ++i) {
      const vec wv = load(w + (o + i) * K + k);
      __builtin_prefetch(w + (o + i + OB) * K + k, 0, LOC);  // (a prefetch past the end is harmless)
#pragma GCC unroll 16
      for (int j = 0; j < rb; ++j) acc[i][j] += wv * xv[j];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < OB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < rb; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (int64_t k = Kv; k < K; ++k) s += x[(r + j) * K + k] * w[(o + i) * K + k];
      if (bias) s += bias[o + i];
      y[(r + j) * O + o + i] = s;
    }
}

// every row against weight rows o..o+OB-1: tiles of RB rows, then one of the rows left
template <int OB, int RB, int LOC>
static void rows(const float* x, const float* w, float* y, const float* bias, int64_t R, int64_t K, int64_t O,
                 int64_t o) {
  int64_t r = 0;
  for (; r + RB <= R; r += RB) tile<OB, RB, LOC>(x, w, y, bias, K, O, o, r);
  switch (R - r) {
    case 7: if constexpr (RB > 7) tile<OB, 7, LOC>(x, w, y, bias, K, O, o, r); break;
    case 6: if constexpr (RB > 6) tile<OB, 6, LOC>(x, w, y, bias, K, O, o, r); break;
    case 5: if constexpr (RB > 5) tile<OB, 5, LOC>(x, w, y, bias, K, O, o, r); break;
    case 4: if constexpr (RB > 4) tile<OB, 4, LOC>(x, w, y, bias, K, O, o, r); break;
    case 3: if constexpr (RB > 3) tile<OB, 3, LOC>(x, w, y, bias, K, O, o, r); break;
    case 2: if constexpr (RB > 2) tile<OB, 2, LOC>(x, w, y, bias, K, O, o, r); break;
    case 1: tile<OB, 1, LOC>(x, w, y, bias, K, O, o, r); break;
    default: break;
  }
}

template <int OB, int RB, int LOC>
static void outputs(const float* x, const float* w, float* y, const float* bias, int64_t R, int64_t K, int64_t O,
                    int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + OB <= o1; o += OB) rows<OB, RB, LOC>(x, w, y, bias, R, K, O, o);
  for (; o < o1; ++o) rows<1, RB, LOC>(x, w, y, bias, R, K, O, o);
}

// outputs o0..o1-1 in the tile shape for R rows
static void shaped(const float* x, const float* w, float* y, const float* bias, int64_t R, int64_t K, int64_t O,
                   int64_t o0, int64_t o1) {
#if VL == 16
  if (R > 4) return outputs<2, 8, 1>(x, w, y, bias, R, K, O, o0, o1);
  return outputs<4, 4, 3>(x, w, y, bias, R, K, O, o0, o1);
#else
  return outputs<4, 2, 3>(x, w, y, bias, R, K, O, o0, o1);
#endif
}

extern "C" void few_rows_linear(const float* x, const float* w, const float* bias, float* y, int64_t R, int64_t K,
                                int64_t O, int threads) {
  if (threads <= 1) {
    shaped(x, w, y, bias, R, K, O, 0, O);
    return;
  }
  // outputs split between threads in whole tiles (SPLIT: a multiple of every shape's OB): each output is
  // still summed by one thread, in one order
  const int64_t per = ((O + threads - 1) / threads + SPLIT - 1) / SPLIT * SPLIT;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; ++t) {
    const int64_t a = t * per, b = a + per < O ? a + per : O;
    if (a < b) shaped(x, w, y, bias, R, K, O, a, b);
  }
}
