/* kvflow's CPU kernels (loaded by cpu_ops.py): paged attention, then the KV store, elementwise
 * ops, the sampler's argmax and the per-token quantization of int8 linears' inputs.
 *
 * Paged attention: every query row, decode or prefill, attends to its own causal context,
 * read straight from the paged cache. The torch path gathers every request's blocks into
 * scratch tensors and runs small bmm/SDPA calls; on CPU those copies and calls cost more than
 * the math. This kernel reads each K/V row where it lies, and keeps scores, softmax and sums
 * in float32.
 *
 * Cache layout (the torch backend's, head-major): [num_kv_heads, num_slots, head_dim] with
 * slot = block_id * block_size + offset. Work is split over (query row, KV head) pairs with
 * OpenMP; linked against the libgomp that torch has loaded, it shares torch's thread pool.
 *
 * Built by kvflow/kernels/cpu_ops.py (cc -O3 -march=native -ffast-math -fopenmp).
 * -ffast-math is safe here: every value is finite (only visible keys are visited, no -inf
 * masks), and it lets expf vectorise.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Fetch [start, start + bytes) towards L2. On x86 an asm statement: GCC may delete a loop that
 * does nothing but __builtin_prefetch (it has no side effects), and did here. */
static inline void prefetch_l2(const void *start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("prefetcht2 %0" : : "m"(*((const char *)start + off)));
#else
        __builtin_prefetch((const char *)start + off, 0, 1);
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
            prefetch_l2((const char *)k_head + table[b] * block_bytes, block_bytes);
            prefetch_l2((const char *)v_head + table[b] * block_bytes, block_bytes);
        }
}

/* One (query row, KV head) pair: `group` query heads against `ctx` keys.
 * qf: [group, D] float32 scaled queries; scores: [group, ctx] scratch; returns acc [group, D]. */
#define DEFINE_TASK(NAME, T, LOAD)                                                            \
static inline __attribute__((always_inline)) void NAME(                                       \
        const float *qf, const T *k_head, const T *v_head, const int32_t *table, int64_t ctx, \
        int64_t block_size, const int64_t group, const int64_t D, float *scores, float *acc) {\
    float maxs[MAX_GROUP], kf[D] __attribute__((aligned(64)));                                 \
    for (int64_t g = 0; g < group; g++) maxs[g] = -FLT_MAX;                                   \
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, blk++) {               \
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;               \
        const T *kb = k_head + (int64_t)table[blk] * block_size * D;                         \
        for (int64_t t = 0; t < n; t++) {                                                     \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kb[t * D + d]);                      \
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
        const T *vb = v_head + (int64_t)table[blk] * block_size * D;                         \
        for (int64_t t = 0; t < n; t++) {                                                     \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vb[t * D + d]);                      \
            for (int64_t g = 0; g < group; g++) {                                             \
                const float p = scores[g * ctx + start + t];                                  \
                float *ag = acc + g * D;                                                      \
                _Pragma("omp simd")                                                           \
                for (int64_t d = 0; d < D; d++) ag[d] += p * kf[d];                           \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* --- AVX-512 BF16 path (bf16 cache, head_dim a multiple of 32) ------------------------------
 * Scores: vdpbf16ps multiplies bf16 pairs exactly and sums them in float32, so q and K stay in
 * bf16 and no K row is converted. Sixteen keys are scored at a time and their sixteen partial
 * vectors summed by one transpose tree, not a horizontal reduction per key. Softmax in float32;
 * the weighted sum of V rows in float32 with the accumulators in registers. */
#include <immintrin.h>
#define KVFLOW_AVX512_BF16 1

/* r[j] = sum of the lanes of v[j], for 16 vectors. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)      /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {    /* per 128-bit lane: that lane's sums of 4 vectors */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)      /* add 128-bit lanes pairwise */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* Walks a request's keys in order: the row of key t lies at table[t / bs] * bs + t % bs. */
typedef struct { const int32_t *table; int64_t bs, blk, off, D; } KeyWalk;

static inline int64_t next_row(KeyWalk *w) {     /* element offset of the next key's row */
    const int64_t row = ((int64_t)w->table[w->blk] * w->bs + w->off) * w->D;
    if (++w->off == w->bs) { w->off = 0; w->blk++; }
    return row;
}

/* acc[g] += p[g][t] * V[t] over all keys, for G query heads and C*16 columns from dc on. */
static inline __attribute__((always_inline)) void weighted_v(
        const uint16_t *v_head, const int32_t *table, int64_t ctx, int64_t bs, int64_t D,
        const float *scores, int64_t ctx16, const float *inv_sum, int64_t dc,
        uint16_t *out, const int G, const int C) {
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    KeyWalk w = {table, bs, 0, 0, D};
    for (int64_t t = 0; t < ctx; t++) {
        const uint16_t *row = v_head + next_row(&w) + dc;
        __m512 v[4];
        for (int c = 0; c < C; c++) v[c] = load_bf16x16(row + 16 * c);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * ctx16 + t]);
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        for (int c = 0; c < C; c++) {
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
            _mm256_storeu_si256((__m256i *)(out + g * D + dc + 16 * c), (__m256i)o);
        }
    }
}

