/* kvflow's CPU kernels (loaded by cpu_ops.py): paged attention, then the KV store, elementwise
 * ops, the sampler's argmax and the per-token quantization of int8 linears' inputs.
 *
 * Paged attention: every query row, decode or prefill, attends to its own causal context,
 * read straight from the paged cache. The torch path gathers every request's blocks into
 * scratch tensors and runs small bmm/SDPA calls; on CPU those copies and calls cost more than
 * the math. This kernel reads each K/V row where it lies, and keeps scores, softmax and sums
 * in float32. A decode row goes alone, its keys a vector at a time ("Decode rows" below); a
 * prompt's rows (a run of consecutive rows of one request) go in flash-style tiles ("Prefill
 * tiles").
 *
 * Cache layout (the torch backend's, head-major): [num_kv_heads, num_slots, head_dim] with
 * slot = block_id * block_size + offset; an int8 cache's rows are head_dim values and their
 * float32 scale, [num_kv_heads, num_slots, head_dim + 4] (KV_EXTRA). Work is split over
 * (query row or tile, KV head) pairs with OpenMP; linked against the libgomp that torch has
 * loaded, it shares torch's thread pool.
 *
 * Built by kvflow/kernels/cpu_ops.py (cc -O3 -march=native -ffast-math -fopenmp).
 * -ffast-math is safe here: every value is finite (the row kernels visit only visible keys,
 * the tiles mask with a finite MASKED, never -inf), and it lets expf vectorise.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_GROUP 16       /* query heads per KV head handled on the stack */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {      /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_to_f32(float x) { return x; }
static inline float i8_to_f32(int8_t x) { return (float)x; }

/* An int8 cache (kv_cache_dtype="int8") holds each K/V row as head_dim int8 values followed by
 * their float32 scale (4 bytes, at any alignment): value = int8 * scale. KV_EXTRA is the
 * bytes a row has past its values, ROW_SCALE its scale (1 for float32 and bfloat16 caches:
 * both compile away there). */
#define KV_EXTRA(TK) (sizeof(TK) == 1 ? 4 : 0)
static inline float row_scale_i8(const void *row, int64_t D) {
    float scale;
    memcpy(&scale, (const char *)row + D, sizeof scale);
    return scale;
}
#define ROW_SCALE(TK, row, D) (sizeof(TK) == 1 ? row_scale_i8((row), (D)) : 1.0f)

/* Fetch [start, start + bytes): into L1 (to = 0, prefetcht0), L2 (1, prefetcht1) or towards
 * L2 (2, prefetcht2); `to` a constant. On x86 an asm statement: GCC may delete a loop that
 * does nothing but __builtin_prefetch (it has no side effects), and did here. */
static inline __attribute__((always_inline)) void prefetch_bytes(const void *start,
                                                                 int64_t bytes, const int to) {
    for (int64_t off = 0; off < bytes; off += 64) {
        const char *p = (const char *)start + off;
#if defined(__x86_64__) || defined(__i386__)
        if (to == 0) __asm__ volatile("prefetcht0 %0" : : "m"(*p));
        else if (to == 1) __asm__ volatile("prefetcht1 %0" : : "m"(*p));
        else __asm__ volatile("prefetcht2 %0" : : "m"(*p));
#else
        if (to == 0) __builtin_prefetch(p, 0, 3);
        else if (to == 1) __builtin_prefetch(p, 0, 2);
        else __builtin_prefetch(p, 0, 1);
#endif
    }
}

/* Blocks lie where the allocator put them. Within a run of consecutive blocks the hardware
 * prefetcher streams; the first block of each run is fetched ahead into L2 here, K and V both,
 * so that no jump waits a full memory latency. */
static inline void prefetch_runs(const void *k_head, const void *v_head, const int32_t *table,
                                 int64_t ctx, int64_t block_size, int64_t block_bytes) {
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
        if (b == 0 || table[b] != table[b - 1] + 1) {
            prefetch_bytes((const char *)k_head + table[b] * block_bytes, block_bytes, 2);
            prefetch_bytes((const char *)v_head + table[b] * block_bytes, block_bytes, 2);
        }
}

/* Software prefetch of the key/value row PREFETCH_KEYS keys ahead of the one being read, into
 * L1: a task streams its keys in block-sized pieces (2 KB for 16 bf16 rows of 64) that lie
 * anywhere, and the hardware prefetcher alone kept too few reads in flight: decode attention
 * over 30 layers' caches read them at 14.7 GB/s (bf16, blocks in runs), 18.1 with this, where
 * a plain read reaches 25-29 (benchmarks/cpu_kernels.py). */
#define PREFETCH_KEYS 32
static inline void prefetch_key(const void *head, const int32_t *table, int64_t t, int64_t ctx,
                                int64_t block_size, int64_t row_bytes) {
    if (t >= ctx) return;
    const char *row = (const char *)head
                      + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes;
    prefetch_bytes(row, row_bytes, 0);
}

/* One (query row, KV head) pair: `group` query heads against `ctx` keys, a key at a time (head
 * sizes that are not a multiple of 32; others go by DEFINE_ROW_TASK, below).
 * qf: [group, D] float32 scaled queries; scores: [group, ctx] scratch; returns acc [group, D]. */
#define DEFINE_TASK(NAME, T, LOAD)                                                            \
static inline __attribute__((always_inline)) void NAME(                                       \
        const float *qf, const T *k_head, const T *v_head, const int32_t *table, int64_t ctx, \
        int64_t block_size, const int64_t group, const int64_t D, float *scores, float *acc) {\
    float maxs[MAX_GROUP], kf[D] __attribute__((aligned(64)));                                 \
    const int64_t RS = D + KV_EXTRA(T);                /* a row's elements */                 \
    for (int64_t g = 0; g < group; g++) maxs[g] = -FLT_MAX;                                   \
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, blk++) {               \
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;               \
        const T *kb = k_head + (int64_t)table[blk] * block_size * RS;                        \
        for (int64_t t = 0; t < n; t++) {                                                     \
            prefetch_key(k_head, table, start + t + PREFETCH_KEYS, ctx, block_size,          \
                         RS * (int64_t)sizeof(T));                                            \
            const float ks = ROW_SCALE(T, kb + t * RS, D);                                    \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kb[t * RS + d]) * ks;                \
            for (int64_t g = 0; g < group; g++) {                                             \
                const float *qg = qf + g * D;                                                 \
                float s = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:s)")                                            \
                for (int64_t d = 0; d < D; d++) s += qg[d] * kf[d];                           \
                scores[g * ctx + start + t] = s;                                              \
                maxs[g] = s > maxs[g] ? s : maxs[g];                                          \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t g = 0; g < group; g++) {                                                     \
        float *sg = scores + g * ctx, sum = 0.0f;                                             \
        const float m = maxs[g];                                                              \
        _Pragma("omp simd reduction(+:sum)")                                                  \
        for (int64_t j = 0; j < ctx; j++) { sg[j] = expf(sg[j] - m); sum += sg[j]; }          \
        const float inv = 1.0f / sum;                                                         \
        _Pragma("omp simd")                                                                   \
        for (int64_t j = 0; j < ctx; j++) sg[j] *= inv;                                       \
    }                                                                                         \
    memset(acc, 0, sizeof(float) * (size_t)(group * D));                                      \
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, blk++) {               \
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;               \
        const T *vb = v_head + (int64_t)table[blk] * block_size * RS;                        \
        for (int64_t t = 0; t < n; t++) {                                                     \
            prefetch_key(v_head, table, start + t + PREFETCH_KEYS, ctx, block_size,          \
                         RS * (int64_t)sizeof(T));                                            \
            const float vs = ROW_SCALE(T, vb + t * RS, D);                                    \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vb[t * RS + d]) * vs;                \
            for (int64_t g = 0; g < group; g++) {                                             \
                const float p = scores[g * ctx + start + t];                                  \
                float *ag = acc + g * D;                                                      \
                _Pragma("omp simd")                                                           \
                for (int64_t d = 0; d < D; d++) ag[d] += p * kf[d];                           \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

/* --- Prefill tiles (flash-style), every ISA ----------------------------------------------
 * A prefill of n tokens is n query rows of one request whose contexts grow by one. Attended
 * row by row (above), each row reads its whole context again: a 512-token prompt reads every
 * key ~256 times from L2 and spends its time on loads and horizontal sums (~110 GFLOP/s in
 * bfloat16 here, ~68 in float32, while the same prompt's matmuls run at >1000). Here such rows
 * go TILE_Q at a time: each tile of TILE_K keys is converted to float32 once (K transposed,
 * so one FMA scores 16 keys for one query head), scored against all TILE_Q x group query
 * vectors, and folded in with the running max and sum of online softmax; V is summed with
 * the accumulators in registers. Written with GCC's vector types (a few reductions in
 * intrinsics), so the same source becomes AVX-512 or AVX2 code. Scores, softmax and sums in
 * float32; keys a row must not see (the causal diagonal, the padding of the last key tile)
 * score MASKED, whose exp is 0. With bfloat16 queries and cache on AMD's AVX512-BF16 CPUs
 * (Zen 4, 5) the scores and P V go by vdpbf16ps instead (DOT: tile_scores_dot, tile_pv_dot;
 * P rounded to bfloat16 for P V, as flash attention does on GPUs): there it issues at the
 * rate of float32 FMAs and does twice their work, and on an AMD EPYC Zen 5 (2 threads) one
 * 2048-token prompt's attention took 17.7 -> 10.6 ms a layer, 15 prompts of 32-256 tokens
 * 1.94 -> 1.38 (benchmarks/cpu_kernels.py). On a Sapphire Rapids Xeon, whose vdpbf16ps
 * issues at half the rate of its FMAs, the same idea ran at 0.7x, so Intel CPUs keep the
 * FMAs (cpu_ops.tile_dot_pays; their AMX CPUs send long bfloat16 prompts to SDPA). */
#define TILE_Q 32            /* query rows (tokens) per tile */
#define TILE_K 32            /* keys per step: two vectors of scores */
#define TILE_MIN_ROWS 16     /* shorter runs (decodes, speculative verifications) go by rows */
#define MASKED (-1e30f)
/* VL: floats in the native vector (the type vf); the register blocks fit 16 registers on AVX2
 * and use about half of AVX-512's 32. */
#ifdef __AVX512F__
#include <immintrin.h>
#define VL 16
#define QK_ROWS 8            /* query vectors scored at once (x TILE_K / VL score vectors) */
#define PV_ROWS 4            /* query vectors whose V sums stay in registers at once */
typedef float vf __attribute__((vector_size(64), aligned(64)));
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
static inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
#define VL 8
#define QK_ROWS 2
#define PV_ROWS 2
typedef float vf __attribute__((vector_size(32), aligned(32)));
#ifdef __AVX__
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline float hreduce(vf v, int is_max) {
    const __m256 w = (__m256)v;
    __m128 x = is_max ? _mm_max_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1))
                      : _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
    __m128 y = _mm_movehl_ps(x, x);
    x = is_max ? _mm_max_ps(x, y) : _mm_add_ps(x, y);
    y = _mm_shuffle_ps(x, x, 1);
    x = is_max ? _mm_max_ss(x, y) : _mm_add_ss(x, y);
    return _mm_cvtss_f32(x);
}
static inline float hmax(vf v) { return hreduce(v, 1); }
static inline float hsum(vf v) { return hreduce(v, 0); }
#else
static inline vf vmax(vf a, vf b) {
    for (int j = 0; j < VL; j++) a[j] = b[j] > a[j] ? b[j] : a[j];
    return a;
}
static inline float hmax(vf v) {
    float m = v[0];
    for (int j = 1; j < VL; j++) m = v[j] > m ? v[j] : m;
    return m;
}
static inline float hsum(vf v) {
    float s = 0.0f;
    for (int j = 0; j < VL; j++) s += v[j];
    return s;
}
#endif
#endif
#define KV_VECS (TILE_K / VL)      /* score vectors per query vector and key tile */
#define PV_COLS (32 / VL)          /* column vectors of V summed at once: 32 columns */

