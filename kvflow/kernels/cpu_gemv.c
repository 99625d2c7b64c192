/* Decode-shaped linears: out = x W^T (+ bias) for a few rows of x (a decode step's tokens),
 * reading each weight once at close to the memory's streaming speed (cpu_ops.py `gemv`).
 *
 * At a few rows a linear layer is a stream of its weights: every weight is used once per row
 * of x, so the time is the bytes of W over the read bandwidth. oneDNN's GEMM is built for
 * large M; at M = 1..16 its set-up and blocking cost more than the arithmetic. Here W stays
 * in its row-major [N, K] layout (the checkpoint's), and each thread takes a contiguous range
 * of output rows: four rows of W are streamed side by side and dotted with every row of x
 * (held in L1/L2), so each weight byte is read from memory once. Each load also prefetches
 * the same offset two tiles ahead: the hardware prefetcher alone kept too few reads in
 * flight (bf16 weights streamed at 21 GB/s and int8 at 14 on a machine that reads 29; with
 * the prefetch 28 and 37: benchmarks/cpu_kernels.py --gemv).
 *
 * Weights: float32, bfloat16 (widened in registers, or on AVX512-BF16 CPUs multiplied in
 * pairs by vdpbf16ps) and int8 with a float32 scale per output row (W8A16: x is rounded per
 * row to 15-bit integers, the products summed exactly in integers and scaled once; see
 * dot_tile_i8). Sums in float32 (int8: integers); the output is rounded once to its dtype,
 * with the bias (a float32 vector) added before rounding, as oneDNN does.
 *
 * Paths: AVX-512 (16 lanes), AVX2 + FMA (8 lanes), or plain C; chosen by the build's -march
 * (cpu_ops.py builds this file with cpu_ops.c into one library, also without AVX512-BF16 or
 * AVX-512 for tests).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* T_BF16_AMX: bfloat16 packed for the tile unit (`pack_amx`), read only where it runs.
 * T_BF16_PANELS: bfloat16 in panels of PANEL outputs (`pack_panels`), float32 arithmetic.
 * T_I8_PANELS: int8 in panels of PANEL outputs by input pairs (`pack_i8_panels`).
 * T_BF16_PANELS12: the bfloat16 panels in 12 bits a weight, lossless (`pack_panels12`).
 * T_BF16_PAIRS: bfloat16 in panels by input pairs (`pack_pairs`), bfloat16 dot products.
 * T_BF16_PAIRS12: the pair panels in 12 bits a weight, lossless (`pack_pairs12`), a few rows. */
enum { T_F32 = 0, T_BF16 = 1, T_I8 = 2, T_BF16_AMX = 3, T_BF16_PANELS = 4, T_I8_PANELS = 5,
       T_BF16_PANELS12 = 6, T_BF16_PAIRS = 7, T_BF16_PAIRS12 = 8 };