/* One (query row, KV head) pair. q, out: [group, D] bf16; scores: [group, ctx16] scratch. */
static void row_task_avx512(const uint16_t *q, const uint16_t *k_head,
                               const uint16_t *v_head, const int32_t *table, int64_t ctx,
                               int64_t bs, int64_t group, int64_t D, float scale,
                               float *scores, uint16_t *out) {
    const int64_t ctx16 = (ctx + 15) & ~(int64_t)15, nc = D / 32;
    __m512 vmax[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) vmax[g] = _mm512_set1_ps(-FLT_MAX);
    const __m512 vscale = _mm512_set1_ps(scale);
    KeyWalk w = {table, bs, 0, 0, D};
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t n = ctx - t0 < 16 ? ctx - t0 : 16;
        const uint16_t *rows[16];
        for (int64_t j = 0; j < n; j++) rows[j] = k_head + next_row(&w);
        for (int64_t j = n; j < 16; j++) rows[j] = rows[n - 1];  /* padding, masked below */
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int64_t g = 0; g < group; g++) {
            __m512bh qv[8];
            for (int64_t c = 0; c < nc; c++)
                qv[c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
            __m512 part[16];
            for (int j = 0; j < 16; j++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < nc; c++)
                    a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
                part[j] = a;
            }
            __m512 s = _mm512_mul_ps(sum16(part), vscale);
            s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX), s);
            _mm512_storeu_ps(scores + g * ctx16 + t0, s);
            vmax[g] = _mm512_max_ps(vmax[g], s);
        }
    }
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * ctx16, sum = 0.0f;
        const float m = _mm512_reduce_max_ps(vmax[g]);
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t j = 0; j < ctx; j++) { sg[j] = expf(sg[j] - m); sum += sg[j]; }
        inv_sum[g] = 1.0f / sum;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t gn = group - g0 < 4 ? group - g0 : 4;
        for (int64_t dc = 0; dc < D; dc += 64) {
            const float *sc = scores + g0 * ctx16;
            uint16_t *o = out + g0 * D;
            const int wide = D - dc >= 64;
#define WEIGHTED_V(G) (wide ? weighted_v(v_head, table, ctx, bs, D, sc, ctx16, inv_sum + g0,     \
                                         dc, o, G, 4)                                           \
                            : weighted_v(v_head, table, ctx, bs, D, sc, ctx16, inv_sum + g0,     \
                                         dc, o, G, 2))
            switch (gn) {
                case 1: WEIGHTED_V(1); break;
                case 2: WEIGHTED_V(2); break;
                case 3: WEIGHTED_V(3); break;
                default: WEIGHTED_V(4); break;
            }
#undef WEIGHTED_V
        }
    }
}
#endif

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

/* Paged attention, one query row per entry: entry i is q/out row q_rows[i], reading the
 * block table row table_rows[i] of block_tables [num_tables, max_blocks] (int32) and its first
 * context_lens[i] keys (its own key included). A decode is one entry; a prefill of n new
 * tokens after c cached ones is n entries sharing one table row, with contexts c+1 .. c+n,
 * which is causal attention. */