#define TILE_MAX_D 256         /* head sizes the tiles take: multiples of 32 up to this */
static inline int tile_supported(int64_t D) { return D % 32 == 0 && D <= TILE_MAX_D; }
/* The row a key past a tile's end reads (K, and V where vdpbf16ps pairs the keys): zeros. */
static const float tile_zero[TILE_MAX_D] __attribute__((aligned(64)));

typedef int32_t vi __attribute__((vector_size(VL * 4), aligned(VL * 4)));

/* exp of x <= 0, inline: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial (~1 ulp);
 * below -87 (masked keys) exactly 0. A call to libm's vector expf per vector cost ~15% of
 * the tile. */
static inline vf vexp(vf x) {
    const vi under = x < -87.0f;
    x = (vf)(((vi)x & ~under) | ((vi)((vf){0} - 87.0f) & under));
    /* n = round(x / ln2): x <= 0, so truncating x / ln2 - 0.5 rounds (to within 1/2). */
    const vi ni = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);
    const vf r = x - __builtin_convertvector(ni, vf) * 0.693147181f;
    vf p = r * (1.0f / 720) + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi pow2 = (ni + 127) << 23;
    return (vf)((vi)(p * (vf)pow2) & ~under);
}

/* Two bfloat16 values (an even dimension and the next) as one 32-bit word, the pair that
 * vdpbf16ps multiplies per lane. */
static inline uint32_t pair_word(const void *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* The tiles' scores by vdpbf16ps (DOT, bfloat16 queries and cache): qw [R][D / 2] and the key
 * tile kw [D / 2][TILE_K] as pairs of dimensions, p [R][TILE_K] = scale q k. Products of two
 * bfloat16 are exact in float32, so the sums are float32 sums as the FMAs' are, in another
 * order (pairs), with denormals flushed to 0, and the scale multiplies the sum instead of
 * the query. */
#if VL == 16 && defined(__AVX512BF16__)
#define TILE_DOT 1
static inline void tile_scores_dot(const uint32_t *qw, const uint32_t *kw, float *p, int64_t R,
                                   int64_t D, float scale) {
    for (int64_t r0 = 0; r0 < R; r0 += QK_ROWS) {
        __m512 acc[QK_ROWS][KV_VECS];
        for (int rr = 0; rr < QK_ROWS; rr++)
            for (int v = 0; v < KV_VECS; v++) acc[rr][v] = _mm512_setzero_ps();
        const uint32_t *q0 = qw + r0 * (D / 2);
        for (int64_t d2 = 0; d2 < D / 2; d2++) {
            __m512bh kv[KV_VECS];
            for (int v = 0; v < KV_VECS; v++)
                kv[v] = (__m512bh)_mm512_loadu_si512(kw + d2 * TILE_K + v * VL);
            for (int rr = 0; rr < QK_ROWS; rr++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)q0[rr * (D / 2) + d2]);
                for (int v = 0; v < KV_VECS; v++)
                    acc[rr][v] = _mm512_dpbf16_ps(acc[rr][v], kv[v], b);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int rr = 0; rr < QK_ROWS; rr++)
            for (int v = 0; v < KV_VECS; v++)
                _mm512_storeu_ps(p + (r0 + rr) * TILE_K + v * VL, _mm512_mul_ps(acc[rr][v], sc));
    }
}

/* P V by vdpbf16ps too: the tile's V rows interleaved by pairs of keys, vw [TILE_K / 2][D]
 * words (key 2i's value and key 2i + 1's at each column; a key past the tile's end reads
 * tile_zero),
 * and each row's P rounded to bfloat16 pairs in place (p row r's first TILE_K / 2 words), as
 * flash attention's P V runs on GPUs; the softmax's sums stay those of the float32 P. */
