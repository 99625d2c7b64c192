/* kvflow's CPU kernels (loaded by cpu_ops.py): paged decode attention, then elementwise ops.
 *
 * Paged decode attention: one query row per request, read straight from the paged cache.
 *
 * The torch path gathers every request's blocks into scratch tensors and runs small bmm calls;
 * on CPU those copies and calls are most of a decode step. This kernel reads each K/V row where
 * it lies instead, converts it to float32 once for all the query heads that share it, and keeps
 * scores, softmax and sums in float32.
 *
 * Cache layout (the torch backend's, head-major): [num_kv_heads, num_slots, head_dim] with
 * slot = block_id * block_size + offset. Work is split over (request, KV head) pairs with
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

static inline void prefetch_block(const void *start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)start + off, 0, 3);
}

/* One (request, KV head) pair: `group` query heads against `ctx` keys.
 * qf: [group, D] float32 scaled queries; scores: [group, ctx] scratch; returns acc [group, D]. */
#define DEFINE_TASK(NAME, T, LOAD)                                                            \
static inline __attribute__((always_inline)) void NAME(                                       \
        const float *qf, const T *k_head, const T *v_head, const int32_t *table, int64_t ctx, \
        int64_t block_size, const int64_t group, const int64_t D, float *scores, float *acc) {\
    float maxs[MAX_GROUP], kf[D];                                                              \
    for (int64_t g = 0; g < group; g++) maxs[g] = -FLT_MAX;                                   \
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, blk++) {               \
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;               \
        const T *kb = k_head + (int64_t)table[blk] * block_size * D;                         \
        if (start + block_size < ctx)       /* blocks lie scattered: fetch the next early */ \
            prefetch_block(k_head + (int64_t)table[blk + 1] * block_size * D,                \
                           block_size * D * (int64_t)sizeof(T));                             \
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
        if (start + block_size < ctx)                                                         \
            prefetch_block(v_head + (int64_t)table[blk + 1] * block_size * D,                \
                           block_size * D * (int64_t)sizeof(T));                             \
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

/* q, out: [num_rows, num_heads, D]; q_rows[i]: the row of request i; block_tables:
 * [num_seqs, max_blocks] int32; context_lens[i]: keys visible to request i (its new one too). */
#define DEFINE_KERNEL(NAME, TASK, T, LOAD, STORE)                                             \
DEFINE_TASK(TASK, T, LOAD)                                                                    \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,         \
         const int32_t *context_lens, const int64_t *q_rows, int64_t num_seqs,               \
         int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,      \
         int64_t block_size, int64_t num_slots, float scale, T *out) {                        \
    const int64_t group = num_heads / num_kv_heads;                                           \
    if (group > MAX_GROUP || group * num_kv_heads != num_heads) return 1;                    \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {                          \
        const int64_t seq = task / num_kv_heads, kvh = task % num_kv_heads;                  \
        const int64_t ctx = context_lens[seq], D = head_dim;                                  \
        float *qf = malloc(sizeof(float) * (size_t)(group * (2 * D + ctx)));                 \
        if (qf == NULL) { failed = 1; continue; }                                            \
        float *acc = qf + group * D, *scores = acc + group * D;                               \
        const T *q_seq = q + (q_rows[seq] * num_heads + kvh * group) * D;                    \
        for (int64_t i = 0; i < group * D; i++) qf[i] = LOAD(q_seq[i]) * scale;              \
        const T *k_head = k_cache + kvh * num_slots * D, *v_head = v_cache + kvh * num_slots * D; \
        const int32_t *table = block_tables + seq * max_blocks;                               \
        /* A constant head_dim lets the compiler unroll and vectorise the row loops. */      \
        if (D == 64)                                                                          \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, 64, scores, acc);        \
        else if (D == 128)                                                                    \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, 128, scores, acc);       \
        else                                                                                  \
            TASK(qf, k_head, v_head, table, ctx, block_size, group, D, scores, acc);         \
        T *o_seq = out + (q_rows[seq] * num_heads + kvh * group) * D;                        \
        for (int64_t i = 0; i < group * D; i++) o_seq[i] = STORE(acc[i]);                    \
        free(qf);                                                                             \
    }                                                                                         \
    return failed ? 2 : 0;                                                                    \
}

DEFINE_KERNEL(paged_decode_bf16, decode_task_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(paged_decode_f32, decode_task_f32, float, f32_to_f32, f32_to_f32)

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
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_to_f32, f32_to_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_to_f32, f32_to_f32)