static inline float gemv_bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t gemv_f32_to_bf16(float f) {    /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* --- vectors: VL float32 lanes, loads of VL weights of each type ------------------------- */
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define VLOAD_F32(p) _mm512_loadu_ps(p)
#define VBROADCAST(p) _mm512_set1_ps(*(p))
#define VSTORE_F32(p, v) _mm512_storeu_ps(p, v)
typedef __m512i vword;
#define VLOAD_WORDS(p) _mm512_loadu_si512((const void *)(p))
#define VEVEN_BF16(u) _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))
#define VODD_BF16(u) _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000)))
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
static inline float vsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VSUM(v) vsum256(v)
#define VLOAD_F32(p) _mm256_loadu_ps(p)
#define VBROADCAST(p) _mm256_broadcast_ss(p)
#define VSTORE_F32(p, v) _mm256_storeu_ps(p, v)
typedef __m256i vword;
#define VLOAD_WORDS(p) _mm256_loadu_si256((const __m256i *)(p))
#define VEVEN_BF16(u) _mm256_castsi256_ps(_mm256_slli_epi32(u, 16))
#define VODD_BF16(u) _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000)))
#endif

#define ROWS 4          /* rows of W streamed together */
#define XROWS 4         /* rows of x per pass over them (ROWS * XROWS accumulators) */
#define PREFETCH_TILES 2

/* Fetch row r's element k of the tile PREFETCH_TILES ahead (no fault past the end), once per
 * 64-byte line of the row, not once per vector (a vector of bf16 or int8 weights is 16 or 8
 * bytes on AVX2). Into L2 (T1), not L1: a T0 prefetch holds one of the core's few L1 fill
 * buffers until its line arrives; to L2 the int8 weights of a one-row decode streamed at
 * 19-23 GB/s instead of 16-21 (bf16 +0.5, the reads measured at 24). A distance in bytes
 * instead of tiles (4x the rows for int8), or 1 or 4 tiles, was no better. */
#if defined(__AVX512F__) || defined(__AVX2__)
#define PREFETCH(w, r, k, K)                                                                  \
    do {                                                                                      \
        if ((((k) * (int64_t)sizeof(*(w))) & 63) == 0)                                        \
            _mm_prefetch((const char *)((w) + ((r) + PREFETCH_TILES * ROWS) * (K) + (k)),    \
                         _MM_HINT_T1);                                                        \
    } while (0)
#else
#define PREFETCH(w, r, k, K) ((void)0)
#endif

static inline float load_w(const void *w, int type, int64_t i) {
    switch (type) {
        case T_F32: return ((const float *)w)[i];
        default: return gemv_bf16_to_f32(((const uint16_t *)w)[i]);
    }
}

/* Dot products of rows n0..n0+nr-1 of W (nr <= ROWS) with rows m0..m0+mr-1 of xf (float32,
 * row stride K, mr <= XROWS) into acc[r][m]. One instance per weight type, so the loads are
 * constants the compiler unrolls. */
#ifdef VL
#define DEFINE_DOT_TILE(NAME, WT, VLOAD)                                                      \
static inline void NAME(const WT *w, int64_t K, int64_t nr, const float *xf, int64_t mr,    \
                        float acc[ROWS][XROWS]) {                                             \
    vf a[ROWS][XROWS];                                                                        \
    for (int r = 0; r < ROWS; r++)                                                            \
        for (int m = 0; m < XROWS; m++) a[r][m] = VZERO();                                    \
    const int64_t kv = K - K % VL;                                                            \
    if (nr == ROWS && mr == XROWS) {                 /* the common case, fully unrolled */   \
        for (int64_t k = 0; k < kv; k += VL) {                                                \
            vf wv[ROWS];                                                                      \
            for (int r = 0; r < ROWS; r++) {                                                  \
                PREFETCH(w, r, k, K);                                                         \
                wv[r] = VLOAD(w + r * K + k);                                                 \
            }                                                                                 \
            for (int m = 0; m < XROWS; m++) {                                                 \
                const vf xv = VLOAD_F32(xf + m * K + k);                                      \
                for (int r = 0; r < ROWS; r++) a[r][m] = VFMA(wv[r], xv, a[r][m]);            \
            }                                                                                 \
        }                                                                                     \
    } else if (mr == 1) {                            /* one row of x: a decode of one */      \
        for (int64_t k = 0; k < kv; k += VL) {                                                \
            const vf xv = VLOAD_F32(xf + k);                                                  \
            for (int r = 0; r < ROWS; r++)                                                    \
                if (r < nr) {                                                                 \
                    PREFETCH(w, r, k, K);                                                     \
                    a[r][0] = VFMA(VLOAD(w + r * K + k), xv, a[r][0]);                        \
                }                                                                             \
        }                                                                                     \
    } else {                                                                                  \
        for (int64_t k = 0; k < kv; k += VL) {                                                \
            vf wv[ROWS];                                                                      \
            for (int r = 0; r < ROWS; r++) {                                                  \
                if (r < nr) PREFETCH(w, r, k, K);                                             \
                wv[r] = r < nr ? VLOAD(w + r * K + k) : VZERO();                              \
            }                                                                                 \
            for (int m = 0; m < XROWS; m++) {                                                 \
                if (m >= mr) break;                                                           \
                const vf xv = VLOAD_F32(xf + m * K + k);                                      \
                for (int r = 0; r < ROWS; r++) a[r][m] = VFMA(wv[r], xv, a[r][m]);            \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < ROWS; r++)                                                            \
        for (int m = 0; m < XROWS; m++) acc[r][m] = VSUM(a[r][m]);                            \
    for (int64_t k = kv; k < K; k++)                 /* the tail, K not a multiple of VL */  \
        for (int r = 0; r < nr; r++)                                                          \
            for (int m = 0; m < mr; m++)                                                      \
                acc[r][m] += (float)load_w(w, TYPE_OF_##WT, r * K + k) * xf[m * K + k];      \
}
#else
#define DEFINE_DOT_TILE(NAME, WT, VLOAD)                                                      \
static inline void NAME(const WT *w, int64_t K, int64_t nr, const float *xf, int64_t mr,    \
                        float acc[ROWS][XROWS]) {                                             \
    for (int r = 0; r < ROWS; r++)                                                            \
        for (int m = 0; m < XROWS; m++) acc[r][m] = 0.0f;                                     \
    for (int r = 0; r < nr; r++)                                                              \
        for (int m = 0; m < mr; m++) {                                                        \
            float s = 0.0f;                                                                   \
            _Pragma("omp simd reduction(+:s)")                                                \
            for (int64_t k = 0; k < K; k++)                                                   \
                s += load_w(w, TYPE_OF_##WT, r * K + k) * xf[m * K + k];                     \
            acc[r][m] = s;                                                                    \
        }                                                                                     \
}
#endif

#define TYPE_OF_float T_F32
#define TYPE_OF_uint16_t T_BF16
DEFINE_DOT_TILE(dot_tile_f32, float, VLOAD_F32)
#ifdef VL
/* bf16 weights against x in float32 (every bf16 product but vdpbf16ps's): 2 VL weights a
 * step, loaded as VL 32-bit words, each a pair, whose even weight is the word shifted up 16
 * bits and whose odd one the word with its low 16 bits cleared: each is then a float32. One
 * load, a shift and an and per 2 VL weights, where widening VL at a time took a load with
 * zero-extension and a shift each: a one-token decode's weights (the default model's 121
 * matrices, 2 threads) streamed at 18-19 GB/s that way and at 20-21.6 this way, AVX2 and
 * AVX-512 builds alike, on a machine that reads 25.8. x must lie split to match (split_x:
 * per 2 VL floats the even ones, then the odd ones) up to K rounded down to 2 VL, the tail
 * in order; every row of x sums in the same order whatever mr is. */
#define SPLIT (2 * VL)
#if VL == 8
/* AVX2, several rows of x: 16 vector registers hold 4 x 4 accumulators and nothing else, so
 * the tile's rows of W go two at a time (8 accumulators), each step's even weights first and
 * its odd ones after, in the same registers. Same sums in the same order as the loop below.
 * A decode step's linears (the default model, 2 threads, as an AVX2 CPU), 2 paired runs:
 * 16 rows 34.1 / 31.6 ms against 35.2 / 36.2 with all four rows at once; 32 rows 66.3 /
 * 58.4 against 63.9 / 67.8. */
static inline __attribute__((always_inline)) void
dot_pair_bf16(const uint16_t *w, int64_t K, int64_t nr, const float *xf, int64_t mr,
              float acc[ROWS][XROWS], int r0) {
    vf a[2][XROWS];
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < XROWS; m++) a[r][m] = VZERO();
    const int64_t kv = K - K % SPLIT;
    for (int64_t k = 0; k < kv; k += SPLIT) {
        vf wv[2];
        for (int r = 0; r < 2; r++) {
            if (r < nr) PREFETCH(w, r, k, K);
            wv[r] = r < nr ? VEVEN_BF16(VLOAD_WORDS(w + r * K + k)) : VZERO();
        }
        for (int m = 0; m < XROWS; m++) {
            if (m >= mr) break;
            const vf xe = VLOAD_F32(xf + m * K + k);
            for (int r = 0; r < 2; r++) a[r][m] = VFMA(wv[r], xe, a[r][m]);
        }
        for (int r = 0; r < 2; r++)
            wv[r] = r < nr ? VODD_BF16(VLOAD_WORDS(w + r * K + k)) : VZERO();
        for (int m = 0; m < XROWS; m++) {
            if (m >= mr) break;
            const vf xo = VLOAD_F32(xf + m * K + k + VL);
            for (int r = 0; r < 2; r++) a[r][m] = VFMA(wv[r], xo, a[r][m]);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < XROWS; m++) acc[r0 + r][m] = VSUM(a[r][m]);
}
#endif

static inline void dot_tile_bf16(const uint16_t *w, int64_t K, int64_t nr, const float *xf,
                                 int64_t mr, float acc[ROWS][XROWS]) {
    const int64_t kv = K - K % SPLIT;
#if VL == 8
    if (mr > 1) {
        dot_pair_bf16(w, K, nr < 2 ? nr : 2, xf, mr, acc, 0);
        dot_pair_bf16(w + 2 * K, K, nr > 2 ? nr - 2 : 0, xf, mr, acc, 2);
        goto tail;
    }
#endif
    vf a[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < XROWS; m++) a[r][m] = VZERO();
    for (int64_t k = 0; k < kv; k += SPLIT) {
        vf we[ROWS], wo[ROWS];
        for (int r = 0; r < ROWS; r++) {
            if (r < nr) {
                PREFETCH(w, r, k, K);
                const vword u = VLOAD_WORDS(w + r * K + k);
                we[r] = VEVEN_BF16(u);
                wo[r] = VODD_BF16(u);
            } else {
                we[r] = wo[r] = VZERO();
            }
        }
        for (int m = 0; m < XROWS; m++) {
            if (m >= mr) break;
            const vf xe = VLOAD_F32(xf + m * K + k), xo = VLOAD_F32(xf + m * K + k + VL);
            for (int r = 0; r < ROWS; r++) a[r][m] = VFMA(wo[r], xo, VFMA(we[r], xe, a[r][m]));
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < XROWS; m++) acc[r][m] = VSUM(a[r][m]);
#if VL == 8
tail:
#endif
    for (int64_t k = kv; k < K; k++)
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mr; m++)
                acc[r][m] += gemv_bf16_to_f32(w[r * K + k]) * xf[m * K + k];
}

/* x's row in the order dot_tile_bf16 reads it. */
static inline int64_t split_x(int64_t k, int64_t K) {
    if (k >= K - K % SPLIT) return k;
    const int64_t base = k - k % SPLIT, j = k % SPLIT;
    return base + (j % 2) * VL + j / 2;
}
#else
DEFINE_DOT_TILE(dot_tile_bf16, uint16_t, unused)
static inline int64_t split_x(int64_t k, int64_t K) { (void)K; return k; }
#endif

/* --- int8 weights: integer dot products ---------------------------------------------------
 * Widening every int8 weight to float32 (sign extension, conversion, FMA: three vector ops per
 * VL weights) made the int8 loop the slowest of the three: in L2, one thread, 15.7 GB/s of
 * int8 against 35 of bf16 (benchmarks/cpu_kernels.py --gemv), so it could not keep up with the
 * memory. Here x is rounded once per row to integers of at most xq_max(K) (x ~ xq * xscale[m],
 * symmetric; 15 bits and under, a relative error of at most 2^-15 of the row's largest value,
 * about 1/100 of what rounding the weights to int8 costs) and each step sign-extends 2 VL
 * weights to 16 bits and multiplies them in pairs with x into 32-bit sums: one vpdpwssd
 * (AVX512-VNNI / AVX-VNNI), else vpmaddwd + vpaddd. The sums are exact integers, so the
 * result is the same on every ISA and for any number of rows; xq_max shrinks with K so that
 * no 32-bit lane can overflow. */
#define XQ_LIMIT 16383
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define IL 32                                        /* int16 lanes a step */
typedef __m512i vi;
#define VI_ZERO() _mm512_setzero_si512()
#define VI_LOAD_W(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define VI_LOAD_X(p) _mm512_loadu_si512((const void *)(p))
#if defined(__AVX512VNNI__)
#define VI_DOT(a, w, x) _mm512_dpwssd_epi32(a, w, x)
#define VI_DOT2(a, w, x, w1, x1) VI_DOT(VI_DOT(a, w, x), w1, x1)
#else
#define VI_DOT(a, w, x) _mm512_add_epi32(a, _mm512_madd_epi16(w, x))
#define VI_DOT2(a, w, x, w1, x1) \
    _mm512_add_epi32(a, _mm512_add_epi32(_mm512_madd_epi16(w, x), _mm512_madd_epi16(w1, x1)))
#endif
static inline int64_t vi_sum(__m512i v) {            /* in 64 bits: the lanes' sum may not fit 32 */
    return _mm512_reduce_add_epi64(_mm512_add_epi64(
        _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#elif defined(__AVX2__)
#define IL 16
typedef __m256i vi;
#define VI_ZERO() _mm256_setzero_si256()
#define VI_LOAD_W(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define VI_LOAD_X(p) _mm256_loadu_si256((const __m256i *)(p))
#if defined(__AVXVNNI__)
#define VI_DOT(a, w, x) _mm256_dpwssd_avx_epi32(a, w, x)
#define VI_DOT2(a, w, x, w1, x1) VI_DOT(VI_DOT(a, w, x), w1, x1)
#else
#define VI_DOT(a, w, x) _mm256_add_epi32(a, _mm256_madd_epi16(w, x))
#define VI_DOT2(a, w, x, w1, x1) \
    _mm256_add_epi32(a, _mm256_add_epi32(_mm256_madd_epi16(w, x), _mm256_madd_epi16(w1, x1)))
#endif
static inline int64_t vi_sum(__m256i v) {
    const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(wide),
                                    _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}
#endif

/* The largest |xq| for K inputs: a 32-bit lane sums at most K / 8 + 2 products of |w| <= 127
 * (8 lanes of 32 bits on AVX2; fewer products a lane on AVX-512). */
static inline int32_t xq_max(int64_t K) {
    const int64_t bound = INT32_MAX / (127 * (K / 8 + 2));
    return bound < XQ_LIMIT ? (int32_t)bound : XQ_LIMIT;
}

/* Exact sums of rows n0.. (nr <= ROWS) of int8 W with rows of xq (mr <= I8_XROWS). AVX2
 * has 16 vector registers: 4 x 4 accumulators, 4 weight vectors and x's spill, so it takes
 * 2 rows of x a pass (32 rows: 2.4 GB/s of int8 instead of 1.9, as an AVX2 CPU). */
#if defined(__AVX512F__) || !defined(IL)
#define I8_XROWS XROWS
#else
#define I8_XROWS 2
#endif
static inline __attribute__((always_inline)) void
dot_tile_i8(const int8_t *w, int64_t K, int64_t nr, const int16_t *xq, int64_t mr,
            int64_t acc[ROWS][I8_XROWS]) {
#ifdef IL
    vi a[ROWS][I8_XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < I8_XROWS; m++) a[r][m] = VI_ZERO();
    const int64_t kv = K - K % IL;
    for (int64_t k = 0; k < kv; k += IL) {
        vi wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            if (r < nr) {
                PREFETCH(w, r, k, K);
                wv[r] = VI_LOAD_W(w + r * K + k);
            } else {
                wv[r] = VI_ZERO();
            }
        }
        for (int m = 0; m < I8_XROWS; m++) {
            if (m >= mr) break;
            const vi xv = VI_LOAD_X(xq + m * K + k);
            for (int r = 0; r < ROWS; r++) a[r][m] = VI_DOT(a[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < I8_XROWS; m++) acc[r][m] = vi_sum(a[r][m]);
#else
    const int64_t kv = 0;
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < I8_XROWS; m++) acc[r][m] = 0;
#endif
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            int64_t s = 0;
            for (int64_t k = kv; k < K; k++) s += (int32_t)w[r * K + k] * xq[m * K + k];
            acc[r][m] += s;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 weights and bf16 x on AVX512-BF16: vdpbf16ps multiplies 32 pairs exactly and sums
 * them into 16 float32 lanes, with no widening of either operand. K even (pairs). */
static inline void dot_tile_dpbf16(const uint16_t *w, int64_t K, int64_t nr,
                                   const uint16_t *xb, int64_t mr, float acc[ROWS][XROWS]) {
    __m512 a[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < XROWS; m++) a[r][m] = _mm512_setzero_ps();
    const int64_t kv = K - K % 32;
    for (int64_t k = 0; k < kv; k += 32) {
        __m512bh wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            if (r < nr) PREFETCH(w, r, k, K);
            wv[r] = (__m512bh)(r < nr ? _mm512_loadu_si512(w + r * K + k) : _mm512_setzero_si512());
        }
        for (int m = 0; m < XROWS; m++) {
            if (m >= mr) break;
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
            for (int r = 0; r < ROWS; r++) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < XROWS; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
    for (int64_t k = kv; k < K; k++)
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mr; m++)
                acc[r][m] += gemv_bf16_to_f32(w[r * K + k]) * gemv_bf16_to_f32(xb[m * K + k]);
}
#endif


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KVFLOW_AMX 1
/* --- AMX (bf16, Sapphire Rapids and later) -----------------------------------------------
 * A decode step of 5..32 rows is still a stream of the weights, but too many rows for the
 * vdpbf16ps loop above (it issues at half the rate of float32 FMAs on these CPUs) and too
 * few for oneDNN's GEMM, which read a decode step's weights at 12-20 GB/s at 8 and 32 rows
 * on a machine that reads 27 (benchmarks/cpu_kernels.py --gemv --rows 8/32; these tiles:
 * 15-28). On the tile unit C[m, n] = sum_k x[m, k] W[n, k] takes x's rows as they lie (A:
 * 16 rows x 32 bf16) and W in the unit's B layout, packed once at load (`pack_amx`,
 * T_BF16_AMX): for each 16 output rows and 32 inputs, a contiguous 1 KB tile of 16 input
 * pairs x 16 outputs x 2. Each thread streams blocks of 32 output rows (two B tiles a step,
 * contiguous: the hardware prefetcher keeps up; software prefetches 1-4 blocks ahead were no
 * faster), and each result row is stored straight into `out`; from one row on it is as fast
 * as the row-major loops above. Tiles: C0, C1 = x rows 0-15 by the block's first and second
 * 16 outputs, C2, C3 = x rows 16-31 by the same; A4, A5 = x rows 0-15, 16-31; B6, B7 = the
 * two 16-output tiles of W. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_MAX_ROWS 32

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) AmxConfig;

/* Linux hands out the tile state only to processes that ask (arch_prctl, kernel >= 5.16). */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

/* lo, hi: rows of x in the first and second 16 (hi may be 0). */
static void amx_configure(int lo, int hi) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)lo;         /* C, A: x rows 0-15 */
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)hi;         /* C, A: x rows 16-31 */
    c.rows[6] = c.rows[7] = 16;                              /* B: 16 pairs */
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    if (!hi) c.colsb[2] = c.colsb[3] = c.colsb[5] = 0;
    _tile_loadconfig(&c);
}

/* Rows r of a result tile (16 outputs from n0, float32, row stride 16) out, plus bias. */
static inline void amx_store(const float *c, int64_t rows, int64_t m0, int64_t n0,
                             const float *bias, void *out, int otype, int64_t ldo) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * r), b);
        if (otype == T_F32)
            _mm512_storeu_ps((float *)out + (m0 + r) * ldo + n0, v);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (m0 + r) * ldo + n0),
                                (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Outputs n0..n0+15 (and n0+16..n0+31 when two) for x rows 0..M-1 (M <= 32). */
#define AMX_BLOCK(TWO, HI)                                                                    \
    do {                                                                                      \
        const uint16_t *b0 = wp + n0 * K;        /* 16 outputs x K: K/32 tiles of 512 */     \
        _tile_zero(0);                                                                        \
        if (TWO) _tile_zero(1);                                                               \
        if (HI) { _tile_zero(2); if (TWO) _tile_zero(3); }                                    \
        for (int64_t kb = 0; kb < K / 32; kb++) {                                             \
            _tile_loadd(4, x + kb * 32, ldx * 2);                                             \
            if (HI) _tile_loadd(5, x + 16 * ldx + kb * 32, ldx * 2);                          \
            _tile_loadd(6, b0 + kb * 512, 64);                                                \
            _tile_dpbf16ps(0, 4, 6);                                                          \
            if (HI) _tile_dpbf16ps(2, 5, 6);                                                  \
            if (TWO) {                                                                        \
                _tile_loadd(7, b0 + 16 * K + kb * 512, 64);                                   \
                _tile_dpbf16ps(1, 4, 7);                                                      \
                if (HI) _tile_dpbf16ps(3, 5, 7);                                              \
            }                                                                                 \
        }                                                                                     \
        _tile_stored(0, cbuf, 64);                                                            \
        amx_store(cbuf, lo, 0, n0, bias, out, otype, ldo);                                    \
        if (HI) { _tile_stored(2, cbuf, 64); amx_store(cbuf, hi, 16, n0, bias, out, otype, ldo); } \
        if (TWO) {                                                                            \
            _tile_stored(1, cbuf, 64);                                                        \
            amx_store(cbuf, lo, 0, n0 + 16, bias, out, otype, ldo);                           \
            if (HI) {                                                                         \
                _tile_stored(3, cbuf, 64);                                                    \
                amx_store(cbuf, hi, 16, n0 + 16, bias, out, otype, ldo);                      \
            }                                                                                 \
        }                                                                                     \
    } while (0)

/* out = x W^T (+ bias): x bf16 [M, K] (row stride ldx), W packed by `pack_amx` from [N, K],
 * K % 32 == 0, N % 16 == 0. Returns 0, or 2 when the tile unit is unavailable. */
static int amx_linear(const uint16_t *x0, int64_t ldx, int64_t M, const uint16_t *wp,
                      const float *bias, int64_t N, int64_t K, void *out0, int otype,
                      int64_t ldo) {
    if (!amx_usable()) return 2;
    const int64_t osize = otype == T_F32 ? 4 : 2;
    for (int64_t m0 = 0; m0 < M; m0 += AMX_MAX_ROWS) {       /* 32 rows at a time */
        const uint16_t *x = x0 + m0 * ldx;
        void *out = (char *)out0 + m0 * ldo * osize;
        const int64_t rows = M - m0 < AMX_MAX_ROWS ? M - m0 : AMX_MAX_ROWS;
        const int lo = rows < 16 ? (int)rows : 16, hi = rows > 16 ? (int)rows - 16 : 0;
        #pragma omp parallel if (N * K > 32768)
        {
            float cbuf[256] __attribute__((aligned(64)));
            amx_configure(lo, hi);
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < (N + 31) / 32; b++) {
                const int64_t n0 = b * 32;
                const int two = N - n0 >= 32;
                if (hi) { if (two) AMX_BLOCK(1, 1); else AMX_BLOCK(0, 1); }
                else { if (two) AMX_BLOCK(1, 0); else AMX_BLOCK(0, 0); }
            }
            _tile_release();
        }
    }
    return 0;
}
#endif

/* --- bfloat16 weights in panels, float32 arithmetic (T_BF16_PANELS) ---------------------
 *
 * Row-major W suits a few rows of x: each weight row is dotted with each x row, and the
 * horizontal sums are paid once per (output, x row). From about 8 rows on the arithmetic
 * dominates, and there the dot-product form wastes it: on AVX2 it reached 109 GFLOP/s at 32
 * rows, oneDNN's float32 GEMM 96, of the 252 the machine's FMAs can do (2 cores). Here W is
 * held in panels of PANEL = 2 VL outputs, [N / PANEL][K][PANEL] bfloat16, so that one load at
 * input k gives the panel's PANEL weights; each row of x is broadcast one element at a time
 * and multiplied into 2 accumulators a row (an outer product), MR rows at once. No horizontal
 * sums, no shuffles beyond widening: within each 32-bit lane of a load the low half is output
 * j and the high half output VL + j, so a shift and a mask widen the two halves. The panel
 * (K x PANEL x 2 bytes, 18 KB at K = 576 on AVX2) stays in L1 for the row blocks after the
 * first; that first pass streams it from memory with a prefetch PANEL_PREFETCH bytes ahead.
 * Measured (standalone, the default model's four decode-step linears x 30 layers, AVX2, 2
 * threads): 6.9 / 8.2 / 13.0 / 21 / 38 / 71 ms at 1 / 4 / 8 / 16 / 32 / 64 rows, against the
 * row-major kernel's 12 / 14 / 22 / 36 / 62 (through Python) and oneDNN's float32 103 at 64.
 * AVX-512 has 32 registers: blocks of 12 rows there (32 rows: 59-64 ms against 69-80 with
 * blocks of 6, same runs). */
#ifdef VL
#define PANEL (2 * VL)
/* Panels a 12-bit one-row call takes (p12_group_1_NP, below): 2 on AVX2, whose 16 registers
 * four did not fit, 4 with AVX-512's 32. Defined for every VL build: gemv names it. */
#define P12_NP (VL == 16 ? 4 : 2)
#if VL == 16
#define MR 12                 /* rows of x a block: 2 MR accumulators (24 of AVX-512's 32) */
#else
#define MR 6                  /* rows of x a block: 2 MR accumulators (12 of AVX2's 16) */
#endif
#define PANEL_PF_STEP 32      /* inputs between prefetches of the next panel (panel_rows) */
#define PANEL_PREFETCH 4096   /* bytes ahead of the load (T0; 1, 2 and 8 KB or T1: no better) */

/* R rows of x times NP consecutive panels into out[NP][M][PANEL] (rows 0..R-1 of it, out
 * and x at the block's first row), 2 R NP accumulators; on the way, pf_lines 64-byte lines
 * from pf into L2, pf_step of them every PANEL_PF_STEP inputs (see panel_rows). NP = 1 is
 * the general block; at one to four rows a linear is mostly a stream of its weights, and
 * NP = 4 or 2 streams in flight kept the memory busier than one (the row-major kernel
 * streams four rows of W side by side for the same reason). Every output sums its inputs in
 * order, whatever R and NP, so that a row's result does not depend on how many rows came
 * with it. */
#define DEFINE_PANEL_GROUP(R, NP)                                                             \
static inline __attribute__((always_inline)) void                                            \
panel_group_##R##_##NP(const uint16_t *p, int64_t K, const float *x, float *out, int64_t M,  \
                       const char *pf, int64_t pf_lines, int64_t pf_step) {                   \
    vf acc[NP][R][2];                                                                         \
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                      \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) acc[j][i][0] = acc[j][i][1] = VZERO(); \
    const int64_t step = pf_lines > 0 ? PANEL_PF_STEP : K;                                    \
    for (int64_t k0 = 0; k0 < K; k0 += step) {                                                \
        for (int64_t l = 0; l < pf_step && pf_lines > 0; l++, pf_lines--, pf += 64)           \
            _mm_prefetch(pf, _MM_HINT_T1);                                                    \
        const int64_t kend = K - k0 < step ? K : k0 + step;                                   \
        for (int64_t k = k0; k < kend; k++)                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {                            \
                const uint16_t *pj = p + (j * K + k) * PANEL;                                 \
                if (((k * PANEL * 2) & 63) == 0)                                              \
                    _mm_prefetch((const char *)pj + PANEL_PREFETCH, _MM_HINT_T0);              \
                const vword u = VLOAD_WORDS(pj);                                              \
                const vf lo = VEVEN_BF16(u), hi = VODD_BF16(u);                               \
                _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                        \
                    const vf b = VBROADCAST(x + i * K + k);                                   \
                    acc[j][i][0] = VFMA(lo, b, acc[j][i][0]);                                 \
                    acc[j][i][1] = VFMA(hi, b, acc[j][i][1]);                                 \
                }                                                                             \
            }                                                                                 \
    }                                                                                         \
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                      \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                \
            VSTORE_F32(out + (j * M + i) * PANEL, acc[j][i][0]);                              \
            VSTORE_F32(out + (j * M + i) * PANEL + VL, acc[j][i][1]);                         \
        }                                                                                     \
}
DEFINE_PANEL_GROUP(1, 4)
DEFINE_PANEL_GROUP(1, 2)
DEFINE_PANEL_GROUP(2, 2)
DEFINE_PANEL_GROUP(1, 1)
DEFINE_PANEL_GROUP(2, 1)
DEFINE_PANEL_GROUP(3, 1)
DEFINE_PANEL_GROUP(4, 1)
DEFINE_PANEL_GROUP(5, 1)
DEFINE_PANEL_GROUP(6, 1)
#if MR > 6
DEFINE_PANEL_GROUP(7, 1)
DEFINE_PANEL_GROUP(8, 1)
DEFINE_PANEL_GROUP(9, 1)
DEFINE_PANEL_GROUP(10, 1)
DEFINE_PANEL_GROUP(11, 1)
DEFINE_PANEL_GROUP(12, 1)
#endif