static inline void tile_v_pairs(const uint16_t *const *rows, int64_t D, uint32_t *vw) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < TILE_K / 2; i++) {
        const uint16_t *a = rows[2 * i], *b = rows[2 * i + 1];
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
            _mm512_storeu_si512(vw + i * D + c, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(vw + i * D + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

static inline void tile_p_pairs(float *p, int64_t R) {
    for (int64_t r = 0; r < R; r++) {
        const __m512 p0 = _mm512_loadu_ps(p + r * TILE_K);
        const __m512 p1 = _mm512_loadu_ps(p + r * TILE_K + 16);
        _mm512_storeu_si512(p + r * TILE_K, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
}

static inline void tile_pv_dot(const float *p, const uint32_t *vw, float *o, int64_t R,
                               int64_t D, int64_t nk) {
    for (int64_t r0 = 0; r0 < R; r0 += PV_ROWS)       /* P row r: TILE_K / 2 pair words */
        for (int64_t c = 0; c < D; c += 32) {
            __m512 acc[PV_ROWS][2];
            for (int rr = 0; rr < PV_ROWS; rr++)
                for (int v = 0; v < 2; v++)
                    acc[rr][v] = _mm512_loadu_ps(o + (r0 + rr) * D + c + v * 16);
            for (int64_t i = 0; i < (nk + 1) / 2; i++) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vw + i * D + c);
                const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vw + i * D + c + 16);
                for (int rr = 0; rr < PV_ROWS; rr++) {
                    const uint32_t pair = pair_word(p + (r0 + rr) * TILE_K + i);
                    const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
                    acc[rr][0] = _mm512_dpbf16_ps(acc[rr][0], v0, b);
                    acc[rr][1] = _mm512_dpbf16_ps(acc[rr][1], v1, b);
                }
            }
            for (int rr = 0; rr < PV_ROWS; rr++)
                for (int v = 0; v < 2; v++)
                    _mm512_storeu_ps(o + (r0 + rr) * D + c + v * 16, acc[rr][v]);
        }
}
#else                                                /* never called: DOT needs TILE_DOT */
static inline void tile_scores_dot(const uint32_t *qw, const uint32_t *kw, float *p, int64_t R,
                                   int64_t D, float scale) {
    (void)qw, (void)kw, (void)p, (void)R, (void)D, (void)scale;
}
static inline void tile_v_pairs(const uint16_t *const *rows, int64_t D, uint32_t *vw) {
    (void)rows, (void)D, (void)vw;
}
static inline void tile_p_pairs(float *p, int64_t R) { (void)p, (void)R; }
static inline void tile_pv_dot(const float *p, const uint32_t *vw, float *o, int64_t R,
                               int64_t D, int64_t nk) {
    (void)p, (void)vw, (void)o, (void)R, (void)D, (void)nk;
}
#endif

/* m[i][e] -> m[e][i]: VL vectors of VL floats transposed in registers, by swapping the
 * off-diagonal s x s blocks for s = VL / 2 .. 1 (log2 VL rounds of VL two-source shuffles). */
static inline __attribute__((always_inline)) void transpose_vl(vf m[VL]) {
    _Pragma("GCC unroll 4") for (int s = VL / 2; s >= 1; s /= 2) {
        vi top, bottom;
        for (int e = 0; e < VL; e++) {
            top[e] = e & s ? VL + e - s : e;
            bottom[e] = e & s ? VL + e : e + s;
        }
        _Pragma("GCC unroll 16") for (int i = 0; i < VL; i++)
            if (!(i & s)) {
                const vf a = m[i], b = m[i + s];
                m[i] = __builtin_shuffle(a, b, top);
                m[i + s] = __builtin_shuffle(a, b, bottom);
            }
    }
}

/* The key tile transposed, kt[d][j] = rows[j][d] * ks[j] (TILE_K rows of D). With AVX-512,
 * VL x VL blocks at a time: each block's rows widened as vectors, transposed in registers
 * (vpermt2ps), stored as vectors; the scalar loop storing TILE_K apart took 10-14% of the
 * float32 tiles' time, and this 4-5% less on an AMD EPYC Zen 5 (a 2048-token prompt 17.6 ->
 * 16.8 ms a layer). AVX2 has no two-source permute: there the blocks ran 3-5% slower than
 * the scalar loop, which it keeps. */
#define DEFINE_TILE_KT(NAME, TK, LOADK)                                                       \
static inline void NAME(const TK *const *rows, const float *ks, int64_t D, float *kt) {      \
    if (VL != 16) {                                                                           \
        for (int64_t j = 0; j < TILE_K; j++)                                                  \
            for (int64_t d = 0; d < D; d++) kt[d * TILE_K + j] = LOADK(rows[j][d]) * ks[j];   \
        return;                                                                               \
    }                                                                                         \
    for (int64_t d0 = 0; d0 < D; d0 += VL)                                                    \
        for (int64_t j0 = 0; j0 < TILE_K; j0 += VL) {                                         \
            vf m[VL];                                                                         \
            for (int i = 0; i < VL; i++) {                                                   \
                const TK *row = rows[j0 + i] + d0;                                            \
                const float sc = ks[j0 + i];                                                  \
                _Pragma("omp simd")                                                           \
                for (int e = 0; e < VL; e++) m[i][e] = LOADK(row[e]) * sc;                    \
            }                                                                                 \
            transpose_vl(m);                                                                  \
            for (int i = 0; i < VL; i++) *(vf *)(kt + (d0 + i) * TILE_K + j0) = m[i];        \
        }                                                                                     \
}

/* Query vectors of a tile padded to whole register blocks (QK_ROWS, PV_ROWS divide 8). */
static inline int64_t padded_rows(int64_t n) { return (n + 7) / 8 * 8; }

/* Scratch floats a tile task needs. */
static inline int64_t tile_scratch(int64_t group, int64_t D) {
    const int64_t R = padded_rows(TILE_Q * group);
    return 2 * R * D + R * TILE_K + 2 * TILE_K * D + (VL + 1) * R;
}

/* Rows first .. first + rows - 1 of one request (contexts ctx0 .. ctx0 + rows - 1) for one KV
 * head: q/out point at the first row's first head of the group; rows are row_stride apart.
 * Query vector r is row r / group, head r % group. */
#define DEFINE_TILE_TASK(NAME, T, LOAD, STORE, TK, LOADK, DOT, KT)                            \
static void NAME(const T *q, T *out, int64_t row_stride, const TK *k_head, const TK *v_head, \
                 const int32_t *table, int64_t ctx0, int64_t rows, int64_t bs,               \
                 int64_t group, int64_t D, float scale, float *scratch) {                     \
    const int64_t nr = rows * group;                                                          \
    const int64_t R = padded_rows(nr);                                                        \
    float *qf = scratch, *o = qf + R * D, *p = o + R * D, *kt = p + R * TILE_K;               \
    float *vt = kt + TILE_K * D, *lsum = vt + TILE_K * D, *mx = lsum + VL * R;               \
    uint32_t *qw = (uint32_t *)qf, *kw = (uint32_t *)kt;  /* DOT: bfloat16 pairs, unscaled */ \
    for (int64_t r = 0; r < R; r++) {                                                         \
        const T *qr = q + (r / group) * row_stride + (r % group) * D;                        \
        if (DOT)                                                                              \
            for (int64_t d = 0; d < D; d += 2)                                                \
                qw[r * (D / 2) + d / 2] = r < nr ? pair_word(qr + d) : 0u;                    \
        else                                                                                  \
            for (int64_t d = 0; d < D; d++) qf[r * D + d] = r < nr ? LOAD(qr[d]) * scale : 0.0f; \
        mx[r] = MASKED;                                                                       \
    }                                                                                         \
    memset(o, 0, sizeof(float) * (size_t)(R * D));                                            \
    memset(lsum, 0, sizeof(float) * (size_t)(VL * R));                                        \
    const int64_t kend = ctx0 + rows - 1;             /* keys the last row sees */           \
    const int64_t RS = D + KV_EXTRA(TK);              /* a cache row's elements */           \
    const TK *vrows[TILE_K], *krows[TILE_K];          /* the tile's rows (DOT: V's only) */  \
    float kscale[TILE_K];                             /* the K rows' scales (int8) */        \
    for (int64_t k0 = 0; k0 < kend; k0 += TILE_K) {                                           \
        const int64_t nk = kend - k0 < TILE_K ? kend - k0 : TILE_K;                           \
        for (int64_t j = 0; j < TILE_K; j++) {                                                \
            if (j < nk) {                                                                     \
                const int64_t t = k0 + j;                                                     \
                const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;                    \
                const TK *kr = k_head + slot * RS, *vr = v_head + slot * RS;                 \
                prefetch_key(k_head, table, t + TILE_K, kend, bs, RS * (int64_t)sizeof(TK));  \
                prefetch_key(v_head, table, t + TILE_K, kend, bs, RS * (int64_t)sizeof(TK));  \
                const float ks = ROW_SCALE(TK, kr, D), vs = ROW_SCALE(TK, vr, D);            \
                if (DOT)                                                                      \
                    for (int64_t d = 0; d < D; d += 2)                                        \
                        kw[(d / 2) * TILE_K + j] = pair_word(kr + d);                         \
                krows[j] = kr, kscale[j] = ks;                                                \
                vrows[j] = vr;                                                                \
                if (!DOT) {                                                                   \
                    _Pragma("omp simd")                                                       \
                    for (int64_t d = 0; d < D; d++) vt[j * D + d] = LOADK(vr[d]) * vs;        \
                }                                                                             \
            } else {                                                                          \
                krows[j] = vrows[j] = (const TK *)tile_zero, kscale[j] = 0.0f;                \
                for (int64_t d = 0; d < D; d++) kt[d * TILE_K + j] = vt[j * D + d] = 0.0f;   \
            }                                                                                 \
        }                                                                                     \
        if (!DOT) KT(krows, kscale, D, kt);                                                   \
        /* Scores: QK_ROWS query vectors at a time against the TILE_K keys (DOT: by        \
         * vdpbf16ps, two dimensions x VL keys an instruction; tile_scores_dot). */           \
        if (DOT) tile_scores_dot(qw, kw, p, R, D, scale);                                     \
        else for (int64_t r0 = 0; r0 < R; r0 += QK_ROWS) {                                    \
            vf acc[QK_ROWS][KV_VECS];                                                         \
            for (int rr = 0; rr < QK_ROWS; rr++)                                              \
                for (int v = 0; v < KV_VECS; v++) acc[rr][v] = (vf){0};                       \
            const float *q0 = qf + r0 * D;                                                    \
            for (int64_t d = 0; d < D; d++) {                                                 \
                vf kv[KV_VECS];                                                               \
                for (int v = 0; v < KV_VECS; v++) kv[v] = *(const vf *)(kt + d * TILE_K + v * VL); \
                for (int rr = 0; rr < QK_ROWS; rr++)                                          \
                    for (int v = 0; v < KV_VECS; v++) acc[rr][v] += q0[rr * D + d] * kv[v];   \
            }                                                                                 \
            for (int rr = 0; rr < QK_ROWS; rr++)                                              \
                for (int v = 0; v < KV_VECS; v++)                                             \
                    *(vf *)(p + (r0 + rr) * TILE_K + v * VL) = acc[rr][v];                    \
        }                                                                                     \
        /* Mask, then online softmax: rescale what was summed when the max grows. */         \
        for (int64_t r = 0; r < nr; r++) {                                                    \
            float *pr = p + r * TILE_K;                                                       \
            const int64_t visible = ctx0 + r / group - k0;    /* keys of this tile it sees */ \
            for (int64_t j = visible < 0 ? 0 : visible; j < TILE_K; j++) pr[j] = MASKED;     \
            vf top = *(vf *)pr;                                                               \
            for (int v = 1; v < KV_VECS; v++) top = vmax(top, *(vf *)(pr + v * VL));          \
            const float m_tile = hmax(top), m_old = mx[r];                                    \
            const float m_new = m_tile > m_old ? m_tile : m_old;                              \
            vf *sum = (vf *)(lsum + VL * r);                                                  \
            if (m_new > m_old) {                                                              \
                const float alpha = expf(m_old - m_new);                                      \
                *sum *= alpha;                                                                \
                for (int64_t c = 0; c < D; c += VL) *(vf *)(o + r * D + c) *= alpha;          \
                mx[r] = m_new;                                                                \
            }                                                                                 \
            for (int v = 0; v < KV_VECS; v++) {                                               \
                const vf e = vexp(*(vf *)(pr + v * VL) - m_new);                              \
                *(vf *)(pr + v * VL) = e;                                                     \
                *sum += e;                                                                    \
            }                                                                                 \
        }                                                                                     \
        /* o += P V: PV_ROWS query vectors x 32 columns of accumulators in registers (DOT: \
         * by vdpbf16ps over pairs of keys, P rounded to bfloat16; tile_pv_dot). */           \
        if (DOT) {                                                                            \
            tile_v_pairs((const uint16_t *const *)vrows, D, (uint32_t *)vt);                  \
            tile_p_pairs(p, R);                                                               \
            tile_pv_dot(p, (const uint32_t *)vt, o, R, D, nk);                                \
        } else                                                                                \
        for (int64_t r0 = 0; r0 < R; r0 += PV_ROWS) {                                         \
            for (int64_t c = 0; c < D; c += 32) {                                             \
                vf acc[PV_ROWS][PV_COLS];                                                     \
                for (int rr = 0; rr < PV_ROWS; rr++)                                          \
                    for (int v = 0; v < PV_COLS; v++)                                         \
                        acc[rr][v] = *(vf *)(o + (r0 + rr) * D + c + v * VL);                 \
                for (int64_t j = 0; j < nk; j++) {                                            \
                    vf vv[PV_COLS];                                                           \
                    for (int v = 0; v < PV_COLS; v++) vv[v] = *(const vf *)(vt + j * D + c + v * VL); \
                    for (int rr = 0; rr < PV_ROWS; rr++) {                                    \
                        const float pj = p[(r0 + rr) * TILE_K + j];                           \
                        for (int v = 0; v < PV_COLS; v++) acc[rr][v] += pj * vv[v];           \
                    }                                                                         \
                }                                                                             \
                for (int rr = 0; rr < PV_ROWS; rr++)                                          \
                    for (int v = 0; v < PV_COLS; v++)                                         \
                        *(vf *)(o + (r0 + rr) * D + c + v * VL) = acc[rr][v];                 \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t r = 0; r < nr; r++) {                                                        \
        T *orow = out + (r / group) * row_stride + (r % group) * D;                          \
        const float inv = 1.0f / hsum(*(vf *)(lsum + VL * r));                                  \
        for (int64_t d = 0; d < D; d++) orow[d] = STORE(o[r * D + d] * inv);                  \
    }                                                                                         \
}

DEFINE_TILE_KT(tile_kt_bf16, uint16_t, bf16_to_f32)
DEFINE_TILE_KT(tile_kt_f32, float, f32_to_f32)
DEFINE_TILE_TASK(tile_task_bf16_fma, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, bf16_to_f32, 0,
                 tile_kt_bf16)
DEFINE_TILE_TASK(tile_task_f32, float, f32_to_f32, f32_to_f32, float, f32_to_f32, 0, tile_kt_f32)
DEFINE_TILE_TASK(tile_task_f32_kv_bf16, float, f32_to_f32, f32_to_f32, uint16_t, bf16_to_f32, 0,
                 tile_kt_bf16)

/* bfloat16 tiles: scores and P V by vdpbf16ps where set_tile_dot turned it on (the library's
 * loader does on AMD CPUs with AVX512-BF16), else float32 FMAs. Read by every tile task: set
 * it between kernel calls only. */
#ifdef TILE_DOT
static int tile_dot = 0;
DEFINE_TILE_TASK(tile_task_bf16_dot, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, bf16_to_f32, 1,
                 tile_kt_bf16)
#endif
static void tile_task_bf16(const uint16_t *q, uint16_t *out, int64_t row_stride,
                           const uint16_t *k_head, const uint16_t *v_head, const int32_t *table,
                           int64_t ctx0, int64_t rows, int64_t bs, int64_t group, int64_t D,
                           float scale, float *scratch) {
#ifdef TILE_DOT
    if (tile_dot) {
        tile_task_bf16_dot(q, out, row_stride, k_head, v_head, table, ctx0, rows, bs, group, D,
                           scale, scratch);
        return;
    }
#endif
    tile_task_bf16_fma(q, out, row_stride, k_head, v_head, table, ctx0, rows, bs, group, D,
                       scale, scratch);
}

/* Turn the bfloat16 tiles' vdpbf16ps scores and P V (P rounded to bfloat16) on (1) or off
 * (0), between kernel calls; returns 1 where this build has them (AVX512-BF16), else 0 (and
 * they stay off). */
int set_tile_dot(int on) {
#ifdef TILE_DOT
    tile_dot = on != 0;
    return 1;
#else
    (void)on;
    return 0;
#endif
}

/* --- Decode rows, every ISA ------------------------------------------------------------------
 * One (query row, KV head) pair: `group` query heads against `ctx` keys, each key and value
 * row read once where it lies. DEFINE_TASK scores a key at a time (a dot product and a
 * horizontal sum per query head) and adds each weighted V row into sums in memory; the
 * AVX512-BF16 path that bfloat16 caches had (vdpbf16ps, 16 keys at a time) kept a division
 * per key in its prefetch. Here VL keys go at once: SCORE_KEYS key rows x SCORE_HEADS query
 * heads of partial vectors in registers (each row widened once per 3 heads, straight from
 * the cache), each head's VL partial vectors summed by one transpose (sum_lanes), exp
 * vectorised (vexp), P V summed into registers (each head's weight broadcast once a key, so
 * AVX2's 16 registers hold the 12 sums without a spill), blocks walked without a division,
 * and the rows two blocks ahead fetched into L2. With the cache in L2 a (row, KV head) pair of
 * SmolLM2's (3 heads of 64, 400 keys) went from 14 to 24.5 GB/s of K/V on AVX-512 and from
 * 14 to 16.6 on AVX2 (one thread); over 30 layers' caches from memory, 32 rows
 * (benchmarks/cpu_kernels.py --batch 32, blocks in runs): AVX-512 without BF16 26 -> 22 ms
 * a step, AVX512-BF16 bfloat16 25 -> 22, AVX2 23.3 -> 24.8 (the 32-request workload's decode
 * steps there unchanged within the noise). Scores, softmax and sums in float32 (bfloat16
 * queries are widened), in an order that does not depend on the batch. Needs
 * tile_supported(D). The score sums in registers and P V without a spill (before: a buffer of
 * widened rows, and one of AVX2's 12 sums stored and reloaded every key) measured on AVX2
 * (AMD EPYC Zen 3): in-engine, one request at 1000 keys, 2.44 -> 2.31 ms of attention a step;
 * 32 rows at 400 keys over 30 layers 29.6 -> 28.4 ms; a pair with its cache in L2, 1.25x. */
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));   /* unaligned loads */
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
static inline vf loadv_bf16(const uint16_t *p) {
#if VL == 16
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh *)p, vi) << 16);
#endif
}
static inline vf loadv_f32(const float *p) { return (vf) * (const vfu *)p; }
typedef int8_t vb8 __attribute__((vector_size(VL), aligned(1)));
static inline vf loadv_i8(const int8_t *p) {
#if VL == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const vb8 *)p, vf);
#endif
}

/* r[j] = the sum of v[j]'s lanes: a transpose tree, not a horizontal sum per vector. */
static inline vf sum_lanes(const vf v[VL]) {
#if VL == 16
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)      /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]),
                             _mm512_unpackhi_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {    /* per 128-bit lane: that lane's sums of 4 vectors */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)      /* add 128-bit lanes pairwise */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                             _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