#define DEFINE_KERNEL(NAME, TASK, T, LOAD, STORE, FAST)                                       \
DEFINE_TASK(TASK, T, LOAD)                                                                    \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,         \
         int64_t num_tables, const int32_t *table_rows, const int32_t *context_lens,         \
         const int64_t *q_rows, int64_t num_q_rows, int64_t num_entries, int64_t max_blocks, \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,      \
         int64_t num_slots, float scale, T *out) {                                            \
    const int64_t group = num_heads / num_kv_heads;                                           \
    if (group > MAX_GROUP || group * num_kv_heads != num_heads) return 1;                    \
    if (!metadata_valid(block_tables, num_tables, table_rows, context_lens, q_rows,          \
                        num_q_rows, num_entries, max_blocks, block_size, num_slots))         \
        return 3;                                                                             \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t task = 0; task < num_entries * num_kv_heads; task++) {                       \
        const int64_t seq = task / num_kv_heads, kvh = task % num_kv_heads;                  \
        const int64_t ctx = context_lens[seq], D = head_dim, ctx16 = (ctx + 15) & ~15;       \
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
        const T *k_head = k_cache + kvh * num_slots * D, *v_head = v_cache + kvh * num_slots * D; \
        const int32_t *table = block_tables + (int64_t)table_rows[seq] * max_blocks;          \
        prefetch_runs(k_head, v_head, table, ctx, block_size,                                 \
                      block_size * D * (int64_t)sizeof(T));                                   \
        if (FAST(q_seq, k_head, v_head, table, ctx, block_size, group, D, scale, qf, o_seq)) { \
            free(qf);                                                                         \
            continue;                                                                         \
        }                                                                                     \
        for (int64_t i = 0; i < group * D; i++) qf[i] = LOAD(q_seq[i]) * scale;              \
        /* A constant head_dim lets the compiler unroll and vectorise the row loops. */      \
        if (D == 64)                                                                          \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, 64, scores, acc);        \
        else if (D == 128)                                                                    \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, 128, scores, acc);       \
        else                                                                                  \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, D, scores, acc);         \
        for (int64_t i = 0; i < group * D; i++) o_seq[i] = STORE(acc[i]);                    \
        free(qf);                                                                             \
    }                                                                                         \
    return failed ? 2 : 0;                                                                    \
}

/* FAST(...) runs a task on a faster path and is true, or is false and leaves it to TASK. */
#define NO_FAST_PATH(...) 0
#ifdef KVFLOW_AVX512_BF16
#define AVX512_BF16_PATH(q, k, v, table, ctx, bs, group, D, scale, scratch, out)              \
    ((D) % 32 == 0 && (D) <= 256                                                              \
     && (row_task_avx512(q, k, v, table, ctx, bs, group, D, scale, scratch, out), 1))
#else
#define AVX512_BF16_PATH NO_FAST_PATH
#endif

DEFINE_KERNEL(paged_attention_bf16, row_task_bf16, uint16_t, bf16_to_f32, f32_to_bf16,
              AVX512_BF16_PATH)
DEFINE_KERNEL(paged_attention_f32, row_task_f32, float, f32_to_f32, f32_to_f32, NO_FAST_PATH)

/* --- elementwise ops, with the roundings of the torch ops they replace ----------------------
 * Each takes rows of `n` elements `stride` apart and writes contiguous rows. The bf16 versions
 * round where torch's bf16 ops round, so results match the torch path bit for bit except where
 * an exp or a sum is evaluated in another order. */

/* Threads only pay off past a few tens of thousands of elements. */
#define PARALLEL_IF(amount) const int64_t work = (amount);                                   \
    _Pragma("omp parallel for if(work > 32768) schedule(static)")

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
 * NaN here). Values are compared as integer keys that order like the floats (sign bit
 * flipped, negatives' other bits too, -0 taken as +0), which -ffast-math cannot reorder and
 * which keeps infinities exact: a row of -inf gives 0, as in torch. Chunks of 256 are reduced
 * by vector max; the first chunk holding the row's max is then scanned for its index. */
#define ARGMAX_CHUNK 256
static inline uint16_t key_bf16(uint16_t x) {
    x = x == 0x8000u ? 0 : x;
    return (uint16_t)(x & 0x8000u ? ~x : x | 0x8000u);
}
static inline uint32_t key_f32(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    x = x == 0x80000000u ? 0 : x;
    return x & 0x80000000u ? ~x : x | 0x80000000u;
}
#define DEFINE_ARGMAX(NAME, T, K, KEY)                                                        \
void NAME(const T *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {               \
    PARALLEL_IF(rows * n)                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * stride;                                                         \
        K best = 0;                                                                           \
        int64_t best_start = 0;                                                               \
        for (int64_t start = 0; start < n; start += ARGMAX_CHUNK) {                           \
            const int64_t end = n - start < ARGMAX_CHUNK ? n : start + ARGMAX_CHUNK;          \
            K m = 0;                                                                          \
            _Pragma("omp simd reduction(max:m)")                                              \
            for (int64_t i = start; i < end; i++) m = KEY(xr[i]) > m ? KEY(xr[i]) : m;        \
            if (start == 0 || m > best) { best = m; best_start = start; }                     \
        }                                                                                     \
        int64_t i = best_start;                                                               \
        while (i < n - 1 && KEY(xr[i]) != best) i++;                                          \
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

DEFINE_ARGMAX(argmax_bf16, uint16_t, uint16_t, key_bf16)
DEFINE_ARGMAX(argmax_f32, float, uint32_t, key_f32)

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