/* x (M float32 rows of K) times one panel into out[M][PANEL]: blocks of at most MR rows,
 * as even as they come (32 rows: 6 6 5 5 5 5, not five 6s and a 2). The first block reads
 * the panel from memory and the others from L1/L2, so the memory streamed during the first
 * and idled during the rest, its time added to the arithmetic's (standalone, AVX-512, 3072 x
 * 576 bf16 at 32 rows: 552 us a call with 64 copies of the weights cycled, 392 with one copy
 * in L2). With `next` (the panel this thread takes after this one) each block also fetches
 * its share of that panel into L2, spreading the stream over the whole panel's arithmetic.
 * Measured: with the weights in the L3 (64 copies; this Xeon's 480 MB L3 also holds the
 * default model), the default model's 3072 x 576 and 576 x 1536 at 16-32 rows 5-17% faster
 * on the AVX-512 and AVX2 builds, its 960 x 576 and 576 x 576 up to 5% slower, a 32-request
 * decode step 3-4% faster; with them in memory (1 GiB of copies, benchmarks/cpu_kernels.py
 * --gemv --rows 32) unchanged within the noise. One block streams its own panel. `next` is
 * next_bytes long (the 12-bit panels' are shorter). */
static void panel_rows(const uint16_t *p, int64_t K, const float *x, int64_t M, float *out,
                       const void *next, int64_t next_bytes) {
    const int64_t blocks = (M + MR - 1) / MR;
    const int64_t lines = next_bytes / 64, share = (lines + blocks - 1) / blocks;
    if (blocks == 1 || share == 0) next = NULL;    /* one block: it streams its own panel */
    const int64_t per_step = (share * PANEL_PF_STEP + K - 1) / K;   /* lines a step of k */
    int64_t m0 = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = (M - m0) / (blocks - b);
        const float *xb = x + m0 * K;
        float *ob = out + m0 * PANEL;
        const char *pf = next ? (const char *)next + b * share * 64 : NULL;
        const int64_t n = next ? share : 0;
        switch (r) {
            case 1: panel_group_1_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 2: panel_group_2_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 3: panel_group_3_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 4: panel_group_4_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 5: panel_group_5_1(p, K, xb, ob, M, pf, n, per_step); break;
#if MR > 6
            case 6: panel_group_6_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 7: panel_group_7_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 8: panel_group_8_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 9: panel_group_9_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 10: panel_group_10_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 11: panel_group_11_1(p, K, xb, ob, M, pf, n, per_step); break;
            default: panel_group_12_1(p, K, xb, ob, M, pf, n, per_step); break;
#else
            default: panel_group_6_1(p, K, xb, ob, M, pf, n, per_step); break;
#endif
        }
        m0 += r;
    }
}
#endif

/* --- bfloat16 weights in panels by input pairs, bfloat16 arithmetic (T_BF16_PAIRS) -------
 *
 * Where the CPU multiplies bfloat16 itself (AVX512-BF16), x is bfloat16 and vdpbf16ps adds
 * two products per lane per instruction: twice the float32 panels' arithmetic per
 * instruction, no widening. Its operands are pairs of inputs, so W is held as the int8
 * panels are, [N / PANEL][K / 2][PANEL][2] bfloat16: at input pair k/2 one 64-byte load
 * gives outputs 0..15 of the panel (lane j: output j's weights at inputs k and k + 1), the
 * next outputs 16..31, and a row's pair (x[k], x[k + 1]) is broadcast as one 32-bit word.
 * The row-major vdpbf16ps kernel (`pairs` in gemv) pays horizontal sums per output and row
 * and streams four weight rows K apart: on an AMD EPYC Zen 5 (2 threads) it read a decode
 * step's linears at 21-34 GB/s at one row where the float32 panels read 27-49, and both
 * fell to about 13 GB/s at 32 rows (arithmetic-bound), under oneDNN's bfloat16 GEMM (18).
 * Rows and panels go as the float32 panels' (panel_rows, groups of 4 / 2 panels at one /
 * two to four rows, MR rows a block); each output sums its pairs in order, whatever the
 * block, so a row's result does not depend on the rows that came with it. K even. */
#if defined(VL) && VL == 16 && defined(__AVX512BF16__)
#define BF16_PAIRS 1
#define DEFINE_PAIR_GROUP(R, NP)                                                              \
static inline __attribute__((always_inline)) void                                            \
pair_group_##R##_##NP(const uint16_t *p, int64_t K, const uint16_t *x, float *out, int64_t M, \
                      const char *pf, int64_t pf_lines, int64_t pf_step) {                    \
    __m512 acc[NP][R][2];                                                                     \
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                      \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                  \
            acc[j][i][0] = acc[j][i][1] = _mm512_setzero_ps();                                \
    const int64_t step = pf_lines > 0 ? PANEL_PF_STEP : K;                                    \
    for (int64_t k0 = 0; k0 < K; k0 += step) {                                                \
        for (int64_t l = 0; l < pf_step && pf_lines > 0; l++, pf_lines--, pf += 64)           \
            _mm_prefetch(pf, _MM_HINT_T1);                                                    \
        const int64_t kend = K - k0 < step ? K : k0 + step;                                   \
        for (int64_t k = k0; k < kend; k += 2)                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {                            \
                const uint16_t *pj = p + (j * K + k) * PANEL;                                 \
                _mm_prefetch((const char *)pj + PANEL_PREFETCH, _MM_HINT_T0);                 \
                _mm_prefetch((const char *)pj + PANEL_PREFETCH + 64, _MM_HINT_T0);            \
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pj);                        \
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pj + 2 * VL);               \
                _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                        \
                    int32_t pair;                                                             \
                    memcpy(&pair, x + i * K + k, sizeof pair);                                \
                    const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);                     \
                    acc[j][i][0] = _mm512_dpbf16_ps(acc[j][i][0], w0, b);                     \
                    acc[j][i][1] = _mm512_dpbf16_ps(acc[j][i][1], w1, b);                     \
                }                                                                             \
            }                                                                                 \
    }                                                                                         \
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                      \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                \
            _mm512_storeu_ps(out + (j * M + i) * PANEL, acc[j][i][0]);                        \
            _mm512_storeu_ps(out + (j * M + i) * PANEL + VL, acc[j][i][1]);                   \
        }                                                                                     \
}
DEFINE_PAIR_GROUP(1, 4)
DEFINE_PAIR_GROUP(1, 2)
DEFINE_PAIR_GROUP(2, 2)
DEFINE_PAIR_GROUP(1, 1)
DEFINE_PAIR_GROUP(2, 1)
DEFINE_PAIR_GROUP(3, 1)
DEFINE_PAIR_GROUP(4, 1)
DEFINE_PAIR_GROUP(5, 1)
DEFINE_PAIR_GROUP(6, 1)
DEFINE_PAIR_GROUP(7, 1)
DEFINE_PAIR_GROUP(8, 1)
DEFINE_PAIR_GROUP(9, 1)
DEFINE_PAIR_GROUP(10, 1)
DEFINE_PAIR_GROUP(11, 1)
DEFINE_PAIR_GROUP(12, 1)

/* x (M bfloat16 rows of K) times one pair panel into out[M][PANEL], as panel_rows. */
static void pair_rows(const uint16_t *p, int64_t K, const uint16_t *x, int64_t M, float *out,
                      const void *next, int64_t next_bytes) {
    const int64_t blocks = (M + MR - 1) / MR;
    const int64_t lines = next_bytes / 64, share = (lines + blocks - 1) / blocks;
    if (blocks == 1 || share == 0) next = NULL;
    const int64_t per_step = (share * PANEL_PF_STEP + K - 1) / K;
    int64_t m0 = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = (M - m0) / (blocks - b);
        const uint16_t *xb = x + m0 * K;
        float *ob = out + m0 * PANEL;
        const char *pf = next ? (const char *)next + b * share * 64 : NULL;
        const int64_t n = next ? share : 0;
        switch (r) {
            case 1: pair_group_1_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 2: pair_group_2_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 3: pair_group_3_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 4: pair_group_4_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 5: pair_group_5_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 6: pair_group_6_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 7: pair_group_7_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 8: pair_group_8_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 9: pair_group_9_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 10: pair_group_10_1(p, K, xb, ob, M, pf, n, per_step); break;
            case 11: pair_group_11_1(p, K, xb, ob, M, pf, n, per_step); break;
            default: pair_group_12_1(p, K, xb, ob, M, pf, n, per_step); break;
        }
        m0 += r;
    }
}
#endif

#ifdef VL
/* W [N, K] row-major into panels of PANEL outputs by input pairs, [N / PANEL][K / 2][PANEL][2]
 * (N % PANEL == 0, K even): the int8 panels' layout and the bfloat16 pair panels'. */
#define DEFINE_PACK_BY_PAIRS(NAME, T)                                                         \
static __attribute__((unused)) void NAME(const T *w, int64_t N, int64_t K, T *out) {         \
    for (int64_t p = 0; p < N / PANEL; p++)                                                   \
        for (int64_t k = 0; k < K; k += 2)                                                    \
            for (int64_t j = 0; j < PANEL; j++) {                                             \
                T *o = out + (p * K + k) * PANEL + 2 * j;                                     \
                o[0] = w[(p * PANEL + j) * K + k];                                            \
                o[1] = w[(p * PANEL + j) * K + k + 1];                                        \
            }                                                                                 \
}
DEFINE_PACK_BY_PAIRS(pack_by_pairs_u16, uint16_t)
DEFINE_PACK_BY_PAIRS(pack_by_pairs_i8, int8_t)
#endif

/* 1 where this build has the pair panels (AVX512-BF16), else 0. */
int gemv_pairs_available(void) {
#ifdef BF16_PAIRS
    return 1;
#else
    return 0;
#endif
}

/* W [N, K] bfloat16 row-major into pair panels (above). Returns 0, or 2 where this build has
 * no such path or N % PANEL or K % 2 is not 0. */
int pack_pairs(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
#ifdef BF16_PAIRS
    if (N % PANEL || K % 2) return 2;
    pack_by_pairs_u16(w, N, K, out);
    return 0;
#else
    (void)w, (void)N, (void)K, (void)out;
    return 2;
#endif
}

/* Panels shared out among a parallel region's threads: each starts on its own contiguous
 * share, as a static split would give it, and claims `group` panels at a time from its
 * front; a thread whose share is done takes groups from the back of the others' (work
 * stealing). Each panel is still computed whole by one thread, so the results do not depend
 * on who computes it. Why: a decode step is a few hundred parallel regions, and a thread
 * that another process preempts (the server's frontend, EngineCore and the client share
 * the cores with the worker on a small machine) held every other thread at the region's
 * end for as long; one thread alone streams a one-row product at ~85% of two threads' speed
 * (AMD EPYC Zen 3), so the others taking over its share lose far less. A share is
 * front | back << 32 in one 64-bit word (compare-and-swap), a cache line each. */
typedef struct { uint64_t word; char pad[56]; } PanelShare;