#elif defined(__AVX__)
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = _mm256_hadd_ps((__m256)v[2 * i], (__m256)v[2 * i + 1]);
    for (int i = 0; i < 2; i++) b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                             _mm256_permute2f128_ps(b[0], b[1], 0x31));
#else
    vf r;
    for (int j = 0; j < VL; j++) r[j] = hsum(v[j]);
    return r;
#endif
}

/* Key row `off` of block `blk` + ROW_AHEAD, if the context has it, into L2: a request's blocks
 * lie anywhere, and the hardware prefetcher alone kept too few reads in flight. L2 rather
 * than prefetch_key's L1: a T0 prefetch holds one of the core's few L1 fill buffers until
 * its line arrives. The score pass fetches each key's V row too (the P V pass then reads V
 * from L2), and row_start the first ROW_AHEAD blocks of both, which row_prefetch never
 * reaches: 32 rows over 30 layers' caches from memory went 20.5 -> 19.0 ms on AVX-512
 * without BF16, 25.1 -> 22.9 on AVX2 (blocks in runs; scattered 26.4 -> 25.6), one
 * process alternating both builds; 4 blocks ahead was no better than 2. */
#define ROW_AHEAD 2
static inline void row_prefetch(const void *head, const int32_t *table, int64_t blk,
                                int64_t off, int64_t ctx, int64_t bs, int64_t row_bytes) {
    if ((blk + ROW_AHEAD) * bs < ctx) {
        const int64_t at = ((int64_t)table[blk + ROW_AHEAD] * bs + off) * row_bytes;
        prefetch_bytes((const char *)head + at, row_bytes, 1);
    }
}

/* Rows [tb, tb + ROW_AHEAD blocks) of K and V into L2: the rows row_prefetch does not reach. */
static inline void row_start(const void *k_head, const void *v_head, const int32_t *table,
                             int64_t tb, int64_t te, int64_t bs, int64_t row_bytes) {
    const int64_t end = te < (tb / bs + ROW_AHEAD) * bs ? te : (tb / bs + ROW_AHEAD) * bs;
    for (int64_t t = tb; t < end;) {
        const int64_t blk = t / bs, n = ((blk + 1) * bs < end ? (blk + 1) * bs : end) - t;
        const int64_t at = ((int64_t)table[blk] * bs + t % bs) * row_bytes;
        prefetch_bytes((const char *)k_head + at, n * row_bytes, 1);
        prefetch_bytes((const char *)v_head + at, n * row_bytes, 1);
        t += n;
    }
}

/* P V a pass: ROW_PASS_HEADS query heads x 4 column vectors of V, the sums in registers
 * (AVX-512: 16 of 32; AVX2: 12 of 16), or 2 column vectors where head_dim is not a multiple
 * of 4 VL. */
#define ROW_HEADS 4
#define ROW_COLS 4
#define ROW_PASS_HEADS (VL == 16 ? 4 : 3)
#define SCORE_HEADS 3            /* query heads x SCORE_KEYS keys of score sums in registers */
#define SCORE_KEYS (VL == 16 ? 8 : 4)

/* The next task's rows, fetched into L2 while this task sums P V. The score pass reads K and
 * V from memory (row_prefetch); the softmax and the P V pass (V already in L2) then leave
 * memory idle, and the next task starts with a wait, longest where its blocks lie apart
 * (each a new stream to the hardware prefetcher). So each P V step
 * fetches one key row of K and V of the task this thread will likely take next (ahead_of);
 * of a run of consecutive blocks only its first block (the hardware prefetcher streams the
 * rest). 32 rows of ~400 keys over 30 layers' caches (benchmarks/cpu_kernels.py --batch 32
 * --context 400 --layers 30 --huge-pages, AMD EPYC Zen 5, 2 threads), while the VM's memory
 * was slow (scattered blocks took 12+ ms): blocks scattered 12.2 -> 10.4 ms, in runs 9.1 ->
 * 8.5; the AVX2 build 12.2 -> 11.9 and 9.5 -> 9.1 (alternating, 4 pairs each). Later, with
 * memory faster (scattered 10 ms before): the same, within the noise (6 pairs); fetching
 * the runs' other blocks too was no better (3 pairs). */
typedef struct {
    const char *k, *v;             /* the next task's KV head */
    const int32_t *table;
    int64_t left, blk, off, bs, row_bytes;   /* rows still to fetch; the next one's place */
    int64_t first;                 /* its first block */
} Ahead;
static inline void ahead_step(Ahead *a) {
    if (a == NULL || a->left <= 0) return;
    if (a->off == 0 && a->blk > a->first && a->table[a->blk] == a->table[a->blk - 1] + 1) {
        a->left -= a->bs, a->blk++;      /* a run goes on: the hardware prefetcher has it */
        return;
    }
    const int64_t at = ((int64_t)a->table[a->blk] * a->bs + a->off) * a->row_bytes;
    prefetch_bytes(a->k + at, a->row_bytes, 1);
    prefetch_bytes(a->v + at, a->row_bytes, 1);
    a->left--;
    if (++a->off == a->bs) a->off = 0, a->blk++;
}

/* acc[g] = sum over keys t in [tb, te) of p[g][t - tb] V[t], for G heads (scores ctx16
 * apart) and C VL columns from c0 on. */
#define DEFINE_ROW_V(NAME, TK, LOADV)                                                          \
static inline __attribute__((always_inline)) void NAME(                                       \
        const TK *v_head, const int32_t *table, int64_t tb, int64_t te, int64_t bs, int64_t D, \
        const float *scores, int64_t ctx16, int64_t c0, float *acc, const int G,               \
        const int C, Ahead *ahead) {                                                          \
    vf a[ROW_HEADS][ROW_COLS];                                                                \
    for (int g = 0; g < G; g++)                                                               \
        for (int c = 0; c < C; c++) a[g][c] = (vf){0};                                        \
    const int64_t RS = D + KV_EXTRA(TK);                                                      \
    for (int64_t start = tb, blk = tb / bs, off = tb % bs; start < te; start += bs - off,    \
         blk++, off = 0) {                                /* runs of one block's rows */     \
        const int64_t n = te - start < bs - off ? te - start : bs - off;                      \
        const TK *row = v_head + ((int64_t)table[blk] * bs + off) * RS + c0;                 \
        const float *sc = scores + start - tb;                                                \
        for (int64_t t = 0; t < n; t++, row += RS) {                                          \
            vf p[ROW_HEADS];                                                                  \
            ahead_step(ahead);                                                                \
            const float vs = ROW_SCALE(TK, row - c0, D);                                      \
            for (int g = 0; g < G; g++) p[g] = (vf){0} + sc[g * ctx16 + t] * vs;              \
            for (int c = 0; c < C; c++) {                                                     \
                const vf v = LOADV(row + c * VL);                                             \
                for (int g = 0; g < G; g++) a[g][c] += p[g] * v;                              \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int g = 0; g < G; g++)                                                               \
        for (int c = 0; c < C; c++) *(vf *)(acc + g * D + c0 + c * VL) = a[g][c];             \
}

/* The task over keys [tb, te) of the context: DEFINE_TASK's arguments and results (qf, acc
 * 64-byte aligned; scores [group, ctx16], ctx16 = te - tb rounded up to 16). With ml NULL,
 * acc is divided by the softmax's sums; else (a segment of a split context, see the kernel)
 * acc is left undivided and ml[g], ml[group + g] get head g's largest score and its sum of
 * exps. */
#define DEFINE_ROW_TASK(NAME, TK, LOADV)                                                       \
DEFINE_ROW_V(NAME##_v, TK, LOADV)                                                             \
/* parts[g][j] = the lane-wise products of query head g (G heads of qf, D apart) and key row  \
 * rows[j], summed over the head's VL-wide column vectors: SCORE_KEYS keys x G heads of sums  \
 * in registers at a time, each key row widened once per G heads. */                         \
static inline __attribute__((always_inline)) void NAME##_s(                                   \
        const float *qf, const TK *const *rows, const int64_t D, vf (*parts)[VL], const int G) { \
    for (int j0 = 0; j0 < VL; j0 += SCORE_KEYS) {                                             \
        vf a[SCORE_HEADS][SCORE_KEYS];                                                        \
        for (int g = 0; g < G; g++)                                                           \
            for (int j = 0; j < SCORE_KEYS; j++) a[g][j] = (vf){0};                           \
        for (int64_t c = 0; c < D; c += VL)                                                   \
            for (int j = 0; j < SCORE_KEYS; j++) {                                            \
                const vf k = LOADV(rows[j0 + j] + c);                                         \
                for (int g = 0; g < G; g++) a[g][j] += *(const vf *)(qf + g * D + c) * k;    \
            }                                                                                 \
        for (int g = 0; g < G; g++)                                                           \
            for (int j = 0; j < SCORE_KEYS; j++) parts[g][j0 + j] = a[g][j];                  \
    }                                                                                         \
}                                                                                             \
static inline __attribute__((always_inline)) void NAME##_d(                                   \
        const float *qf, const TK *k_head, const TK *v_head, const int32_t *table, int64_t tb, \
        int64_t te, int64_t bs, int64_t group, const int64_t D, float *scores, float *acc,   \
        float *ml, Ahead *ahead) {                                                            \
    const int64_t ctx = te - tb, ctx16 = (ctx + 15) & ~(int64_t)15, nv = D / VL;             \
    /* the VL keys' rows (a zero row past the context), their partial sums per head */     \
    static const TK zero_row[256 + 4] __attribute__((aligned(64)));   /* + an int8 scale */  \
    const int64_t RS = D + KV_EXTRA(TK), row_bytes = RS * (int64_t)sizeof(TK);               \
    const TK *rows[VL];                                                                       \
    vf parts[MAX_GROUP][VL];                                                                  \
    vf top[MAX_GROUP];                                                                        \
    for (int64_t g = 0; g < group; g++) top[g] = (vf){0} + MASKED;                            \
    row_start(k_head, v_head, table, tb, te, bs, row_bytes);                                  \
    for (int64_t t0 = 0, blk = tb / bs, off = tb % bs; t0 < ctx; t0 += VL) {                  \
        const int64_t n = ctx - t0 < VL ? ctx - t0 : VL;                                      \
        for (int64_t j = 0; j < VL; j++) {                                                    \
            if (j >= n) {                                                                     \
                rows[j] = zero_row;                                                           \
                continue;                                                                     \
            }                                                                                 \
            row_prefetch(k_head, table, blk, off, te, bs, row_bytes);                         \
            row_prefetch(v_head, table, blk, off, te, bs, row_bytes);                         \
            rows[j] = k_head + ((int64_t)table[blk] * bs + off) * RS;                        \
            if (++off == bs) off = 0, blk++;                                                  \
        }                                                                                     \
        for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {                                 \
            const int64_t gn = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;           \
            _Pragma("GCC unroll 4") for (int G = 1; G <= SCORE_HEADS; G++)                   \
                if (gn == G) NAME##_s(qf + g0 * D, rows, D, parts + g0, G);                   \
        }                                                                                     \
        vi lane;                                                                              \
        for (int j = 0; j < VL; j++) lane[j] = j;                                             \
        const vi valid = lane < (int32_t)n;                                                   \
        vf ks = (vf){0} + 1.0f;                        /* the keys' int8 scales */           \
        if (KV_EXTRA(TK))                                                                     \
            for (int j = 0; j < VL; j++) ks[j] = ROW_SCALE(TK, rows[j], D);                   \
        for (int64_t g = 0; g < group; g++) {                                                 \
            vf s = sum_lanes(parts[g]) * ks;                                                  \
            s = (vf)(((vi)s & valid) | ((vi)((vf){0} + MASKED) & ~valid));                   \
            *(vf *)(scores + g * ctx16 + t0) = s;                                             \
            top[g] = vmax(top[g], s);                                                         \
        }                                                                                     \
    }                                                                                         \
    float inv[MAX_GROUP];                                                                     \
    for (int64_t g = 0; g < group; g++) {                                                     \
        const float m = hmax(top[g]);                                                         \
        vf sum = (vf){0};                                                                     \
        for (int64_t t0 = 0; t0 < ctx; t0 += VL) {                                            \
            vf *sv = (vf *)(scores + g * ctx16 + t0);                                         \
            *sv = vexp(*sv - m);                                                              \
            sum += *sv;                                                                       \
        }                                                                                     \
        inv[g] = 1.0f / hsum(sum);                                                            \
        if (ml) ml[g] = m, ml[group + g] = hsum(sum);                                         \
    }                                                                                         \
    const int wide = D % (4 * VL) == 0;                                                       \
    const int64_t hp = ROW_PASS_HEADS;                                                        \
    for (int64_t g0 = 0; g0 < group; g0 += hp)                                                \
        for (int64_t c0 = 0; c0 < D; c0 += (wide ? 4 : 2) * VL) {                             \
            const float *sc = scores + g0 * ctx16;                                            \
            float *ac = acc + g0 * D;                                                         \
            const int64_t gn = group - g0 < hp ? group - g0 : hp;                             \
            /* constant G and C in each call, so that the sums stay in registers */        \
            _Pragma("GCC unroll 4") for (int G = 1; G <= ROW_HEADS; G++)                     \
                if (gn == G) {                                                                \
                    if (wide) NAME##_v(v_head, table, tb, te, bs, D, sc, ctx16, c0, ac, G, 4, \
                                       ahead);                                                \
                    else NAME##_v(v_head, table, tb, te, bs, D, sc, ctx16, c0, ac, G, 2,      \
                                  ahead);                                                     \
                }                                                                             \
        }                                                                                     \
    if (ml) return;                                                                           \
    for (int64_t g = 0; g < group; g++)                                                       \
        for (int64_t c = 0; c < nv; c++) *(vf *)(acc + g * D + c * VL) *= inv[g];             \
}                                                                                             \
/* A constant head_dim lets the compiler unroll the loops over it. */                       \
static void NAME(const float *qf, const TK *k_head, const TK *v_head, const int32_t *table,  \
                 int64_t tb, int64_t te, int64_t bs, int64_t group, int64_t D, float *scores, \
                 float *acc, float *ml, Ahead *ahead) {                                      \
    if (D == 64)                                                                              \
        NAME##_d(qf, k_head, v_head, table, tb, te, bs, group, 64, scores, acc, ml, ahead);   \
    else if (D == 128)                                                                        \
        NAME##_d(qf, k_head, v_head, table, tb, te, bs, group, 128, scores, acc, ml, ahead);  \
    else NAME##_d(qf, k_head, v_head, table, tb, te, bs, group, D, scores, acc, ml, ahead);   \
}