static __attribute__((unused)) PanelShare *shares_new(int64_t panels, int parallel, int64_t *threads) {
    const int64_t t = parallel && !omp_in_parallel() ? omp_get_max_threads() : 1;
    PanelShare *sh = aligned_alloc(64, (size_t)t * sizeof(PanelShare));
    if (sh == NULL) return NULL;
    for (int64_t i = 0; i < t; i++)
        sh[i].word = (uint64_t)(panels * i / t) | (uint64_t)(panels * (i + 1) / t) << 32;
    *threads = t;
    return sh;
}

/* The next panels [*p0, *p0 + *np) for thread `me`, and *end: how far on the panels are
 * likely its own (its share's back, or the claim's end when taken from another's); 0 when
 * none are left anywhere. */
static __attribute__((unused)) int shares_claim(PanelShare *sh, int64_t threads, int64_t me,
                                                int64_t group, int64_t *p0, int64_t *np,
                                                int64_t *end) {
    for (int64_t i = 0; i < threads; i++) {
        const int64_t t = (me + i) % threads;
        uint64_t word = __atomic_load_n(&sh[t].word, __ATOMIC_RELAXED);
        for (;;) {
            const int64_t front = (int64_t)(word & 0xFFFFFFFFu), back = (int64_t)(word >> 32);
            if (front >= back) break;
            const int64_t n = back - front < group ? back - front : group;
            const int64_t start = i == 0 ? front : back - n;
            const uint64_t next = i == 0 ? (uint64_t)(front + n) | (uint64_t)back << 32
                                         : (uint64_t)front | (uint64_t)(back - n) << 32;
            if (__atomic_compare_exchange_n(&sh[t].word, &word, next, 0, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED)) {
                *p0 = start, *np = n, *end = i == 0 ? back : start + n;
                return 1;
            }
        }
    }
    return 0;
}

/* Outputs a panel holds: 2 VL (16 on AVX2, 32 on AVX-512), or 0 where this build has no
 * vector path (then nothing is packed). */
int gemv_panel_width(void) {
#ifdef VL
    return PANEL;
#else
    return 0;
#endif
}

/* W [N, K] bfloat16 row-major into panels (see above); N % gemv_panel_width() == 0. */
void pack_panels(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
#ifdef VL
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t k = 0; k < K; k++) {
            uint16_t *o = out + (p * K + k) * PANEL;
            for (int64_t j = 0; j < VL; j++) {
                o[2 * j] = w[(p * PANEL + j) * K + k];
                o[2 * j + 1] = w[(p * PANEL + VL + j) * K + k];
            }
        }
#else
    (void)w, (void)N, (void)K, (void)out;
#endif
}

/* --- bfloat16 panels in 12 bits a weight, lossless (T_BF16_PANELS12) ----------------------
 *
 * A bfloat16 weight is a high byte (sign and the exponent's top 7 bits) and a low byte (the
 * exponent's last bit and the 7-bit mantissa). Within a few hundred weights of one matrix
 * the high byte takes few values: in the default model no group of 1024 (a panel's PANEL
 * outputs x P12_G inputs) holds more than 16 of them but one. So each group keeps a table of
 * its (at most) 16 high bytes, and each weight its low byte and a 4-bit index into that
 * table: 12 bits a weight and 16 bytes a group, 76% of the bfloat16 panels' bytes, with every
 * weight's bits kept. A group with more than 16 high bytes is kept whole (raw bfloat16 words,
 * after the groups). A one-row decode step reads its weights at the memory's speed and does
 * little arithmetic between the bytes: fewer bytes are a shorter step.
 *
 * Decoding a pair of inputs (2 PANEL weights) is a handful of byte shuffles: the pair's
 * nibbles loaded into both halves of a vector, the upper half's shifted down 4 bits, masked:
 * 2 PANEL indices; vpshufb looks each up in the group's table (in every 128-bit lane): the
 * high bytes; vpunpcklbw / vpunpckhbw interleave them with the low bytes into the two inputs'
 * bfloat16 panel words. The bytes are stored in the order that makes those two unpacks give
 * input k's PANEL words and input k+1's (p12_position). One row of x multiplies them as they
 * are decoded, four panels side by side (p12_group_1_4); two to P12_ROWS rows (4 with
 * AVX-512, 3 on AVX2) likewise, one panel at a time, each pair decoded once for all the rows
 * (p12_group_rows); more rows decode each panel into a bfloat16 panel in L1 and multiply it
 * there by the bfloat16 panels' code. Each way every output sums its inputs in order, so
 * the results are the bfloat16 panels' bit for bit. One row: the default model's decode
 * linears 1.2-1.36x faster than from the bfloat16 panels (AVX2 and AVX-512 builds, in C, 2
 * MB pages); the register path at 2-4 rows: P12_ROWS' comment; the L1 path 0.73-0.95x, where
 * the decoding costs more than the bytes save (GemvLinear reads the panels there).
 *
 * Layout of the packed bytes (pack_panels12): an int64 count E of whole groups, E int64
 * group numbers (panel * groups a panel + group, ascending), padding to 64 bytes; then each
 * panel's groups, each [16 table bytes][gk PANEL low bytes][gk PANEL / 2 nibble bytes] (gk:
 * the group's inputs, P12_G but for a panel's last group); then the E whole groups, P12_G
 * PANEL bfloat16 words each (a panel's layout, [input][PANEL]; the 12-bit pair panels': the
 * pair panels' [input pair][PANEL][2]). K must be even. */
#if defined(VL) && (VL == 8 || defined(__AVX512BW__))
#define P12 1
#define P12_G (1024 / PANEL)             /* inputs a group: 64 on AVX2, 32 on AVX-512 */
#if VL == 16
#define P12_NIBS(p) _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p)))
#define P12_HALVES(t) _mm512_mask_blend_epi64(0xF0, t, _mm512_srli_epi16(t, 4))
#define P12_LOW4(t) _mm512_and_si512(t, _mm512_set1_epi8(0x0F))
#define P12_TABLE(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define P12_LOOKUP(tab, c) _mm512_shuffle_epi8(tab, c)
#define P12_UNPACK_LO(a, b) _mm512_unpacklo_epi8(a, b)
#define P12_UNPACK_HI(a, b) _mm512_unpackhi_epi8(a, b)
#define P12_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#else
#define P12_NIBS(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define P12_HALVES(t) _mm256_blend_epi32(t, _mm256_srli_epi16(t, 4), 0xF0)
#define P12_LOW4(t) _mm256_and_si256(t, _mm256_set1_epi8(0x0F))
#define P12_TABLE(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define P12_LOOKUP(tab, c) _mm256_shuffle_epi8(tab, c)
#define P12_UNPACK_LO(a, b) _mm256_unpacklo_epi8(a, b)
#define P12_UNPACK_HI(a, b) _mm256_unpackhi_epi8(a, b)
#define P12_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#endif

static inline int64_t p12_group_bytes(int64_t gk) { return 16 + gk * PANEL * 3 / 2; }
static inline int64_t p12_panel_bytes(int64_t K) {
    return (K / P12_G) * p12_group_bytes(P12_G) + (K % P12_G ? p12_group_bytes(K % P12_G) : 0);
}
static inline int64_t p12_head_bytes(int64_t E) { return (8 + 8 * E + 63) & ~(int64_t)63; }

/* Byte position p of a pair's 2 PANEL: the input (0: k, 1: k + 1) and the panel word it
 * holds. vpunpck{l,h}bw take bytes 0-7 / 8-15 of each 128-bit lane: so lane l's first 8
 * bytes are input k's words 8l..8l+7, its last 8 input k+1's. */
static inline void p12_position(int64_t p, int64_t *input, int64_t *word) {
    *input = (p % 16) / 8;
    *word = (p / 16) * 8 + p % 8;
}

/* Panel word i (of PANEL) at input k of panel q, from row-major W [N, K]. */
static inline uint16_t p12_word(const uint16_t *w, int64_t K, int64_t q, int64_t k, int64_t i) {
    return w[(q * PANEL + (i % 2 ? VL + i / 2 : i / 2)) * K + k];
}

/* The 12-bit pair panels (T_BF16_PAIRS12) decode a pair of inputs into the pair panels' two
 * vectors instead: vector v (outputs v VL .. v VL + VL - 1), word i: output v VL + i / 2 at
 * input k + i % 2 (k even), so u0 and u1 are the two 64-byte loads of pair_group. */
static inline uint16_t p12_pair_word(const uint16_t *w, int64_t K, int64_t q, int64_t k,
                                     int64_t v, int64_t i) {
    return w[(q * PANEL + v * VL + i / 2) * K + k + i % 2];
}

/* The group's table (its distinct high bytes, padded with the first) and each high byte's
 * index in it (code[256]), or 0 when it has more than 16 of them. */
static int p12_table(const uint16_t *w, int64_t K, int64_t q, int64_t k0, int64_t gk,
                     uint8_t table[16], uint8_t code[256]) {
    uint8_t seen[256] = {0};
    int n = 0;
    for (int64_t i = 0; i < PANEL; i++) {
        const uint16_t *row = w + (q * PANEL + (i % 2 ? VL + i / 2 : i / 2)) * K + k0;
        for (int64_t k = 0; k < gk; k++) seen[row[k] >> 8] = 1;
    }
    for (int h = 0; h < 256; h++)
        if (seen[h]) {
            if (n == 16) return 0;
            code[h] = (uint8_t)n;
            table[n++] = (uint8_t)h;
        }
    for (int j = n; j < 16; j++) table[j] = table[0];
    return 1;
}

static int64_t p12_first_whole(const uint8_t *packed, int64_t number);

/* Bytes of W [N, K] bfloat16 packed (N % PANEL == 0, K even), or 0 where it cannot be. */
static int64_t p12_bytes(const uint16_t *w, int64_t N, int64_t K) {
    if (N % PANEL || K % 2 || K <= 0) return 0;
    const int64_t groups = (K + P12_G - 1) / P12_G;
    int64_t E = 0;
    #pragma omp parallel for reduction(+ : E) schedule(static)
    for (int64_t q = 0; q < N / PANEL; q++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * P12_G, gk = K - k0 < P12_G ? K - k0 : P12_G;
            uint8_t table[16], code[256];
            E += !p12_table(w, K, q, k0, gk, table, code);
        }
    return p12_head_bytes(E) + N / PANEL * p12_panel_bytes(K) + E * P12_G * PANEL * 2;
}

/* W [N, K] bfloat16 into out (p12_bytes(w, N, K) bytes, zeroed by the caller), the words of
 * the float32 panels, or with `pairs` the pair panels' (a whole group then in their layout,
 * [P12_G / 2][PANEL][2]: the same addresses for u0 and u1). */
static void p12_pack(const uint16_t *w, int64_t N, int64_t K, uint8_t *out, int pairs) {
    const int64_t groups = (K + P12_G - 1) / P12_G;
    int64_t E = 0;
    for (int64_t q = 0; q < N / PANEL; q++)        /* first the whole groups' numbers */
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * P12_G, gk = K - k0 < P12_G ? K - k0 : P12_G;
            uint8_t table[16], code[256];
            if (!p12_table(w, K, q, k0, gk, table, code)) {
                const int64_t number = q * groups + g;
                memcpy(out + 8 + 8 * E++, &number, 8);
            }
        }
    memcpy(out, &E, 8);
    uint16_t *whole = (uint16_t *)(out + p12_head_bytes(E) + N / PANEL * p12_panel_bytes(K));
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < N / PANEL; q++) {
        uint8_t *panel = out + p12_head_bytes(E) + q * p12_panel_bytes(K), table[16], code[256];
        int64_t e = p12_first_whole(out, q * groups);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * P12_G, gk = K - k0 < P12_G ? K - k0 : P12_G;
            uint8_t *grp = panel + g * p12_group_bytes(P12_G);
            if (!p12_table(w, K, q, k0, gk, table, code)) {
                for (int64_t k = 0; k < gk; k++)
                    for (int64_t i = 0; i < PANEL; i++)
                        whole[(e * P12_G + k) * PANEL + i]
                            = pairs ? p12_pair_word(w, K, q, k0 + k - k % 2, k % 2, i)
                                    : p12_word(w, K, q, k0 + k, i);
                e++;
                continue;
            }
            memcpy(grp, table, 16);
            uint8_t *lows = grp + 16, *nibs = lows + gk * PANEL;
            for (int64_t pair = 0; pair < gk / 2; pair++)
                for (int64_t p = 0; p < 2 * PANEL; p++) {
                    int64_t input, word;
                    p12_position(p, &input, &word);
                    const uint16_t v = pairs ? p12_pair_word(w, K, q, k0 + 2 * pair, input, word)
                                             : p12_word(w, K, q, k0 + 2 * pair + input, word);
                    const uint8_t c = code[v >> 8];
                    lows[pair * 2 * PANEL + p] = (uint8_t)v;
                    nibs[pair * PANEL + p % PANEL] |= (uint8_t)(p < PANEL ? c : c << 4);
                }
        }
    }
}

/* Panel q of a packed W into a bfloat16 panel [K][PANEL] (`dst`), prefetching the stream
 * two groups ahead (T0) up to `end`. e: the first whole group's index in the head's list at
 * or after this panel's (advanced past this panel's). */
static void p12_decode(const uint8_t *packed, int64_t N, int64_t K, int64_t q, int64_t *e,
                       uint16_t *dst, const uint8_t *end) {
    int64_t E;
    memcpy(&E, packed, 8);
    const int64_t groups = (K + P12_G - 1) / P12_G;
    const int64_t *numbers = (const int64_t *)(packed + 8);
    const uint8_t *panel = packed + p12_head_bytes(E) + q * p12_panel_bytes(K);
    const uint16_t *whole = (const uint16_t *)(packed + p12_head_bytes(E)
                                               + N / PANEL * p12_panel_bytes(K));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * P12_G, gk = K - k0 < P12_G ? K - k0 : P12_G;
        const uint8_t *grp = panel + g * p12_group_bytes(P12_G);
        for (int64_t l = 0; l < p12_group_bytes(P12_G); l += 64)   /* the group 2 ahead */
            if (grp + 2 * p12_group_bytes(P12_G) + l < end)
                _mm_prefetch((const char *)grp + 2 * p12_group_bytes(P12_G) + l, _MM_HINT_T0);
        if (*e < E && numbers[*e] == q * groups + g) {
            memcpy(dst + k0 * PANEL, whole + *e * P12_G * PANEL, (size_t)(gk * PANEL * 2));
            (*e)++;
            continue;
        }
        const vword table = P12_TABLE(grp);
        const uint8_t *lows = grp + 16, *nibs = lows + gk * PANEL;
        for (int64_t pair = 0; pair < gk / 2; pair++) {
            const vword low = VLOAD_WORDS(lows + pair * 2 * PANEL);
            const vword high = P12_LOOKUP(table, P12_LOW4(P12_HALVES(P12_NIBS(nibs + pair * PANEL))));
            P12_STORE(dst + (k0 + 2 * pair) * PANEL, P12_UNPACK_LO(low, high));
            P12_STORE(dst + (k0 + 2 * pair + 1) * PANEL, P12_UNPACK_HI(low, high));
        }
    }
}

/* Panel q's packed bytes. */
static inline const uint8_t *p12_panel(const void *packed, int64_t N, int64_t K, int64_t q) {
    int64_t E;
    memcpy(&E, packed, 8);
    (void)N;
    return (const uint8_t *)packed + p12_head_bytes(E) + q * p12_panel_bytes(K);
}

/* One row of x times NP consecutive 12-bit panels (q0..) into out[NP][PANEL], decoding in
 * registers: each pair of inputs of each panel is decoded and multiplied at once, NP panels
 * side by side (as panel_group_1_4 streams four). The sums run in input order, as the
 * bfloat16 panels' do, so the results are theirs bit for bit. Each panel's stream is
 * prefetched P12_AHEAD groups ahead, a line or a few each pair of inputs (one burst of a
 * group's 25 lines at its start ran 1.2x slower); past a panel's end, the group of the panel
 * NP on (the next call's), while all NP of those are below `end` (else each panel fetches
 * its own group again). One or two groups ahead were alike, three or four and T1 slower.
 * A group with no panel kept whole (nearly all) runs a loop without branches; P12_NP panels
 * at a time (gemv's claims at one row): on AVX2, four panels' 8 sums, 4 tables, 2 x values
 * and 2 masks took all 16 registers, and GCC spilled a decoded vector to the stack and read
 * it back every pair; two panels fit. In-engine, one request's decode layers (AMD EPYC Zen
 * 3, paired steps): with four panels and the branches inside the loop the 12-bit copy was
 * no faster than the bfloat16 panels (11.7 ms each); now 1.5-2.2 ms faster (8.7-9.8 ms),
 * two panels 1.3-1.5 ms faster than four, 0.7-0.8 faster than one. */
#define P12_AHEAD 2
#define P12_HINT _MM_HINT_T0
/* A pair of inputs' decoded panel words (u0: input k, u1: k + 1) times x[k], x[k + 1] into a
 * panel's two sums, in the bfloat16 panels' order. */
#define P12_FMA_PAIR(acc, u0, u1, b0, b1)                                                     \
    do {                                                                                      \
        (acc)[0] = VFMA(VEVEN_BF16(u0), b0, (acc)[0]);                                        \
        (acc)[1] = VFMA(VODD_BF16(u0), b0, (acc)[1]);                                         \
        (acc)[0] = VFMA(VEVEN_BF16(u1), b1, (acc)[0]);                                        \
        (acc)[1] = VFMA(VODD_BF16(u1), b1, (acc)[1]);                                         \
    } while (0)
#define P12_XDECL_F32(R) vf b0[R], b1[R]
#define P12_X_F32(x, k, i) (b0[i] = VBROADCAST((x) + (k)), b1[i] = VBROADCAST((x) + (k) + 1))
#define P12_FMA_F32(acc, u0, u1, i) P12_FMA_PAIR(acc, u0, u1, b0[i], b1[i])
/* The 12-bit pair panels (p12_pair_word): x's pair broadcast as one word, a vdpbf16ps each
 * vector, in pair_group's order, so the pair panels' results bit for bit. */
#define P12_XDECL_PAIRS(R) __m512bh b0[R]
#define P12_X_PAIRS(x, k, i)                                                                  \
    do {                                                                                      \
        int32_t xpair_;                                                                       \
        memcpy(&xpair_, (x) + (k), sizeof xpair_);                                            \
        b0[i] = (__m512bh)_mm512_set1_epi32(xpair_);                                          \
    } while (0)
#define P12_FMA_PAIRS(acc, u0, u1, i)                                                         \
    do {                                                                                      \
        (acc)[0] = _mm512_dpbf16_ps((acc)[0], (__m512bh)(u0), b0[i]);                         \
        (acc)[1] = _mm512_dpbf16_ps((acc)[1], (__m512bh)(u1), b0[i]);                         \
    } while (0)
/* NAME_R_NP: R rows of x (XT, K apart) times NP panels into out[NP][M][PANEL] (rows 0..R-1
 * of it, out at the block's first row); XDECL declares the x operands of a pair of inputs,
 * XLOAD sets row i's, FMA multiplies a decoded pair into row i's two sums of a panel. Each
 * pair is decoded once for the R rows. */