DEFINE_ROW_TASK(row_task_vec_bf16, uint16_t, loadv_bf16)
DEFINE_ROW_TASK(row_task_vec_f32, float, loadv_f32)

/* The kernel's work items: (first entry, number of rows). A run of at least TILE_MIN_ROWS
 * entries that are one request's consecutive rows (one table row, consecutive q rows,
 * contexts one apart) is cut into tiles of TILE_Q rows; any other entry is an item alone. */
static int64_t work_items(const int32_t *table_rows, const int32_t *context_lens,
                          const int64_t *q_rows, int64_t num_entries, int tiles, int64_t *items) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_entries;) {
        int64_t j = i + 1;
        while (j < num_entries && table_rows[j] == table_rows[i] && q_rows[j] == q_rows[j - 1] + 1
               && context_lens[j] == context_lens[j - 1] + 1)
            j++;
        const int64_t step = tiles && j - i >= TILE_MIN_ROWS ? TILE_Q : 1;
        for (int64_t t = i; t < j; t += step) {
            items[2 * n] = t;
            items[2 * n + 1] = j - t < step ? j - t : step;
            n++;
        }
        i = j;
    }
    return n;
}

/* The work items the kernel makes of these entries, for tests: writes up to num_entries
 * (first entry, rows) pairs to items and returns how many. */
int64_t attention_work_items(const int32_t *table_rows, const int32_t *context_lens,
                             const int64_t *q_rows, int64_t num_entries, int64_t head_dim,
                             int64_t *items) {
    return work_items(table_rows, context_lens, q_rows, num_entries, tile_supported(head_dim),
                      items);
}

/* Every index the kernel will follow lies inside its tensor: bad metadata is refused, not
 * read or written out of bounds. Every block table entry must be a block id (pad with 0), so
 * the tables are checked once, not once per query row that shares them. */
static int metadata_valid(const int32_t *block_tables, int64_t num_tables,
                          const int32_t *table_rows, const int32_t *context_lens,
                          const int64_t *q_rows, int64_t num_q_rows, int64_t num_entries,
                          int64_t max_blocks, int64_t block_size, int64_t num_slots) {
    const int64_t num_blocks = num_slots / block_size;
    for (int64_t i = 0; i < num_tables * max_blocks; i++)
        if (block_tables[i] < 0 || block_tables[i] >= num_blocks) return 0;
    for (int64_t i = 0; i < num_entries; i++)
        if (table_rows[i] < 0 || table_rows[i] >= num_tables || context_lens[i] < 1
            || context_lens[i] > max_blocks * block_size || q_rows[i] < 0
            || q_rows[i] >= num_q_rows)
            return 0;
    return 1;
}

/* A decode row's context longer than ROW_SEG keys is split into segments of ROW_SEG keys, one
 * task each (as flash-decoding does on GPUs): with one request the (row, KV head) pairs are
 * too few to keep every thread busy (SmolLM2's 3 KV heads on 2 threads: one thread did two
 * of them while the other waited). Each segment leaves its undivided sums and its softmax's
 * largest score and sum of exps; the task that finishes a row's last segment combines them
 * (segments in order). The split depends on the context's length only, never on the batch,
 * so a row's result does not depend on what else is in the step. */
#define ROW_SEG 512

static inline int64_t row_segments(int64_t rows, int64_t ctx, int64_t D) {
    return rows == 1 && tile_supported(D) ? (ctx + ROW_SEG - 1) / ROW_SEG : 1;
}

/* The keys [*tb, *te) a decode row's task reads: segment sg of a split row, else all ctx. */
static inline void segment_keys(int64_t ctx, int64_t sg, int split, int64_t *tb, int64_t *te) {
    *tb = split ? sg * ROW_SEG : 0;
    *te = !split || ctx - *tb < ROW_SEG ? ctx : *tb + ROW_SEG;
}

/* out[g] = the segments' sums, each scaled by exp(its largest score - the largest), over the
 * same of their sums of exps; parts: nseg blocks of `stride` floats, acc [group, D] then ml. */
static void combine_segments(const float *parts, int64_t nseg, int64_t stride, int64_t group,
                             int64_t D, float *out) {
    for (int64_t g = 0; g < group; g++) {
        const float *ml0 = parts + group * D;
        float m = ml0[g], l = 0.0f;
        for (int64_t s = 1; s < nseg; s++) {
            const float ms = (parts + s * stride + group * D)[g];
            m = ms > m ? ms : m;
        }
        for (int64_t s = 0; s < nseg; s++) {
            const float *ml = parts + s * stride + group * D;
            l += expf(ml[g] - m) * ml[group + g];
        }
        float *o = out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t s = 0; s < nseg; s++) {
            const float *part = parts + s * stride;
            const float ws = expf(part[group * D + g] - m) / l;
            for (int64_t d = 0; d < D; d++) o[d] += ws * part[g * D + d];
        }
    }
}

/* The task this thread will likely take next, where it is a decode row's (else NULL): with
 * dynamic scheduling the threads take the tasks in turn, so likely the one as many tasks on
 * as there are threads. Its rows as ahead_step walks them (head_bytes: one KV head's cache). */
static inline Ahead *ahead_of(Ahead *a, const int64_t *tasks, int64_t task, int64_t num_tasks,
                              const int64_t *items, const int32_t *context_lens,
                              const int32_t *block_tables, const int32_t *table_rows,
                              int64_t max_blocks, const char *k_cache, const char *v_cache,
                              int64_t head_bytes, int64_t row_bytes, int64_t bs) {
#ifdef _OPENMP
    const int64_t next = task + omp_get_num_threads();
#else
    const int64_t next = task + 1;
#endif
    if (next >= num_tasks || items[2 * tasks[4 * next] + 1] != 1) return NULL;
    const int64_t seq = items[2 * tasks[4 * next]], ctx = context_lens[seq];
    int64_t tb, te;
    segment_keys(ctx, tasks[4 * next + 1], tasks[4 * next + 3] >= 0, &tb, &te);
    a->k = k_cache + tasks[4 * next + 2] * head_bytes;
    a->v = v_cache + tasks[4 * next + 2] * head_bytes;
    a->table = block_tables + (int64_t)table_rows[seq] * max_blocks;
    a->left = te - tb, a->blk = a->first = tb / bs, a->off = tb % bs;
    a->bs = bs, a->row_bytes = row_bytes;
    return a;
}

/* Paged attention, one query row per entry: entry i is q/out row q_rows[i], reading the
 * block table row table_rows[i] of block_tables [num_tables, max_blocks] (int32) and its first
 * context_lens[i] keys (its own key included). A decode is one entry; a prefill of n new
 * tokens after c cached ones is n entries sharing one table row, with contexts c+1 .. c+n,
 * which is causal attention. */