#define DEFINE_P12_GROUP(NAME, R, NP, XT, XDECL, XLOAD, FMA)                                  \
static void NAME##_##R##_##NP(const void *packed, int64_t N, int64_t K, int64_t q0,           \
                              int64_t end, const XT *x, float *out, int64_t M) {              \
    int64_t E;                                                                                \
    memcpy(&E, packed, 8);                                                                    \
    const int64_t groups = (K + P12_G - 1) / P12_G, gb = p12_group_bytes(P12_G);              \
    const int64_t *numbers = (const int64_t *)((const uint8_t *)packed + 8);                  \
    const uint16_t *whole = (const uint16_t *)(p12_panel(packed, N, K, 0)                     \
                                               + N / PANEL * p12_panel_bytes(K));             \
    int64_t e[NP];                                                                            \
    vf acc[NP][R][2];                                                                         \
    for (int j = 0; j < NP; j++) {                                                            \
        e[j] = E ? p12_first_whole(packed, (q0 + j) * groups) : 0;                             \
        for (int i = 0; i < R; i++) acc[j][i][0] = acc[j][i][1] = VZERO();                   \
    }                                                                                         \
    for (int64_t g = 0; g < groups; g++) {                                                    \
        const int64_t k0 = g * P12_G, gk = K - k0 < P12_G ? K - k0 : P12_G;                   \
        const uint8_t *grp[NP];                                                               \
        const uint16_t *raw[NP];                                                              \
        int any_raw = 0;                                                                      \
        for (int j = 0; j < NP; j++) {                                                        \
            grp[j] = p12_panel(packed, N, K, q0 + j) + g * gb;                                \
            raw[j] = NULL;                                                                    \
            if (e[j] < E && numbers[e[j]] == (q0 + j) * groups + g)                           \
                raw[j] = whole + e[j]++ * P12_G * PANEL;                                      \
            any_raw |= raw[j] != NULL;                                                        \
        }                                                                                     \
        /* The group fetched (above). The NP panels lie pb apart, so one pointer serves    \
         * them all: with a pointer a panel for its lows, nibbles and fetch, four panels'   \
         * pointers did not fit the registers, and GCC reloaded them from the stack every   \
         * pair (the fetch in an inner loop, too). Each pair of inputs fetches its 3 PANEL  \
         * bytes' share of the group fetched, a line every 48 bytes, for as many pairs as   \
         * both groups have (a panel's last may be short). */                                \
        const int64_t pb = p12_panel_bytes(K);                                                \
        const int64_t t = (g + P12_AHEAD) % groups;                                           \
        const int64_t tq = q0 + (g + P12_AHEAD < groups ? 0 : NP);                            \
        const int any_self = tq + NP - 1 >= end;                                              \
        const int64_t gt = K - t * P12_G < P12_G ? K - t * P12_G : P12_G;                     \
        const char *pfb = any_self ? (const char *)grp[0]                                     \
                                   : (const char *)p12_panel(packed, N, K, tq) + t * gb;      \
        const int64_t fetch_pairs = any_self ? gk / 2 : gt / 2;                               \
        if (!any_raw) {              /* the usual case: every panel's group encoded */        \
            vword table[NP];                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                              \
                table[j] = P12_TABLE(grp[0] + j * pb);                                        \
            const uint8_t *lows = grp[0] + 16, *nibs = lows + gk * PANEL;                     \
            for (int64_t pair = 0; pair < gk / 2; pair++) {                                   \
                XDECL(R);                                                                     \
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)                           \
                    XLOAD(x + i * K, k0 + 2 * pair, i);                                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {                        \
                    if (pair < fetch_pairs)                                                   \
                        _Pragma("GCC unroll 2") for (int o = 0; o < 3 * PANEL; o += 48)       \
                            _mm_prefetch(pfb + j * pb + pair * 3 * PANEL + o, P12_HINT);      \
                    const vword low = VLOAD_WORDS(lows + j * pb + pair * 2 * PANEL);          \
                    const vword high = P12_LOOKUP(table[j], P12_LOW4(P12_HALVES(              \
                        P12_NIBS(nibs + j * pb + pair * PANEL))));                            \
                    const vword u0 = P12_UNPACK_LO(low, high), u1 = P12_UNPACK_HI(low, high); \
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)                       \
                        FMA(acc[j][i], u0, u1, i);                                            \
                }                                                                             \
            }                                                                                 \
            continue;                                                                         \
        }                                                                                     \
        for (int64_t pair = 0; pair < gk / 2; pair++) {      /* some group kept whole */      \
            XDECL(R);                                                                         \
            for (int i = 0; i < R; i++) XLOAD(x + i * K, k0 + 2 * pair, i);                   \
            for (int j = 0; j < NP; j++) {                                                    \
                if (pair < fetch_pairs)                                                       \
                    for (int o = 0; o < 3 * PANEL; o += 48)                                   \
                        _mm_prefetch(pfb + j * pb + pair * 3 * PANEL + o, P12_HINT);          \
                vword u0, u1;                                                                 \
                if (raw[j] == NULL) {                                                         \
                    const uint8_t *lows = grp[j] + 16;                                        \
                    const vword low = VLOAD_WORDS(lows + pair * 2 * PANEL);                   \
                    const vword high = P12_LOOKUP(P12_TABLE(grp[j]), P12_LOW4(P12_HALVES(     \
                        P12_NIBS(lows + gk * PANEL + pair * PANEL))));                        \
                    u0 = P12_UNPACK_LO(low, high);                                            \
                    u1 = P12_UNPACK_HI(low, high);                                            \
                } else {                                                                      \
                    u0 = VLOAD_WORDS(raw[j] + 2 * pair * PANEL);                              \
                    u1 = VLOAD_WORDS(raw[j] + (2 * pair + 1) * PANEL);                        \
                }                                                                             \
                for (int i = 0; i < R; i++) FMA(acc[j][i], u0, u1, i);                        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int j = 0; j < NP; j++)                                                              \
        for (int i = 0; i < R; i++) {                                                         \
            VSTORE_F32(out + (j * M + i) * PANEL, acc[j][i][0]);                              \
            VSTORE_F32(out + (j * M + i) * PANEL + VL, acc[j][i][1]);                         \
        }                                                                                     \
}
#if VL == 16                           /* P12_NP panels a call, and a share's last alone */
DEFINE_P12_GROUP(p12_group, 1, 4, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
#define P12_GROUP_NP p12_group_1_4
#else
DEFINE_P12_GROUP(p12_group, 1, 2, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
#define P12_GROUP_NP p12_group_1_2
#endif
DEFINE_P12_GROUP(p12_group, 1, 1, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
/* Two to P12_ROWS rows: one panel a call, each pair of inputs decoded once in registers and
 * multiplied into every row's sums (in input order: still the bfloat16 panels' bits). A few
 * rows are still a read of the weights, so the 76% of the bytes pays there too. The default
 * model's four decode linears from memory (benchmarks/gemv_stream.py --layout panels12,
 * AMD EPYC Zen 5, 2 threads, two alternating rounds), against the bfloat16 panels: AVX-512
 * (no BF16) 0.71-0.76x at 2 rows, 0.70-0.90x at 3, 0.73x at 4; AVX2 0.99-1.03x at 2 (its
 * float32 FMAs, not the memory, bound it on a CPU that reads ~55-75 GB/s on two cores),
 * 0.68-0.80x at 3, but 1.18-1.27x at 4, where 8 sums, 8 broadcasts and the decoding spill
 * AVX2's 16 registers: so 3 rows there. (Decoding each panel into an L1 buffer first, the
 * path past P12_ROWS, took 1.3-1.6x the bfloat16 panels' time.) */
#define P12_ROWS (VL == 16 ? 4 : 3)
DEFINE_P12_GROUP(p12_group, 2, 1, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
DEFINE_P12_GROUP(p12_group, 3, 1, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
#if VL == 16
DEFINE_P12_GROUP(p12_group, 4, 1, float, P12_XDECL_F32, P12_X_F32, P12_FMA_F32)
#endif
/* M (2..P12_ROWS: gemv sends no other) rows of x times one 12-bit panel from q0. */
static void p12_group_rows(const void *packed, int64_t N, int64_t K, int64_t q0, int64_t end,
                           const float *x, float *out, int64_t M) {
    switch (M) {
        case 2: p12_group_2_1(packed, N, K, q0, end, x, out, M); return;
        case 3: p12_group_3_1(packed, N, K, q0, end, x, out, M); return;
#if VL == 16
        case 4: p12_group_4_1(packed, N, K, q0, end, x, out, M); return;
#endif
        default: return;
    }
}
#ifdef BF16_PAIRS
/* The 12-bit pair panels take up to P12_PAIR_ROWS rows: at one row four panels a call, at
 * two to four two (as the pair panels), each pair of inputs decoded once for all the rows.
 * At a few rows a step is still a read of the weights, so 76% of the bytes pays there too:
 * the default model's four decode linears from memory (AMD EPYC Zen 5, 2 threads, three runs)
 * took 0.84-0.91x the pair panels' time at 2 rows, 0.75-0.79x at 3 and 4; at 5 to 8 (rows
 * in two blocks, each decoding the panels again) 1.09-1.32x, so those read the pair panels. */
#define P12_PAIRS 1
#define P12_PAIR_ROWS 4
#define DEFINE_P12_PAIRS(R, NP)                                                               \
    DEFINE_P12_GROUP(p12_pairs, R, NP, uint16_t, P12_XDECL_PAIRS, P12_X_PAIRS, P12_FMA_PAIRS)
DEFINE_P12_PAIRS(1, 4)
DEFINE_P12_PAIRS(1, 2)
DEFINE_P12_PAIRS(2, 2)
DEFINE_P12_PAIRS(3, 2)
DEFINE_P12_PAIRS(4, 2)
DEFINE_P12_PAIRS(1, 1)
DEFINE_P12_PAIRS(2, 1)
DEFINE_P12_PAIRS(3, 1)
DEFINE_P12_PAIRS(4, 1)

/* All M (1..P12_PAIR_ROWS) rows of x times NP (1 or 2) 12-bit pair panels from q0, as
 * p12_pairs_M_NP. */
static void p12_pairs_rows(const void *packed, int64_t N, int64_t K, int64_t q0, int64_t end,
                           const uint16_t *x, float *out, int64_t M, int64_t NP) {
    if (NP == 2)
        switch (M) {
            case 1: p12_pairs_1_2(packed, N, K, q0, end, x, out, M); return;
            case 2: p12_pairs_2_2(packed, N, K, q0, end, x, out, M); return;
            case 3: p12_pairs_3_2(packed, N, K, q0, end, x, out, M); return;
            default: p12_pairs_4_2(packed, N, K, q0, end, x, out, M); return;
        }
    switch (M) {
        case 1: p12_pairs_1_1(packed, N, K, q0, end, x, out, M); return;
        case 2: p12_pairs_2_1(packed, N, K, q0, end, x, out, M); return;
        case 3: p12_pairs_3_1(packed, N, K, q0, end, x, out, M); return;
        default: p12_pairs_4_1(packed, N, K, q0, end, x, out, M); return;
    }
}
#endif

/* The index in the head's list of the first whole group numbered `number` or after. */
static int64_t p12_first_whole(const uint8_t *packed, int64_t number) {
    int64_t E, lo = 0, hi;
    memcpy(&E, packed, 8);
    const int64_t *numbers = (const int64_t *)(packed + 8);
    for (hi = E; lo < hi;) {
        const int64_t mid = (lo + hi) / 2;
        if (numbers[mid] < number) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
#endif

/* Bytes of W [N, K] (bfloat16, row-major) in 12-bit panels, or 0 where this build or the
 * shape cannot (N % PANEL, K odd). */
int64_t panels12_bytes(const uint16_t *w, int64_t N, int64_t K) {
#ifdef P12
    return p12_bytes(w, N, K);
#else
    (void)w, (void)N, (void)K;
    return 0;
#endif
}

/* W into out: panels12_bytes(w, N, K) bytes, zeroed. */
void pack_panels12(const uint16_t *w, int64_t N, int64_t K, uint8_t *out) {
#ifdef P12
    p12_pack(w, N, K, out, 0);
#else
    (void)w, (void)N, (void)K, (void)out;
#endif
}

/* Bytes of W in 12-bit pair panels (T_BF16_PAIRS12: the same groups and tables, each pair
 * decoded into the pair panels' words), or 0 where this build (no AVX512-BF16) or the shape
 * cannot. */
int64_t pairs12_bytes(const uint16_t *w, int64_t N, int64_t K) {
#ifdef P12_PAIRS
    return p12_bytes(w, N, K);
#else
    (void)w, (void)N, (void)K;
    return 0;
#endif
}

/* W into out: pairs12_bytes(w, N, K) bytes, zeroed. */
void pack_pairs12(const uint16_t *w, int64_t N, int64_t K, uint8_t *out) {
#ifdef P12_PAIRS
    p12_pack(w, N, K, out, 1);
#else
    (void)w, (void)N, (void)K, (void)out;
#endif
}

/* --- int8 weights in panels (T_I8_PANELS) --------------------------------------------------
 *
 * The row-major int8 kernel streams four rows of W side by side, each 16 or 32 bytes a step
 * (a row is K bytes, so the four are K apart): the hardware prefetcher loses such streams,
 * and with its software prefetch a one-row decode step's int8 weights were read at ~33 GB/s
 * from this Xeon's L3 where the bf16 panels read theirs at 43-47. Here W is held in panels of
 * PANEL outputs by input pairs, [N / PANEL][K / 2][PANEL][2] int8, so a panel is one
 * contiguous run: each step widens 2 IL weights (PANEL outputs x 2 inputs) to 16 bits and
 * multiplies each output's pair by the pair (x[k], x[k + 1]) of a row, broadcast as one
 * 32-bit word (vpmaddwd, or vpdpwssd with VNNI), into a 32-bit sum per output: no horizontal
 * sums, and a block of rows reuses each widened vector. The sums are the row-major kernel's
 * exact integers (moved into 64 bits every I8_BLOCK inputs, before a 32-bit lane could
 * overflow: 256 products of |w| <= 127 and |x| <= XQ_LIMIT), scaled as it scales them, so the
 * two layouts give the same bits. Rows as the bf16 panels take them: one row four panels at
 * a time, two to four rows two, more in blocks of I8_MR rows.
 * Each loop step takes two input pairs (I8_STEP), and without VNNI adds their two products
 * to each other before the accumulator (one vpaddd into it a step, not two): with one pair a
 * step, 32 rows of x ran at 39% of vpmaddwd's peak on an AVX2 AMD EPYC (Zen 3), with two
 * 1.2-1.45x faster (benchmarks/cpu_kernels.py --gemv --rows 32; one row, bandwidth-bound,
 * alike). AVX2 blocks 4 rows: 8 accumulators, 4 widened weight vectors and 2 broadcasts fit
 * its 16 registers (6 rows spilled accumulators to the stack every step). The sums (exact
 * integers) are those of one pair a step. */
#if defined(VL) && defined(IL) && IL == 2 * VL
#define I8_PANELS 1
#define I8_BLOCK 256
#if VL == 16
#define I8_MR 12
#define VI_BCAST32(v) _mm512_set1_epi32(v)
static inline void vi_add64(__m512i v, int64_t *dst) {
    __m512i *d = (__m512i *)dst;
    _mm512_storeu_si512(d, _mm512_add_epi64(_mm512_loadu_si512(d),
                        _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v))));
    _mm512_storeu_si512(d + 1, _mm512_add_epi64(_mm512_loadu_si512(d + 1),
                        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#else
#define I8_MR 4
#define VI_BCAST32(v) _mm256_set1_epi32(v)
static inline void vi_add64(__m256i v, int64_t *dst) {
    __m256i *d = (__m256i *)dst;
    _mm256_storeu_si256(d, _mm256_add_epi64(_mm256_loadu_si256(d),
                        _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v))));
    _mm256_storeu_si256(d + 1, _mm256_add_epi64(_mm256_loadu_si256(d + 1),
                        _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1))));
}
#endif

/* R rows of xq (int16, row stride K; K even) times NP consecutive panels from p: exact sums
 * into out[NP][M][PANEL] (rows 0..R-1 of it, out at the block's first row). */
#define I8_STEP(ACC, NP, R, P, XQ, K, k, TWO)                                                 \
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {                                    \
        const int8_t *pj = P + (j * K + k) * PANEL;                                           \
        if (((k * PANEL) & 63) == 0)                                                          \
            for (int b = 0; b < (TWO ? 4 : 2) * IL; b += 64)                                  \
                _mm_prefetch((const char *)pj + PANEL_PREFETCH + b, _MM_HINT_T0);             \
        const vi lo = VI_LOAD_W(pj), hi = VI_LOAD_W(pj + IL);                                 \
        const vi lo1 = TWO ? VI_LOAD_W(pj + 2 * IL) : lo, hi1 = TWO ? VI_LOAD_W(pj + 3 * IL) : hi; \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                \
            int32_t pair, pair1;                                                              \
            memcpy(&pair, XQ + i * K + k, sizeof pair);                                       \
            const vi b = VI_BCAST32(pair);                                                    \
            if (TWO) {                                                                        \
                memcpy(&pair1, XQ + i * K + k + 2, sizeof pair1);                             \
                const vi b1 = VI_BCAST32(pair1);                                              \
                ACC[j][i][0] = VI_DOT2(ACC[j][i][0], lo, b, lo1, b1);                         \
                ACC[j][i][1] = VI_DOT2(ACC[j][i][1], hi, b, hi1, b1);                         \
            } else {                                                                          \
                ACC[j][i][0] = VI_DOT(ACC[j][i][0], lo, b);                                   \
                ACC[j][i][1] = VI_DOT(ACC[j][i][1], hi, b);                                   \
            }                                                                                 \
        }                                                                                     \
    }
#define DEFINE_I8_PANEL_GROUP(R, NP)                                                          \
static inline __attribute__((always_inline)) void                                            \
i8_panel_group_##R##_##NP(const int8_t *p, int64_t K, const int16_t *xq, int64_t *out,     \
                          int64_t M) {                                                        \
    for (int j = 0; j < NP; j++)                                                              \
        for (int i = 0; i < R; i++)                                                           \
            for (int l = 0; l < PANEL; l++) out[(j * M + i) * PANEL + l] = 0;                 \
    for (int64_t k0 = 0; k0 < K; k0 += I8_BLOCK) {                                            \
        vi acc[NP][R][2];                                                                     \
        _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                  \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                              \
                acc[j][i][0] = acc[j][i][1] = VI_ZERO();                                      \
        const int64_t kend = K - k0 < I8_BLOCK ? K : k0 + I8_BLOCK;                           \
        int64_t k = k0;                                                                       \
        for (; k + 4 <= kend; k += 4) I8_STEP(acc, NP, R, p, xq, K, k, 1)                    \
        if (k < kend) I8_STEP(acc, NP, R, p, xq, K, k, 0)           /* K % 4 == 2 */         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                  \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                            \
                vi_add64(acc[j][i][0], out + (j * M + i) * PANEL);                            \
                vi_add64(acc[j][i][1], out + (j * M + i) * PANEL + VL);                       \
            }                                                                                 \
    }                                                                                         \
}
DEFINE_I8_PANEL_GROUP(1, 4)
DEFINE_I8_PANEL_GROUP(1, 2)
DEFINE_I8_PANEL_GROUP(2, 2)
DEFINE_I8_PANEL_GROUP(1, 1)
DEFINE_I8_PANEL_GROUP(2, 1)
DEFINE_I8_PANEL_GROUP(3, 1)
DEFINE_I8_PANEL_GROUP(4, 1)
DEFINE_I8_PANEL_GROUP(5, 1)
DEFINE_I8_PANEL_GROUP(6, 1)
#if I8_MR > 6
DEFINE_I8_PANEL_GROUP(7, 1)
DEFINE_I8_PANEL_GROUP(8, 1)
DEFINE_I8_PANEL_GROUP(9, 1)
DEFINE_I8_PANEL_GROUP(10, 1)
DEFINE_I8_PANEL_GROUP(11, 1)
DEFINE_I8_PANEL_GROUP(12, 1)
#endif

/* xq (M rows) times one panel into out[M][PANEL]: blocks of at most I8_MR rows, as even as
 * they come. */
static void i8_panel_rows(const int8_t *p, int64_t K, const int16_t *xq, int64_t M,
                          int64_t *out) {
    const int64_t blocks = (M + I8_MR - 1) / I8_MR;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t r = (M - m0) / (blocks - b);
        const int16_t *xb = xq + m0 * K;
        int64_t *ob = out + m0 * PANEL;
        switch (r) {
            case 1: i8_panel_group_1_1(p, K, xb, ob, M); break;
            case 2: i8_panel_group_2_1(p, K, xb, ob, M); break;
            case 3: i8_panel_group_3_1(p, K, xb, ob, M); break;
            case 4: i8_panel_group_4_1(p, K, xb, ob, M); break;
            case 5: i8_panel_group_5_1(p, K, xb, ob, M); break;
#if I8_MR > 6
            case 6: i8_panel_group_6_1(p, K, xb, ob, M); break;
            case 7: i8_panel_group_7_1(p, K, xb, ob, M); break;
            case 8: i8_panel_group_8_1(p, K, xb, ob, M); break;
            case 9: i8_panel_group_9_1(p, K, xb, ob, M); break;
            case 10: i8_panel_group_10_1(p, K, xb, ob, M); break;
            case 11: i8_panel_group_11_1(p, K, xb, ob, M); break;
            default: i8_panel_group_12_1(p, K, xb, ob, M); break;
#else
            default: i8_panel_group_6_1(p, K, xb, ob, M); break;
#endif
        }
        m0 += r;
    }
}
#endif

/* int8 W [N, K] row-major into int8 panels (above); N % gemv_panel_width() == 0, K even.
 * Returns 0, or 2 where this build has no int8 panel path. */
int pack_i8_panels(const int8_t *w, int64_t N, int64_t K, int8_t *out) {
#ifdef I8_PANELS
    if (N % PANEL || K % 2) return 2;
    pack_by_pairs_i8(w, N, K, out);
    return 0;
#else
    (void)w, (void)N, (void)K, (void)out;
    return 2;
#endif
}

/* Up to how many rows of x bf16 products run on the tile unit here (0: none). */
int gemv_amx_rows(void) {
#ifdef KVFLOW_AMX
    return amx_usable() ? AMX_MAX_ROWS : 0;
#else
    return 0;
#endif
}

static inline void store_out(void *out, int otype, int64_t i, float v) {
    if (otype == T_F32) ((float *)out)[i] = v;
    else ((uint16_t *)out)[i] = gemv_f32_to_bf16(v);
}

#ifdef I8_PANELS
/* VL int64 sums into float32, each rounded once as (float)sum rounds it: exactly into double
 * (|sum| < 2^51: the sum's bits added to 2^52 + 2^51's, that number taken off), then to float.
 * Neither AVX2 nor AVX-512F converts int64 to float directly. */
static inline vf i64_to_f32(const int64_t *s) {
#if VL == 16
    const __m512i magic = _mm512_set1_epi64(0x4338000000000000LL);
    const __m512d off = _mm512_castsi512_pd(magic);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_castsi512_pd(
        _mm512_add_epi64(_mm512_loadu_si512((const void *)s), magic)), off));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_castsi512_pd(
        _mm512_add_epi64(_mm512_loadu_si512((const void *)(s + 8)), magic)), off));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                               _mm256_castps_pd(hi), 1));
#else
    const __m256i magic = _mm256_set1_epi64x(0x4338000000000000LL);
    const __m256d off = _mm256_castsi256_pd(magic);
    const __m128 lo = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_castsi256_pd(
        _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)s), magic)), off));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_castsi256_pd(
        _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(s + 4)), magic)), off));
    return _mm256_set_m128(hi, lo);
#endif
}

/* One row's PANEL outputs from n0 on, as the row-major path computes them:
 * round(round(sum * xscale) * scale[n] + bias[n]), into out at row offset o. */
static inline void i8_panel_out(const int64_t *sums, float xscale, const float *scales,
                                const float *bias, int64_t n0, void *out, int otype, int64_t o) {
    if (otype == T_F32) {
        for (int64_t j = 0; j < PANEL; j += VL) {
            const vf a = VMUL(i64_to_f32(sums + j), VBROADCAST(&xscale));
            const vf b = bias ? VLOAD_F32(bias + n0 + j) : VZERO();
            VSTORE_F32((float *)out + o + n0 + j, VFMA(a, VLOAD_F32(scales + n0 + j), b));
        }
        return;
    }
    for (int64_t j = 0; j < PANEL; j++) {
        const float a = (float)sums[j] * xscale, b = bias ? bias[n0 + j] : 0.0f;
        store_out(out, otype, o + n0 + j, __builtin_fmaf(a, scales[n0 + j], b));
    }
}
#endif