#define DEFINE_KERNEL(NAME, TASK, ROWV, TILE, T, LOAD, STORE, TK)                               \
int NAME(const T *q, const TK *k_cache, const TK *v_cache, const int32_t *block_tables,       \
         int64_t num_tables, const int32_t *table_rows, const int32_t *context_lens,         \
         const int64_t *q_rows, int64_t num_q_rows, int64_t num_entries, int64_t max_blocks, \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,      \
         int64_t num_slots, float scale, T *out) {                                            \
    const int64_t group = num_heads / num_kv_heads;                                           \
    if (group > MAX_GROUP || group * num_kv_heads != num_heads) return 1;                    \
    if (!metadata_valid(block_tables, num_tables, table_rows, context_lens, q_rows,          \
                        num_q_rows, num_entries, max_blocks, block_size, num_slots))         \
        return 3;                                                                             \
    int64_t *items = malloc(sizeof(int64_t) * 2 * (size_t)num_entries);                      \
    if (items == NULL) return 2;                                                              \
    const int64_t num_items = work_items(table_rows, context_lens, q_rows, num_entries,      \
                                         tile_supported(head_dim), items);                   \
    /* Tasks (item, segment, KV head), last items first: a prompt's last tiles are its     \
     * longest tasks. Split rows' segments write into parts, counted per (item, KV head). */ \
    const int64_t D = head_dim, nkv = num_kv_heads;                                          \
    const int64_t stride = (group * D + 2 * group + 15) & ~(int64_t)15;                      \
    int64_t num_tasks = 0, num_parts = 0;                                                     \
    for (int64_t item = 0; item < num_items; item++) {                                        \
        const int64_t nseg = row_segments(items[2 * item + 1],                                \
                                          context_lens[items[2 * item]], D);                  \
        num_tasks += nseg * nkv;                                                              \
        if (nseg > 1) num_parts += nseg * nkv;                                                \
    }                                                                                         \
    int64_t *tasks = malloc(sizeof(int64_t) * 4 * (size_t)num_tasks                          \
                            + sizeof(int64_t) * (size_t)(num_items * nkv));                   \
    float *parts = num_parts ? aligned_alloc(64, sizeof(float) * (size_t)(num_parts * stride)) \
                             : NULL;                                                          \
    if (tasks == NULL || (num_parts && parts == NULL)) {                                     \
        free(items), free(tasks), free(parts);                                                \
        return 2;                                                                             \
    }                                                                                         \
    int64_t *done = tasks + 4 * num_tasks;       /* segments finished per (item, KV head) */ \
    for (int64_t i = 0, t = 0, part = 0; i < num_items; i++) {                               \
        const int64_t item = num_items - 1 - i;                                               \
        const int64_t nseg = row_segments(items[2 * item + 1],                                \
                                          context_lens[items[2 * item]], D);                  \
        for (int64_t sg = 0; sg < nseg; sg++)                                                 \
            for (int64_t kvh = 0; kvh < nkv; kvh++, t++) {                                    \
                tasks[4 * t] = item, tasks[4 * t + 1] = sg, tasks[4 * t + 2] = kvh;           \
                tasks[4 * t + 3] = nseg > 1 ? part + kvh * nseg + sg : -1;                    \
            }                                                                                 \
        if (nseg > 1) part += nseg * nkv;                                                     \
        for (int64_t kvh = 0; kvh < nkv; kvh++) done[item * nkv + kvh] = 0;                  \
    }                                                                                         \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t task = 0; task < num_tasks; task++) {                                        \
        const int64_t item = tasks[4 * task], sg = tasks[4 * task + 1];                       \
        const int64_t kvh = tasks[4 * task + 2], part = tasks[4 * task + 3];                  \
        const int64_t seq = items[2 * item], rows = items[2 * item + 1];                     \
        const int64_t ctx = context_lens[seq];                                                \
        const int64_t RS = D + KV_EXTRA(TK);            /* a cache row's elements */          \
        const TK *k_head = k_cache + kvh * num_slots * RS;                                    \
        const TK *v_head = v_cache + kvh * num_slots * RS;                                    \
        const int32_t *table = block_tables + (int64_t)table_rows[seq] * max_blocks;          \
        if (rows > 1) {                                                                       \
            float *scratch = aligned_alloc(64, sizeof(float) * (size_t)tile_scratch(group, D)); \
            if (scratch == NULL) {                                                            \
                _Pragma("omp atomic write")                                                   \
                failed = 1;                                                                   \
                continue;                                                                     \
            }                                                                                 \
            const int64_t first = (q_rows[seq] * num_heads + kvh * group) * D;               \
            TILE(q + first, out + first, num_heads * D, k_head, v_head, table, ctx, rows,     \
                 block_size, group, D, scale, scratch);                                       \
            free(scratch);                                                                    \
            continue;                                                                         \
        }                                                                                     \
        int64_t tb, te;                                                                       \
        segment_keys(ctx, sg, part >= 0, &tb, &te);                                           \
        Ahead next_rows;                                                                      \
        Ahead *ahead = ahead_of(&next_rows, tasks, task, num_tasks, items, context_lens,      \
                                block_tables, table_rows, max_blocks, (const char *)k_cache,  \
                                (const char *)v_cache, num_slots * RS * (int64_t)sizeof(TK), \
                                RS * (int64_t)sizeof(TK), block_size);                        \
        const int64_t ctx16 = (te - tb + 15) & ~(int64_t)15;                                  \
        /* 64-byte aligned (D, ctx16 multiples of 16): the vectorised loops over this scratch \
         * then sum in the same order whichever thread's heap it comes from. */               \
        float *qf = aligned_alloc(64, sizeof(float) * (size_t)(group * (2 * D + ctx16)));     \
        if (qf == NULL) {                                                                     \
            _Pragma("omp atomic write")                                                       \
            failed = 1;                                                                       \
            continue;                                                                         \
        }                                                                                     \
        float *acc = qf + group * D, *scores = acc + group * D;                               \
        const T *q_seq = q + (q_rows[seq] * num_heads + kvh * group) * D;                    \
        T *o_seq = out + (q_rows[seq] * num_heads + kvh * group) * D;                        \
        for (int64_t i = 0; i < group * D; i++) qf[i] = LOAD(q_seq[i]) * scale;              \
        if (part >= 0) {                                 /* a segment of a split row */      \
            float *mine = parts + part * stride;                                              \
            ROWV(qf, k_head, v_head, table, tb, te, block_size, group, D, scores, mine,      \
                 mine + group * D, ahead);                                                    \
            const int64_t nseg = row_segments(1, ctx, D);                                     \
            if (__atomic_add_fetch(&done[item * nkv + kvh], 1, __ATOMIC_ACQ_REL) == nseg) {   \
                combine_segments(parts + (part - sg) * stride, nseg, stride, group, D, acc); \
                for (int64_t i = 0; i < group * D; i++) o_seq[i] = STORE(acc[i]);            \
            }                                                                                 \
            free(qf);                                                                         \
            continue;                                                                         \
        }                                                                                     \
        if (tile_supported(D)) {                         /* VL keys at a time */             \
            ROWV(qf, k_head, v_head, table, 0, ctx, block_size, group, D, scores, acc, NULL, \
                 ahead);                                                                      \
        } else {                                         /* other head sizes: one by one */  \
            prefetch_runs(k_head, v_head, table, ctx, block_size,                             \
                          block_size * RS * (int64_t)sizeof(TK));                             \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, D, scores, acc);         \
        }                                                                                     \
        for (int64_t i = 0; i < group * D; i++) o_seq[i] = STORE(acc[i]);                    \
        free(qf);                                                                             \
    }                                                                                         \
    free(items), free(tasks), free(parts);                                                    \
    return failed ? 2 : 0;                                                                    \
}

/* Row tasks by the cache's type (they take float32 queries). */
DEFINE_TASK(row_task_bf16, uint16_t, bf16_to_f32)
DEFINE_TASK(row_task_f32, float, f32_to_f32)

DEFINE_KERNEL(paged_attention_bf16, row_task_bf16, row_task_vec_bf16, tile_task_bf16,
              uint16_t, bf16_to_f32, f32_to_bf16, uint16_t)
DEFINE_KERNEL(paged_attention_f32, row_task_f32, row_task_vec_f32, tile_task_f32, float,
              f32_to_f32, f32_to_f32, float)
/* float32 queries and output, bfloat16 cache (float32 arithmetic with a bfloat16 KV cache:
 * half the bytes a decode reads per key; kv_cache_dtype, workers/hardware.py). */
DEFINE_KERNEL(paged_attention_f32_kv_bf16, row_task_bf16, row_task_vec_bf16,
              tile_task_f32_kv_bf16, float, f32_to_f32, f32_to_f32, uint16_t)
/* An int8 cache (kv_cache_dtype="int8", rows of int8 values and their float32 scale, see
 * KV_EXTRA) under float32 or bfloat16 arithmetic: each row widened to float32 and multiplied
 * by its scale where the other caches' rows are widened (tiles, one-key rows); the row tasks
 * that take VL keys at a time multiply the keys' scores by their K scales and the weights of
 * P V by their V scales instead. Half the bytes a decode reads per key of a bfloat16 cache. */
DEFINE_TASK(row_task_i8, int8_t, i8_to_f32)
DEFINE_ROW_TASK(row_task_vec_i8, int8_t, loadv_i8)
DEFINE_TILE_KT(tile_kt_i8, int8_t, i8_to_f32)
DEFINE_TILE_TASK(tile_task_f32_kv_i8, float, f32_to_f32, f32_to_f32, int8_t, i8_to_f32, 0,
                 tile_kt_i8)
DEFINE_TILE_TASK(tile_task_bf16_kv_i8, uint16_t, bf16_to_f32, f32_to_bf16, int8_t, i8_to_f32, 0,
                 tile_kt_i8)
DEFINE_KERNEL(paged_attention_kv_i8_f32, row_task_i8, row_task_vec_i8, tile_task_f32_kv_i8,
              float, f32_to_f32, f32_to_f32, int8_t)
DEFINE_KERNEL(paged_attention_kv_i8_bf16, row_task_i8, row_task_vec_i8, tile_task_bf16_kv_i8,
              uint16_t, bf16_to_f32, f32_to_bf16, int8_t)

/* --- elementwise ops, with the roundings of the torch ops they replace ----------------------
 * Each takes rows of `n` elements `stride` apart and writes contiguous rows. The bf16 versions
 * round where torch's bf16 ops round, so results match the torch path bit for bit except where
 * an exp or a sum is evaluated in another order. */

/* Threads pay off past a few thousand elements: in a fused 32-row step (576-wide rows, the
 * threads awake) a threshold of 8192 instead of 32768 took each norm from 0.14 to 0.09 ms a
 * step and rotary with the KV stores from 0.33 to 0.30 (AMD EPYC Zen 5, three alternating
 * pairs, kernel timers in decode_layers). */
#define PARALLEL_IF(amount) const int64_t work = (amount);                                   \
    _Pragma("omp parallel for if(work > 8192) schedule(static)")

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* RMSNorm, HF Llama's numerics: y = w * cast(x * rsqrt(mean(x^2) + eps)), stats in float32. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                 \
void NAME(const T *x, int64_t stride, const T *w, int64_t rows, int64_t n, float eps,        \
          T *out) {                                                                           \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * stride;                                                         \
        T *o = out + r * n;                                                                   \
        float ss = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+:ss)")                                                   \
        for (int64_t i = 0; i < n; i++) { const float v = LOAD(xr[i]); ss += v * v; }         \
        const float rstd = 1.0f / sqrtf(ss / (float)n + eps);                                 \
        _Pragma("omp simd")                                                                   \
        for (int64_t i = 0; i < n; i++)                                                       \
            o[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(xr[i]) * rstd)));                       \
    }                                                                                         \
}

/* Residual add then RMSNorm (the decoder layer's "h = h + sublayer(...); norm(h)"):
 * residual = cast(residual + x) in place, out = rms_norm(residual), one pass over each row. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                             \
void NAME(const T *x, int64_t stride, T *residual, const T *w, int64_t rows, int64_t n,      \
          float eps, T *out) {                                                                \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * stride;                                                         \
        T *res = residual + r * n, *o = out + r * n;                                          \
        float ss = 0.0f;                                                                      \
        _Pragma("omp simd reduction(+:ss)")                                                   \
        for (int64_t i = 0; i < n; i++) {                                                     \
            const T h = STORE(LOAD(res[i]) + LOAD(xr[i]));                                    \
            res[i] = h;                                                                       \
            const float v = LOAD(h);                                                          \
            ss += v * v;                                                                      \
        }                                                                                     \
        const float rstd = 1.0f / sqrtf(ss / (float)n + eps);                                 \
        _Pragma("omp simd")                                                                   \
        for (int64_t i = 0; i < n; i++)                                                       \
            o[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(res[i]) * rstd)));                      \
    }                                                                                         \
}

/* SiLU-and-mul: x rows are [gate | up] (2n wide); y = cast(silu(gate)) * up. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE)                                             \
void NAME(const T *x, int64_t stride, int64_t rows, int64_t n, T *out) {                     \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *gate = x + r * stride, *up = gate + n;                                       \
        T *o = out + r * n;                                                                   \
        _Pragma("omp simd")                                                                   \
        for (int64_t i = 0; i < n; i++)                                                       \
            o[i] = STORE(LOAD(STORE(silu(LOAD(gate[i])))) * LOAD(up[i]));                     \
    }                                                                                         \
}

/* Rotary (rotate-half layout) of `heads` heads of `d` elements per row:
 * y = cast(x * cos) + cast(rotate_half(x) * sin), cos/sin rows (float32) cast to T first. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                   \
void NAME(const T *x, int64_t stride, const int64_t *positions, const float *cos_table,      \
          const float *sin_table, int64_t rows, int64_t heads, int64_t d, T *out) {          \
    const int64_t half = d / 2;                                                               \
    PARALLEL_IF(rows * heads * d)                                                             \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const float *c = cos_table + positions[r] * d, *s = sin_table + positions[r] * d;    \
        for (int64_t h = 0; h < heads; h++) {                                                 \
            const T *xh = x + r * stride + h * d;                                             \
            T *o = out + (r * heads + h) * d;                                                 \
            _Pragma("omp simd")                                                               \
            for (int64_t i = 0; i < half; i++) {                                              \
                const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                        \
                const float c1 = LOAD(STORE(c[i])), s1 = LOAD(STORE(s[i]));                   \
                const float c2 = LOAD(STORE(c[i + half])), s2 = LOAD(STORE(s[i + half]));     \
                o[i] = STORE(LOAD(STORE(x1 * c1)) + LOAD(STORE(-x2 * s1)));                   \
                o[i + half] = STORE(LOAD(STORE(x2 * c2)) + LOAD(STORE(x1 * s2)));             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, f32_to_f32, f32_to_f32)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_to_f32, f32_to_f32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_to_f32, f32_to_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_to_f32, f32_to_f32)

/* Row-wise argmax, the first index of the largest value (torch.argmax's rule; logits are never
 * NaN here). Values are compared as integer keys that order like the floats (a negative's
 * magnitude bits flipped, -0 taken as +0), which -ffast-math cannot reorder and which keeps
 * infinities exact: a row of -inf gives 0, as in torch. Chunks of 256 are reduced by a vector
 * max of the keys (8 or 16 at a time; bfloat16 widened to float32's bits first); the first
 * chunk holding the row's max is then scanned for its index. One row (a decode step's greedy
 * sample) runs on the calling thread: the keys' loop reads the 49152 logits of the default
 * model in ~12 us, where a scalar key loop took ~85 us and an OpenMP region for one row
 * another ~150 (AMD EPYC Zen 3, AVX2). */
#define ARGMAX_CHUNK 256
static inline int32_t argmax_key(int32_t b) {         /* float bits -> an ordered integer */
    return b == INT32_MIN ? 0 : b ^ ((b >> 31) & 0x7FFFFFFF);
}
static inline vi argmax_keys(vf v) {
    const vi b = (vi)v;
    return (b ^ ((b >> 31) & 0x7FFFFFFF)) & ~(b == INT32_MIN);
}
static inline int32_t bits_f32(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}
static inline int32_t bits_bf16(uint16_t x) { return (int32_t)((uint32_t)x << 16); }
#define DEFINE_ARGMAX(NAME, T, LOADV, BITS)                                                   \
void NAME(const T *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {               \
    _Pragma("omp parallel for if(rows > 1 && rows * n > 32768) schedule(static)")           \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * stride;                                                         \
        int32_t best = 0;                                                                     \
        int64_t best_start = 0;                                                               \
        for (int64_t start = 0; start < n; start += ARGMAX_CHUNK) {                           \
            const int64_t end = n - start < ARGMAX_CHUNK ? n : start + ARGMAX_CHUNK;          \
            int32_t m = argmax_key(BITS(xr[start]));                                          \
            int64_t i = start;                                                                \
            if (end - start >= VL) {                                                          \
                vi mv = argmax_keys(LOADV(xr + i));                                           \
                for (i += VL; i + VL <= end; i += VL) {                                       \
                    const vi k = argmax_keys(LOADV(xr + i)), gt = k > mv;                     \
                    mv = (k & gt) | (mv & ~gt);                                               \
                }                                                                             \
                for (int j = 0; j < VL; j++) m = mv[j] > m ? mv[j] : m;                       \
            }                                                                                 \
            for (; i < end; i++) {                                                            \
                const int32_t k = argmax_key(BITS(xr[i]));                                    \
                m = k > m ? k : m;                                                            \
            }                                                                                 \
            if (start == 0 || m > best) { best = m; best_start = start; }                     \
        }                                                                                     \
        int64_t i = best_start;                                                               \
        while (i < n - 1 && argmax_key(BITS(xr[i])) != best) i++;                             \
        out[r] = i;                                                                           \
    }                                                                                         \
}

/* Per-token (row) int8 quantization of a linear layer's input, for oneDNN's u8 x s8 GEMM
 * (layers/linear.py, Int8Linear): scale = max|x| / 127 (1 for an all-zero row),
 * q = round(x / scale) + 128 as uint8, so the zero point is 128 for every row and the
 * per-row scale is applied to the GEMM's output. */
#define DEFINE_QUANTIZE_ROWS(NAME, T, LOAD)                                                   \
void NAME(const T *x, int64_t stride, int64_t rows, int64_t n, uint8_t *out, float *scales) { \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * stride;                                                         \
        uint8_t *o = out + r * n;                                                             \
        float m = 0.0f;                                                                       \
        _Pragma("omp simd reduction(max:m)")                                                  \
        for (int64_t i = 0; i < n; i++) { const float v = fabsf(LOAD(xr[i])); m = v > m ? v : m; } \
        const float scale = m > 0.0f ? m / 127.0f : 1.0f, inv = 1.0f / scale;                 \
        scales[r] = scale;                                                                    \
        _Pragma("omp simd")                                                                   \
        for (int64_t i = 0; i < n; i++)                                                       \
            o[i] = (uint8_t)(int32_t)(nearbyintf(LOAD(xr[i]) * inv) + 128.0f);                \
    }                                                                                         \
}

DEFINE_QUANTIZE_ROWS(quantize_rows_bf16, uint16_t, bf16_to_f32)
DEFINE_QUANTIZE_ROWS(quantize_rows_f32, float, f32_to_f32)

/* The int8 GEMM's float32 rows times each token's scale, plus the bias (float32, or NULL),
 * rounded once into the model dtype: out = cast(y * scales[r] + bias). */
#define DEFINE_SCALE_ROWS(NAME, T, STORE)                                                     \
void NAME(const float *y, int64_t rows, int64_t n, const float *scales, const float *bias,   \
          T *out) {                                                                           \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const float *yr = y + r * n, s = scales[r];                                           \
        T *o = out + r * n;                                                                   \
        if (bias) {                                                                           \
            _Pragma("omp simd")                                                               \
            for (int64_t i = 0; i < n; i++) o[i] = STORE(yr[i] * s + bias[i]);                \
        } else {                                                                              \
            _Pragma("omp simd")                                                               \
            for (int64_t i = 0; i < n; i++) o[i] = STORE(yr[i] * s);                          \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_SCALE_ROWS(scale_rows_bf16, uint16_t, f32_to_bf16)
DEFINE_SCALE_ROWS(scale_rows_f32, float, f32_to_f32)

DEFINE_ARGMAX(argmax_bf16, uint16_t, loadv_bf16, bits_bf16)
DEFINE_ARGMAX(argmax_f32, float, loadv_f32, bits_f32)

/* KV store: row t of `src` (heads rows of `row_bytes`, `head_stride` bytes apart, tokens
 * `token_stride` bytes apart) goes to slot slots[t] of a head-major cache
 * [heads, num_slots, row]. One memcpy a row, no dtype involved. */
int store_kv(const char *src, int64_t token_stride, int64_t head_stride, const int64_t *slots,
             int64_t num_tokens, int64_t heads, int64_t row_bytes, int64_t num_slots,
             char *cache) {
    for (int64_t t = 0; t < num_tokens; t++)      /* a bad slot must not write anywhere */
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    PARALLEL_IF(num_tokens * heads * row_bytes / 4)
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            memcpy(cache + (h * num_slots + slots[t]) * row_bytes,
                   src + t * token_stride + h * head_stride, (size_t)row_bytes);
    return 0;
}

/* store_kv for float32 rows into a bfloat16 cache, rounded to nearest even as torch rounds;
 * strides in bytes, as store_kv's. */
int store_kv_f32_to_bf16(const char *src, int64_t token_stride, int64_t head_stride,
                         const int64_t *slots, int64_t num_tokens, int64_t heads,
                         int64_t head_dim, int64_t num_slots, uint16_t *cache) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    PARALLEL_IF(num_tokens * heads * head_dim)
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *row = (const float *)(src + t * token_stride + h * head_stride);
            uint16_t *dst = cache + (h * num_slots + slots[t]) * head_dim;
            _Pragma("omp simd")
            for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(row[d]);
        }
    return 0;
}

/* store_kv into an int8 cache (rows of int8 values and their float32 scale, KV_EXTRA): each
 * float32 or bfloat16 row (strides in bytes, as store_kv's) by its largest magnitude:
 * scale = amax * (1 / 127), q = x * (1 / scale) rounded to nearest even (0 for a row of
 * zeros), as cpu_ops.quantize_kv_rows computes them (-ffast-math may evaluate the product as
 * x / scale: a value a rounding from a tie may land a step apart). */
#define DEFINE_STORE_I8(NAME, T, LOAD)                                                        \
int NAME(const char *src, int64_t token_stride, int64_t head_stride, const int64_t *slots,   \
         int64_t num_tokens, int64_t heads, int64_t head_dim, int64_t num_slots,             \
         int8_t *cache) {                                                                     \
    for (int64_t t = 0; t < num_tokens; t++)                                                  \
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;                                  \
    const int64_t RS = head_dim + KV_EXTRA(int8_t);                                           \
    PARALLEL_IF(num_tokens * heads * head_dim)                                                \
    for (int64_t t = 0; t < num_tokens; t++)                                                  \
        for (int64_t h = 0; h < heads; h++) {                                                 \
            const T *row = (const T *)(src + t * token_stride + h * head_stride);             \
            int8_t *dst = cache + (h * num_slots + slots[t]) * RS;                            \
            float amax = 0.0f;                                                                \
            for (int64_t d = 0; d < head_dim; d++) {                                          \
                const float a = fabsf(LOAD(row[d]));                                          \
                amax = a > amax ? a : amax;                                                   \
            }                                                                                 \
            /* no division by a constant: -ffast-math would turn it into a product; a scale \
             * below FLT_MIN (a row of ~0) stores zeros, whose 1 / scale would overflow */     \
            const float scale = amax * (1.0f / 127.0f);                                       \
            const float inv = scale >= FLT_MIN ? 1.0f / scale : 0.0f;                         \
            for (int64_t d = 0; d < head_dim; d++) {                                          \
                const float v = LOAD(row[d]) * inv;                                           \
                dst[d] = (int8_t)nearbyintf(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v); \
            }                                                                                 \
            memcpy(dst + head_dim, &scale, sizeof scale);                                     \
        }                                                                                     \
    return 0;                                                                                 \
}
DEFINE_STORE_I8(store_kv_i8_f32, float, f32_to_f32)
DEFINE_STORE_I8(store_kv_i8_bf16, uint16_t, bf16_to_f32)

/* --- Sampling a row: temperature, top-k, top-p, min-p, then one inverse-CDF draw ----------
 * The CPU sampler's draw (workers/sampler.py) in one pass or a few over each row's logits,
 * where the torch ops (a sort or topk, softmax, a float64 cumsum, searchsorted) took 0.3-2 ms
 * a row of the default model's 49152 logits and 24-60 ms for 32 rows on a 2-core CPU.
 * Same rules as sampler.apply_top_k_top_p_min_p and Sampler._draw: s = logits / temperature;
 * top-k keeps the k largest; top-p, over what top-k kept (sorted, largest first), keeps a
 * token while the probability above it is below top_p (the top one always); min-p keeps
 * tokens with p >= min_p * p_max, i.e. s >= s_max + log(min_p). Each rule is a threshold on
 * s, found without sorting the row: top-k by a histogram of the values' ordered keys (the
 * bin holding the k-th largest, then a selection within it), top-p by a histogram of the
 * probability mass over s_max - s in 1/8 steps (the bin where the mass reaches top_p, then
 * that bin's few tokens sorted). Equal values at a threshold are all kept. The draw: the
 * first token, in vocabulary order, whose running sum of exp(s - s_max) over the kept tokens
 * passes u times their total (float64 sums), as searchsorted over the torch path's CDF. */
typedef struct { float v; int32_t i; } Cand;

static int cand_desc(const void *a, const void *b) {       /* larger first, then lower id */
    const Cand *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? 1 : -1;
    return (x->i > y->i) - (x->i < y->i);
}

/* The k-th largest value (1-based) of c[0..n) by quickselect (c is reordered). */
static float kth_largest(Cand *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = c[lo + (hi - lo) / 2].v;
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (c[i].v > pivot) i++;
            while (c[j].v < pivot) j--;
            if (i <= j) { const Cand t = c[i]; c[i] = c[j]; c[j] = t; i++, j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return pivot;
    }
    return c[want].v;
}