/* A bfloat16 row of K into float32 (a loop the compiler vectorizes). */
static void widen_row(const uint16_t *x, int64_t K, float *out) {
    for (int64_t k = 0; k < K; k++) out[k] = gemv_bf16_to_f32(x[k]);
}

#ifdef VL
/* PANEL sums of one row (+ bias from output n0) into out's row at offset o: one loop per
 * case, each of which the compiler vectorizes (store_out's test inside the loop kept it
 * scalar). */
static inline void store_panel(const float *acc, const float *bias, int64_t n0, void *out,
                               int otype, int64_t o) {
    float v[PANEL];
    if (bias) for (int j = 0; j < PANEL; j++) v[j] = acc[j] + bias[n0 + j];
    else memcpy(v, acc, sizeof v);
    if (otype == T_F32) memcpy((float *)out + o + n0, v, sizeof v);
    else for (int j = 0; j < PANEL; j++) ((uint16_t *)out)[o + n0 + j] = gemv_f32_to_bf16(v[j]);
}
#endif

/* Row m of x (times in_scale) as integers of at most qmax into xq, given its largest
 * magnitude `peak` (inf where the row holds an inf or NaN); returns the row's scale (x ~ xq *
 * scale). A row holding an inf or NaN gets zeros and a NaN scale, so its outputs are NaN. The
 * checks are on the bits: -ffast-math lets the compiler assume there are no infs or NaNs. */
static float quantize_x(const void *x, int xtype, int64_t ldx, int64_t m, const float *in_scale,
                        int64_t K, float peak, int32_t qmax, int16_t *xq) {
    uint32_t bits;
    memcpy(&bits, &peak, sizeof bits);
    if (bits == 0x7F800000u || peak == 0.0f) {
        memset(xq, 0, (size_t)K * sizeof *xq);
        return peak == 0.0f ? 0.0f : __builtin_nanf("");
    }
    const float inv = (float)qmax / peak;
    for (int64_t k = 0; k < K; k++) {
        const int64_t i = m * ldx + k;
        float v = xtype == T_F32 ? ((const float *)x)[i]
                                 : gemv_bf16_to_f32(((const uint16_t *)x)[i]);
        if (in_scale) v *= in_scale[k];
        xq[k] = (int16_t)__builtin_lrintf(v * inv);
    }
    return peak / (float)qmax;
}

/* Up to how many rows of x the 12-bit panels (T_BF16_PANELS12) are decoded in registers,
 * once for all the rows (more rows decode each panel into a buffer first: slower than the
 * bfloat16 panels); 0 where this build has no 12-bit panels. */
int gemv_panels12_rows(void) {
#ifdef P12
    return P12_ROWS;
#else
    return 0;
#endif
}

/* Rows of x the 12-bit pair panels take (layout T_BF16_PAIRS12), 0 where this build has none. */
int gemv_pairs12_rows(void) {
#ifdef P12_PAIRS
    return P12_PAIR_ROWS;
#else
    return 0;
#endif
}

/* out[m, n] = round(scale[n] * sum_k x[m, k] in_scale[k] W[n, k] + bias[n]) for m < M,
 * n < N. x: M rows of K (float32 or bfloat16, row stride ldx elements); W: [N, K] row-major
 * of wtype (T_F32, T_BF16, T_I8); scales: [N] float32 (int8 only, else NULL); in_scale: [K]
 * float32 or NULL (int8: SmoothQuant's input scale, which W8A8 folds into its weights and
 * this path applies to x instead); bias: [N] float32 or NULL; out: [M, N] of
 * otype (row stride ldo). W may also be T_BF16_PANELS (`pack_panels`: N % PANEL == 0) or its
 * 12-bit copy T_BF16_PANELS12 (K even), or T_BF16_PAIRS (`pack_pairs`; x bfloat16, K even, no
 * in_scale) or its 12-bit copy T_BF16_PAIRS12 (the same, and 1 to gemv_pairs12_rows() rows).
 * M = 0: nothing to do, 0. Returns 0, 1 when out of memory, or 2 when W is T_BF16_AMX and
 * the tile unit cannot run it (no AMX, x not bf16, K % 32 or N % 16 not 0), or another
 * packed layout and this build or these operands cannot. */
int gemv(const void *x, int xtype, int64_t ldx, int64_t M, const void *w, int wtype,
         const float *scales, const float *in_scale, const float *bias, int64_t N, int64_t K,
         void *out, int otype, int64_t ldo) {
    if (M == 0) return 0;                      /* no rows: nothing to write */
    const int esize = wtype == T_F32 ? 4 : wtype == T_I8 || wtype == T_I8_PANELS ? 1 : 2;
    const int panels12 = wtype == T_BF16_PANELS12;
    const int bf16_pairs = wtype == T_BF16_PAIRS, pairs12 = wtype == T_BF16_PAIRS12;
    const int panels = wtype == T_BF16_PANELS || panels12 || bf16_pairs || pairs12;
    const int i8_panels = wtype == T_I8_PANELS;
#ifdef BF16_PAIRS
    if (bf16_pairs && (xtype != T_BF16 || K % 2 || in_scale != NULL)) return 2;
#else
    if (bf16_pairs) return 2;
#endif
#ifdef P12_PAIRS
    if (pairs12 && (xtype != T_BF16 || K % 2 || in_scale != NULL || M > P12_PAIR_ROWS))
        return 2;
#else
    if (pairs12) return 2;
#endif
#ifdef VL
    if (panels && (N % PANEL || scales != NULL)) return 2;
#else
    if (panels) return 2;
#endif
#ifdef P12
    if (panels12 && K % 2) return 2;
#else
    if (panels12) return 2;
#endif
#ifdef I8_PANELS
    if (i8_panels && (N % PANEL || K % 2 || scales == NULL)) return 2;
#else
    if (i8_panels) return 2;
#endif
    if (wtype == T_BF16_AMX) {
#ifdef KVFLOW_AMX
        if (xtype != T_BF16 || in_scale != NULL || scales != NULL || K % 32 || N % 16)
            return 2;
        return amx_linear((const uint16_t *)x, ldx, M, (const uint16_t *)w, bias, N, K, out,
                          otype, ldo);
#else
        return 2;
#endif
    }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int pairs = (wtype == T_BF16 && xtype == T_BF16 && K % 2 == 0 && ldx % 2 == 0
                       && in_scale == NULL) || bf16_pairs || pairs12;
#else
    const int pairs = 0;
#endif
    /* x as contiguous rows: float32, bf16 for vdpbf16ps, or integers for int8 weights. */
    const int ints = wtype == T_I8 || i8_panels;
    /* rows the kernel reads in place, no copy: float32 (split_x is the identity but for
     * T_BF16), or bfloat16 ones for vdpbf16ps (their copy ran on one thread before the
     * parallel region: at 32 rows the default model's 960 x 576, 3072 x 576 and 576 x 1536
     * pair panels took 17%, 6% and 29% longer with it, an AMD EPYC Zen 5) */
    const int in_place = ldx == K && in_scale == NULL && !ints
                         && (pairs ? xtype == T_BF16
                                   : xtype == T_F32 && wtype != T_BF16);
    const size_t xbytes = ((size_t)(M * K) * (pairs || ints ? 2 : 4) + 63) & ~(size_t)63;
    void *xs = in_place ? NULL : malloc(xbytes + (size_t)M * sizeof(float));
    if (!in_place && xs == NULL) return 1;
    const float *xf = in_place ? (const float *)x : (const float *)xs;
    float *xscale = in_place ? NULL : (float *)((char *)xs + xbytes);  /* int8: x's scale a row */
    const uint16_t *xpairs __attribute__((unused))          /* pairs (BF16 builds only) */
        = in_place ? (const uint16_t *)x : (const uint16_t *)xs;
    for (int64_t m = 0; m < M && !in_place; m++) {
        if (xtype == T_BF16 && in_scale == NULL && !ints && !pairs && wtype != T_BF16) {
            widen_row((const uint16_t *)x + m * ldx, K, (float *)xs + m * K);
            continue;
        }
        float *row = (float *)xs + m * K;
        float peak = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const int64_t i = m * ldx + k;
            if (pairs) {
                ((uint16_t *)xs)[m * K + k] = ((const uint16_t *)x)[i];
                continue;
            }
            float v = xtype == T_F32 ? ((const float *)x)[i]
                                     : gemv_bf16_to_f32(((const uint16_t *)x)[i]);
            if (in_scale) v *= in_scale[k];
            if (ints) {                   /* the largest magnitude; inf or NaN: peak = inf */
                uint32_t bits;
                memcpy(&bits, &v, sizeof bits);
                bits &= 0x7FFFFFFFu;
                if (bits > 0x7F800000u) bits = 0x7F800000u;
                memcpy(&v, &bits, sizeof v);
                peak = v > peak ? v : peak;
            } else {
                row[wtype == T_BF16 ? split_x(k, K) : k] = v;
            }
        }
        if (ints) xscale[m] = quantize_x(x, xtype, ldx, m, in_scale, K, peak, xq_max(K),
                                         (int16_t *)xs + m * K);
    }
#ifdef I8_PANELS
    if (i8_panels) {
        const int64_t num_panels = N / PANEL;
        const int16_t *xq = (const int16_t *)xs;
        const int parallel = N * K > 65536;
        int64_t threads = 1;
        PanelShare *sh = shares_new(num_panels, parallel, &threads);
        int failed = sh == NULL;
        #pragma omp parallel num_threads(threads) if (parallel && sh != NULL)
        {
            int64_t *sums = malloc((size_t)(M <= 4 ? 4 * M : M) * PANEL * sizeof(int64_t));
            if (sums == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
            /* As the bf16 panels: groups of 4 panels at one row, 2 at two to four, else 1. */
            const int64_t group = M == 1 ? 4 : M <= 4 ? 2 : 1, me = omp_get_thread_num();
            int64_t c0, cn, end;
            while (sums != NULL && sh != NULL
                   && shares_claim(sh, threads, me, group, &c0, &cn, &end))
                for (int64_t p0 = c0, np; p0 < c0 + cn; p0 += np) {
                    np = cn == group ? group : 1;
                    const int8_t *wp = (const int8_t *)w + p0 * K * PANEL;
                    if (np == 4) i8_panel_group_1_4(wp, K, xq, sums, M);
                    else if (np == 2)                  /* rows in pairs, the odd one alone */
                        for (int64_t m0 = 0; m0 < M; m0 += 2) {
                            if (M - m0 >= 2)
                                i8_panel_group_2_2(wp, K, xq + m0 * K, sums + m0 * PANEL, M);
                            else i8_panel_group_1_2(wp, K, xq + m0 * K, sums + m0 * PANEL, M);
                        }
                    else i8_panel_rows(wp, K, xq, M, sums);
                    for (int64_t q = 0; q < np; q++)              /* sums: [np][M][PANEL] */
                        for (int64_t m = 0; m < M; m++)
                            i8_panel_out(sums + (q * M + m) * PANEL, xscale[m], scales, bias,
                                         (p0 + q) * PANEL, out, otype, m * ldo);
                }
            free(sums);
        }
        free(sh);
        if (xs != NULL) free(xs);
        return failed;
    }
#endif
#ifdef VL
    if (panels) {
        const int64_t num_panels = N / PANEL;
        const int parallel = N * K * esize > 65536;
        int64_t threads = 1;
        PanelShare *sh = shares_new(num_panels, parallel, &threads);
        int failed = sh == NULL;
        #pragma omp parallel num_threads(threads) if (parallel && sh != NULL)
        {
            float *acc = malloc((size_t)(M <= 4 ? 8 : M) * PANEL * sizeof(float));
#ifdef P12
            /* 12-bit panels past P12_ROWS rows: each decoded into this bfloat16 panel, then
             * as the others (up to P12_ROWS rows decode in registers) */
            const int decode12 = panels12 && M > P12_ROWS;
            uint16_t *decoded = decode12 ? aligned_alloc(64, ((size_t)K * PANEL * 2 + 63) & ~(size_t)63)
                                         : NULL;
            if (decode12 && decoded == NULL) {
                free(acc);
                acc = NULL;
            }
            const int64_t groups12 = (K + P12_G - 1) / P12_G;
            int64_t E = 0;
            if (panels12) memcpy(&E, w, 8);
#endif
            if (acc == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
            /* One row: groups of 4 panels (12-bit: P12_NP); two to four: 2 (12-bit panels: 1);
             * else 1 (a share's last ones alone). A thread's own share comes first, a
             * contiguous range of an even split of the panels, not of the groups (SmolLM2's
             * 576 outputs on AVX-512 are 18 panels: split by groups of 4, one thread had 12
             * and the other 6). */
            const int64_t group = M == 1 ? (panels12 || pairs12 ? P12_NP : 4)
                                         : M <= 4 && !panels12 ? 2 : 1;
            const int64_t me = omp_get_thread_num();
            int64_t c0, cn, end;
            while (acc != NULL && sh != NULL
                   && shares_claim(sh, threads, me, group, &c0, &cn, &end)) {
#ifdef P12
                /* the first whole group of the claim; and where prefetching may run to (the
                 * claim's end, or the own share's) */
                int64_t whole = decode12 ? p12_first_whole(w, c0 * groups12) : 0;
                const uint8_t *stream_end = panels12 ? (const uint8_t *)w + p12_head_bytes(E)
                                                       + end * p12_panel_bytes(K) : NULL;
#endif
                for (int64_t p0 = c0, np; p0 < c0 + cn; p0 += np) {
                    np = cn == group ? group : 1;
                    const uint16_t *wp = (const uint16_t *)w + p0 * K * PANEL;
#ifdef P12
                    if (decode12) {
                        p12_decode(w, N, K, p0, &whole, decoded, stream_end);
                        wp = decoded;
                    }
#endif
#ifdef P12_PAIRS
                    if (pairs12) {
                        const uint16_t *xb = xpairs;
                        if (M == 1 && np == P12_NP) p12_pairs_1_4(w, N, K, p0, end, xb, acc, 1);
                        else p12_pairs_rows(w, N, K, p0, end, xb, acc, M, np);
                    } else
#endif
#ifdef BF16_PAIRS
                    if (bf16_pairs) {
                        const uint16_t *xb = xpairs;
                        if (np == 4) pair_group_1_4(wp, K, xb, acc, M, NULL, 0, 0);
                        else if (np == 2)
                            for (int64_t m0 = 0; m0 < M; m0 += 2) {
                                const uint16_t *xm = xb + m0 * K;
                                float *am = acc + m0 * PANEL;
                                if (M - m0 >= 2) pair_group_2_2(wp, K, xm, am, M, NULL, 0, 0);
                                else pair_group_1_2(wp, K, xm, am, M, NULL, 0, 0);
                            }
                        else pair_rows(wp, K, xb, M, acc, p0 + 1 < end ? wp + K * PANEL : NULL,
                                       K * PANEL * 2);
                    } else
#endif
                    if (panels12 && M == 1) {
#ifdef P12
                        if (np == P12_NP) P12_GROUP_NP(w, N, K, p0, end, xf, acc, 1);
                        else p12_group_1_1(w, N, K, p0, end, xf, acc, 1);
                    } else if (panels12 && !decode12) {   /* 2 to P12_ROWS rows */
                        p12_group_rows(w, N, K, p0, end, xf, acc, M);
#endif
                    } else if (np == 4) panel_group_1_4(wp, K, xf, acc, M, NULL, 0, 0);
                    else if (np == 2)                  /* rows in pairs, the odd one alone */
                        for (int64_t m0 = 0; m0 < M; m0 += 2) {
                            if (M - m0 >= 2)
                                panel_group_2_2(wp, K, xf + m0 * K, acc + m0 * PANEL, M, NULL, 0, 0);
                            else panel_group_1_2(wp, K, xf + m0 * K, acc + m0 * PANEL, M, NULL, 0, 0);
                        }
                    else if (!panels12)
                        panel_rows(wp, K, xf, M, acc, p0 + 1 < end ? wp + K * PANEL : NULL,
                                   K * PANEL * 2);
#ifdef P12
                    else panel_rows(wp, K, xf, M, acc,
                                    p0 + 1 < end ? p12_panel(w, N, K, p0 + 1) : NULL,
                                    p12_panel_bytes(K));
#endif
                    for (int64_t q = 0; q < np; q++)               /* acc: [np][M][PANEL] */
                        for (int64_t m = 0; m < M; m++)
                            store_panel(acc + (q * M + m) * PANEL, bias, (p0 + q) * PANEL, out,
                                        otype, m * ldo);
                }
            }
            free(acc);
#ifdef P12
            free(decoded);
#endif
        }
        free(sh);
        if (xs != NULL) free(xs);
        return failed;
    }
#endif
    const int64_t num_tiles = (N + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) if (N * K * esize > 65536)
    for (int64_t tile = 0; tile < num_tiles; tile++) {
        const int64_t n0 = tile * ROWS, nr = N - n0 < ROWS ? N - n0 : ROWS;
        const char *wt = (const char *)w + n0 * K * esize;
        for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
            const int64_t mr = M - m0 < XROWS ? M - m0 : XROWS;
            float acc[ROWS][XROWS];
            if (ints) {
                const int8_t *wi = (const int8_t *)wt;
                for (int64_t h = 0; h < mr; h += I8_XROWS) {
                    const int64_t hr = mr - h < I8_XROWS ? mr - h : I8_XROWS;
                    const int16_t *xq = (const int16_t *)xs + (m0 + h) * K;
                    int64_t sums[ROWS][I8_XROWS];
                    if (nr == ROWS && hr == 1) dot_tile_i8(wi, K, ROWS, xq, 1, sums);
                    else if (nr == ROWS && hr == I8_XROWS)
                        dot_tile_i8(wi, K, ROWS, xq, I8_XROWS, sums);
                    else dot_tile_i8(wi, K, nr, xq, hr, sums);
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t m = 0; m < hr; m++)
                            acc[r][h + m] = (float)sums[r][m] * xscale[m0 + h + m];
                }
            } else
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (pairs)
                dot_tile_dpbf16((const uint16_t *)wt, K, nr, xpairs + m0 * K, mr,
                                acc);
            else
#endif
            if (wtype == T_F32)
                dot_tile_f32((const float *)wt, K, nr, xf + m0 * K, mr, acc);
            else
                dot_tile_bf16((const uint16_t *)wt, K, nr, xf + m0 * K, mr, acc);
            for (int64_t r = 0; r < nr; r++) {
                const float s = scales ? scales[n0 + r] : 1.0f, b = bias ? bias[n0 + r] : 0.0f;
                for (int64_t m = 0; m < mr; m++)      /* one rounding, as the int8 panels */
                    store_out(out, otype, (m0 + m) * ldo + n0 + r, __builtin_fmaf(acc[r][m], s, b));
            }
        }
    }
    if (xs != NULL) free(xs);
    return 0;
}