#define SAMPLE_BINS 512           /* s_max - s in [0, 64) by 1/8, the rest in the last bin */
#define SAMPLE_CHUNK 256          /* the draw's running sums, a chunk at a time */

static inline int64_t sample_bin(float s, float m) {
    const float d = (m - s) * 8.0f;
    return d < SAMPLE_BINS - 1 ? (int64_t)d : SAMPLE_BINS - 1;
}

/* The tokens of bins [b0, b1] with s >= floor into c; how many. */
static int64_t sample_collect(const float *s, int64_t V, float m, int64_t b0, int64_t b1,
                              float floor, Cand *c) {
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        const int64_t b = sample_bin(s[i], m);
        if (b >= b0 && b <= b1 && s[i] >= floor) c[n].v = s[i], c[n].i = (int32_t)i, n++;
    }
    return n;
}

/* One row: the drawn token id, or -1 where scratch could not be allocated. s, e: V floats of
 * scratch (the scaled logits and exp(s - s_max)). */
static int64_t sample_row(const float *x, int64_t V, float t, int64_t k, float p, float min_p,
                          double u, float *s, float *e) {
    float m = x[0] / t;
    for (int64_t i = 0; i < V; i++) {
        s[i] = x[i] / t;
        m = s[i] > m ? s[i] : m;
    }
    if (bits_f32(m) == bits_f32(-INFINITY)) return 0;     /* every token masked: none to draw */
    if ((bits_f32(m) & 0x7F800000) == 0x7F800000) {      /* a temperature so small that x / t */
        int64_t best = 0;                                 /* overflowed: the limit, the argmax */
        for (int64_t i = 1; i < V; i++)
            if (argmax_key(bits_f32(x[i])) > argmax_key(bits_f32(x[best]))) best = i;
        return best;
    }
    {
        int64_t i = 0;
        for (; i + VL <= V; i += VL) *(vfu *)(e + i) = (vfu)vexp(loadv_f32(s + i) - m);
        for (; i < V; i++) e[i] = expf(s[i] - m);
    }
    const int top_k = k > 0 && k < V, top_p = p < 1.0f;
    float floor = -FLT_MAX;
    if (top_k || top_p) {
        /* Tokens and probability mass by bin (bin 0: the largest values). */
        int64_t count[SAMPLE_BINS] = {0};
        double mass[SAMPLE_BINS] = {0};
        for (int64_t i = 0; i < V; i++) {
            const int64_t b = sample_bin(s[i], m);
            count[b]++, mass[b] += e[i];
        }
        Cand *c = malloc(sizeof(Cand) * (size_t)V);
        if (c == NULL) return -1;
        int64_t n = 0;                    /* the candidates, sorted (largest first) */
        double total = 0.0;               /* top-p's 100%: the mass top-k keeps, or all */
        if (top_k) {                      /* the bins down to the one holding the k-th */
            int64_t above = 0, bin = 0;
            while (above + count[bin] < k) above += count[bin++];
            n = sample_collect(s, V, m, 0, bin, -FLT_MAX, c);
            floor = kth_largest(c, n, k);
            int64_t kept = 0;
            for (int64_t j = 0; j < n; j++)
                if (c[j].v >= floor) c[kept++] = c[j];
            n = kept;
            for (int64_t j = 0; j < n; j++) total += e[c[j].i];
        } else {
            for (int64_t b = 0; b < SAMPLE_BINS; b++) total += mass[b];
        }
        if (top_p) {
            const double goal = (double)p * total;
            double before = 0.0;
            if (!top_k) {                 /* whole bins while their mass stays below top_p */
                int64_t bin = 0;
                while (bin < SAMPLE_BINS - 1 && before + mass[bin] < goal) before += mass[bin++];
                n = sample_collect(s, V, m, bin, bin, -FLT_MAX, c);
            }
            qsort(c, (size_t)n, sizeof(Cand), cand_desc);
            /* keep while the mass above stays below top_p (the first always), then the rest
             * of the last kept value's ties */
            int64_t j = 0;
            while (j < n && (j == 0 || before < goal)) before += e[c[j++].i];
            if (n > 0) floor = c[j - 1].v;
        }
        free(c);
    }
    if (min_p > 0.0f) {
        const float f = m + logf(min_p);
        floor = f > floor ? f : floor;
    }
    /* The draw: the first kept token whose running mass passes u times the kept total. */
    const int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    double *sums = malloc(sizeof(double) * (size_t)chunks), total = 0.0;
    if (sums == NULL) return -1;
    for (int64_t c0 = 0, j = 0; c0 < V; c0 += SAMPLE_CHUNK, j++) {
        const int64_t c1 = V - c0 < SAMPLE_CHUNK ? V : c0 + SAMPLE_CHUNK;
        double sum = 0.0;
        for (int64_t i = c0; i < c1; i++)
            if (s[i] >= floor) sum += e[i];
        sums[j] = sum, total += sum;
    }
    const double goal = u * total;
    double run = 0.0;
    int64_t id = -2;
    for (int64_t c0 = 0, j = 0; c0 < V && id == -2; c0 += SAMPLE_CHUNK, j++) {
        if (run + sums[j] <= goal && j + 1 < chunks) {
            run += sums[j];
            continue;
        }
        const int64_t c1 = V - c0 < SAMPLE_CHUNK ? V : c0 + SAMPLE_CHUNK;
        for (int64_t i = c0; i < c1 && id == -2; i++)
            if (s[i] >= floor && e[i] > 0.0f) {
                run += e[i];
                if (run > goal) id = i;
            }
    }
    free(sums);
    if (id >= 0) return id;
    for (int64_t i = V - 1; i > 0; i--)   /* rounding at the very end: the last kept token */
        if (s[i] >= floor && e[i] > 0.0f) return i;
    return 0;
}

/* Rows of float32 logits (`stride` apart): out[r] = the token drawn with temperature[r],
 * top_k[r] (<= 0: off), top_p[r] (1: off), min_p[r] (0: off) and the uniform u[r] in [0, 1).
 * 0, or 2 where scratch memory could not be allocated. */
int sample_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t V,
                    const float *temperature, const int64_t *top_k, const float *top_p,
                    const float *min_p, const double *u, int64_t *out) {
    int failed = 0;
    #pragma omp parallel for if (rows > 1) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t padded = (V + 15) & ~(int64_t)15;      /* floats: 64-byte multiples */
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(2 * padded));
        const int64_t id = s == NULL ? -1 : sample_row(x + r * stride, V, temperature[r],
                                                       top_k[r], top_p[r], min_p[r], u[r], s,
                                                       s + padded);
        free(s);
        if (id < 0) {
            #pragma omp atomic write
            failed = 2;
        }
        out[r] = id < 0 ? 0 : id;
    }
    return failed;
}

/* --- Penalties: HF's repetition penalty over prompt + output, OpenAI's frequency and presence
 * penalties over the output (workers/logits_processors.py, the same rules and order), in
 * place on float32 logits rows. Row j of the call is logits row row_index[j]; its tokens are
 * ids[offsets[j] .. offsets[j + 1]), the last num_outputs[j] of them outputs. Each distinct
 * token is changed once: x / rep if x > 0 else x * rep, then x - (freq * count + pres) where
 * the output holds it `count` > 0 times. Ids outside [0, V) are ignored. The torch version
 * (torch.unique over row * vocab + id keys, index_select / index_copy of the rows) took
 * ~0.8 ms for one row of a 600-token history and ~14 ms for 32 on a 2-core CPU. 0, or 2
 * where scratch memory could not be allocated. */
int penalize_rows_f32(float *x, int64_t stride, int64_t V, int64_t rows,
                      const int64_t *row_index, const int64_t *ids, const int64_t *offsets,
                      const int64_t *num_outputs, const float *rep, const float *freq,
                      const float *pres) {
    int failed = 0;
    #pragma omp parallel for if (rows > 1) schedule(dynamic, 1)
    for (int64_t j = 0; j < rows; j++) {
        /* per token: bit 0 seen, bit 1 done, the output count from bit 2 */
        uint32_t *state = calloc((size_t)V, sizeof(uint32_t));
        if (state == NULL) {
            #pragma omp atomic write
            failed = 2;
            continue;
        }
        const int64_t begin = offsets[j], end = offsets[j + 1];
        const int64_t first_output = end - num_outputs[j];
        for (int64_t i = begin; i < end; i++) {
            const int64_t t = ids[i];
            if (t < 0 || t >= V) continue;
            state[t] |= 1u;
            if (i >= first_output) state[t] += 4u;
        }
        float *row = x + row_index[j] * stride;
        const float r = rep[j], f = freq[j], p = pres[j];
        for (int64_t i = begin; i < end; i++) {
            const int64_t t = ids[i];
            if (t < 0 || t >= V || (state[t] & 2u)) continue;
            state[t] |= 2u;
            float v = row[t];
            if (r != 1.0f) v = v > 0.0f ? v / r : v * r;
            const uint32_t count = state[t] >> 2;
            if (count > 0 && (f != 0.0f || p != 0.0f)) v -= f * (float)count + p;
            row[t] = v;
        }
        free(state);
    }
    return failed;
}

/* --- Logprobs: each row's log-softmax at its sampled token and at its top n ---------------
 * For the rows that ask (Sampler._logprobs): lse = max + log(sum exp(x - max)) (float64 sum),
 * the chosen token's x - lse, and the n largest x (larger first; equal values by lower id)
 * with theirs, from one pass for the sum and one for the top n (a short sorted list that most
 * values miss at its last entry), where torch's log_softmax over the row plus topk took ~0.3
 * ms a row of 49152 on a 2-core CPU. top_values / top_ids: [rows, max_n]. */
void logprobs_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t V,
                       const int64_t *top_n, int64_t max_n, const int64_t *chosen,
                       float *chosen_lp, float *top_values, int64_t *top_ids) {
    #pragma omp parallel for if (rows > 1) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float m = row[0];
        for (int64_t i = 0; i < V; i++) m = row[i] > m ? row[i] : m;
        double sum = 0.0;
        if (bits_f32(m) != bits_f32(-INFINITY)) {
            int64_t i = 0;
            while (i + VL <= V) {             /* float32 vector sums a chunk, then float64 */
                vf part = (vf){0};
                for (int64_t end = i + 32 * VL < V ? i + 32 * VL : V; i + VL <= end; i += VL)
                    part += vexp(loadv_f32(row + i) - m);
                sum += hsum(part);
            }
            for (; i < V; i++) sum += expf(row[i] - m);
        }
        const double lse = (double)m + log(sum);
        chosen_lp[r] = (float)((double)row[chosen[r]] - lse);
        const int64_t n = top_n[r] < V ? top_n[r] : V;
        float *tv = top_values + r * max_n;
        int64_t *ti = top_ids + r * max_n, have = 0;
        float least = -FLT_MAX;           /* the list's last value once it is full */
        for (int64_t i0 = 0; i0 < V && n > 0; i0 += VL) {
            if (have == n && i0 + VL <= V) {          /* most vectors: nothing above `least` */
                const vi above = (vi)(loadv_f32(row + i0) > least);
                int any = 0;
                for (int j = 0; j < VL; j++) any |= above[j];
                if (!any) continue;
            }
            for (int64_t i = i0; i < i0 + VL && i < V; i++) {
                const float v = row[i];
                if (have == n && !(v > least)) continue;
                int64_t j = have < n ? have++ : n - 1;  /* insert, larger first, ties by id */
                while (j > 0 && v > tv[j - 1]) tv[j] = tv[j - 1], ti[j] = ti[j - 1], j--;
                tv[j] = v, ti[j] = i;
                if (have == n) least = tv[n - 1];
            }
        }
        for (int64_t j = 0; j < have; j++) tv[j] = (float)((double)tv[j] - lse);
    }
}