/* --- greedy tokens without the whole LM head (workers/greedy_head.py) ---------------------
 * For each of M rows of x [M, K] (float32, finite): the index of the largest of x W^T, the
 * first one on ties, exactly as the bfloat16 panels' product (T_BF16_PANELS or its 12-bit
 * copy: every output one fma chain over k = 0..K-1 from 0) and the argmax after it would
 * give, while reading an int8 copy of W (W8A16, `wq`: T_I8 rows or T_I8_PANELS, per-row
 * `scales`) instead of the bfloat16 one. `w` [N, K] float32 holds W's values (rounded to
 * bfloat16 here as the panels were). The int8 product `approx` is within B[v] of the exact
 * logit: |exact - approx| <= err[v] |x| + norm[v] (|x - xq| + c (|x| + |x - xq|)), with
 * err[v] = |W[v] - scale q[v]| and norm[v] >= both rows' norms (2-norms, Cauchy-Schwarz;
 * the loader computes them), |x - xq| the rounding of x to xq_max(K) levels and c the
 * float32 sums' rounding (K u each, two of them). So the exact argmax is among the rows
 * whose upper bound reaches the largest lower bound; only those are computed exactly, in
 * the panels' order. approx: [M, N] scratch (its rows end as the upper bounds); cand: [N]
 * scratch; out: [M] token ids; num_cand: [M] how many rows each needed exactly. Returns
 * gemv's codes (0, 1, 2), or 3 where the bound cannot decide (the full logits then do): x
 * holds an inf or a NaN, |x| is ~0 (every row a candidate) or past 1e30, or a bound
 * overflowed. */
#ifdef VL
/* f0: an absolute slack (the pair panels' flushed denormals); bf16: the logits are compared
 * as rounded to bfloat16 (the pair panels' output), so a row is a candidate where its upper
 * bound rounds to at least what the largest lower bound rounds to (rounding is monotonic: a
 * row whose exact logit ties the largest after rounding is kept). */
static int64_t greedy_candidates(float *a, const float *err, const float *norm,
                                 int64_t N, float fe, float fn, float f0, int bf16,
                                 int64_t *cand) {
    float best_lo = -3.0e38f;
    uint32_t spread = 0;                 /* an inf or NaN among the bounds: its exponent bits */
    for (int64_t v = 0; v < N; v++) {    /* a[v] becomes its upper bound (a is scratch) */
        const float b = err[v] * fe + norm[v] * fn + (a[v] < 0 ? -a[v] : a[v]) * 1e-6f + f0;
        const float lo = a[v] - b, hi = a[v] + b;
        uint32_t bits[2];
        memcpy(&bits[0], &lo, sizeof bits[0]);
        memcpy(&bits[1], &hi, sizeof bits[1]);
        spread |= ((bits[0] & 0x7F800000u) == 0x7F800000u)
                  | ((bits[1] & 0x7F800000u) == 0x7F800000u);
        best_lo = lo > best_lo ? lo : best_lo;
        a[v] = hi;
    }
    if (spread) return 0;                /* overflowed (|x| near FLOAT_MAX): no candidates */
    if (bf16) best_lo = gemv_bf16_to_f32(gemv_f32_to_bf16(best_lo));
    int64_t count = 0;
    for (int64_t v = 0; v < N; v++)
        if ((bf16 ? gemv_bf16_to_f32(gemv_f32_to_bf16(a[v])) : a[v]) >= best_lo)
            cand[count++] = v;
    return count;
}

/* The exact logits of the candidates, VL at a time (one lane each), as the panels sum them:
 * acc = fma(w[k], x[k], acc) for k in order; the first of the largest wins. */
static int64_t greedy_exact(const float *w, int64_t K, const float *x, const int64_t *cand,
                            int64_t count) {
    float best = -3.0e38f;
    int64_t best_id = cand[0];
    float t[VL] __attribute__((aligned(64))), vals[VL] __attribute__((aligned(64)));
    for (int64_t g = 0; g < count; g += VL) {
        const float *rows[VL];
        for (int i = 0; i < VL; i++)
            rows[i] = w + cand[g + i < count ? g + i : count - 1] * K;
        vf acc = VZERO();
        for (int64_t k = 0; k < K; k++) {
            for (int i = 0; i < VL; i++) t[i] = gemv_bf16_to_f32(gemv_f32_to_bf16(rows[i][k]));
            acc = VFMA(VLOAD_F32(t), VBROADCAST(x + k), acc);
        }
        VSTORE_F32(vals, acc);
        for (int i = 0; i < VL && g + i < count; i++)
            if (vals[i] > best || (g + i == 0)) { best = vals[i]; best_id = cand[g + i]; }
    }
    return best_id;
}
#endif

#ifdef VL
/* Row x's bound factors (greedy_head's comment): fe multiplies a row's err, fn its norm;
 * x float32 or bfloat16 (bf16), pairs: the pair panels' flushed denormals too (fn, and the
 * absolute slack f0). 0 where the bound cannot decide (x ~ 0: every row ties; or past 1e30).
 * c counts two float32 sums' roundings (the int8 product's and the exact one's), K each:
 * enough for any order and for a rounding of up to one ulp a step. */
static int greedy_factors(const void *x, int bf16, int pairs, int64_t K, float *fe, float *fn,
                          float *f0) {
    const double u = 5.9604644775390625e-08, tiny = 2.3509887016445750e-38;  /* 2^-24, 2^-125 */
    double nx2 = 0.0, peak = 0.0;
    for (int64_t k = 0; k < K; k++) {
        const double v = bf16 ? gemv_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        nx2 += v * v;
        peak = (v < 0 ? -v : v) > peak ? (v < 0 ? -v : v) : peak;
    }
    const double nx = __builtin_sqrt(nx2) * (1.0 + 1e-6);
    const double dq = 0.5 * __builtin_sqrt((double)K) * (peak / xq_max(K)) * (1.0 + 1e-6)
                      + 4.0 * u * nx;
    const double c = (double)(K + 8) * 2.0 * u * 1.01;
    *fe = (float)(nx * 1.0001);
    *fn = (float)((dq + c * (nx + dq) + (pairs ? K * tiny : 0.0)) * 1.0001);
    *f0 = pairs ? (float)(K * tiny * (peak + 2.0)) : 0.0f;
    return nx > 1e-20 && nx < 1e30;
}
#endif

int greedy_head(const float *x, int64_t M, int64_t K, int64_t N, const int8_t *wq,
                int wq_type, const float *scales, const float *err, const float *norm,
                const float *w, float *approx, int64_t *cand, int64_t *out,
                int64_t *num_cand) {
#ifndef VL
    (void)x; (void)M; (void)K; (void)N; (void)wq; (void)wq_type; (void)scales; (void)err;
    (void)norm; (void)w; (void)approx; (void)cand; (void)out; (void)num_cand;
    return 2;
#else
    if (wq_type != T_I8 && wq_type != T_I8_PANELS) return 2;
    for (int64_t i = 0; i < M * K; i++) {         /* bits: -ffast-math assumes finite */
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        if ((bits & 0x7F800000u) == 0x7F800000u) return 3;
    }
    const int code = gemv(x, T_F32, K, M, wq, wq_type, scales, NULL, NULL, N, K, approx,
                          T_F32, N);
    if (code) return code;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float fe, fn, f0;
        if (!greedy_factors(xm, 0, 0, K, &fe, &fn, &f0)) return 3;
        const int64_t count = greedy_candidates(approx + m * N, err, norm, N, fe, fn, f0, 0,
                                                cand);
        if (count == 0) return 3;
        num_cand[m] = count;
        out[m] = greedy_exact(w, K, xm, cand, count);
    }
    return 0;
#endif
}

/* The same for the pair panels' LM head (T_BF16_PAIRS or its 12-bit copy; bfloat16 x, logits
 * rounded to bfloat16): x [M, K] and w [N, K] bfloat16 (K even), the exact logits as the pair
 * panels sum them (every output one vdpbf16ps lane over the input pairs in order, from 0)
 * and rounded to bfloat16, the first of the largest. The bound as greedy_head's (the same
 * K roundings of a float32 sum), plus what vdpbf16ps flushes: denormal inputs read as 0 and
 * denormal results as 0, each term off by less than 2^-126 times the other factor. */
#ifdef BF16_PAIRS
static int64_t greedy_exact_pairs(const uint16_t *w, int64_t K, const uint16_t *x,
                                  const int64_t *cand, int64_t count) {
    float best = 0.0f;
    int64_t best_id = cand[0];
    int32_t t[16] __attribute__((aligned(64)));
    float vals[16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < count; g += 16) {
        const uint16_t *rows[16];
        for (int i = 0; i < 16; i++) rows[i] = w + cand[g + i < count ? g + i : count - 1] * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 2) {
            for (int i = 0; i < 16; i++) memcpy(&t[i], rows[i] + k, sizeof t[i]);
            int32_t pair;
            memcpy(&pair, x + k, sizeof pair);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(t),
                                   (__m512bh)_mm512_set1_epi32(pair));
        }
        _mm512_store_ps(vals, acc);
        for (int i = 0; i < 16 && g + i < count; i++) {
            const float v = gemv_bf16_to_f32(gemv_f32_to_bf16(vals[i]));
            if (v > best || g + i == 0) { best = v; best_id = cand[g + i]; }
        }
    }
    return best_id;
}
#endif

int greedy_head_pairs(const uint16_t *x, int64_t M, int64_t K, int64_t N, const int8_t *wq,
                      int wq_type, const float *scales, const float *err, const float *norm,
                      const uint16_t *w, float *approx, int64_t *cand, int64_t *out,
                      int64_t *num_cand) {
#ifndef BF16_PAIRS
    (void)x; (void)M; (void)K; (void)N; (void)wq; (void)wq_type; (void)scales; (void)err;
    (void)norm; (void)w; (void)approx; (void)cand; (void)out; (void)num_cand;
    return 2;
#else
    if ((wq_type != T_I8 && wq_type != T_I8_PANELS) || K % 2) return 2;
    for (int64_t i = 0; i < M * K; i++)
        if ((x[i] & 0x7F80u) == 0x7F80u) return 3;
    const int code = gemv(x, T_BF16, K, M, wq, wq_type, scales, NULL, NULL, N, K, approx,
                          T_F32, N);
    if (code) return code;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * K;
        float fe, fn, f0;
        if (!greedy_factors(xm, 1, 1, K, &fe, &fn, &f0)) return 3;
        const int64_t count = greedy_candidates(approx + m * N, err, norm, N, fe, fn, f0, 1,
                                                cand);
        if (count == 0) return 3;
        num_cand[m] = count;
        out[m] = greedy_exact_pairs(w, K, xm, cand, count);
    }
    return 0;
#endif
}
