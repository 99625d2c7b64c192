/* A decode step's decoder layers in one C call (kvflow/workers/fused_decode.py drives it).
 *
 * On CPU a one-token step of a small model is mostly not arithmetic: every layer is a dozen
 * small torch and ctypes calls (norms, three linears, rotary, the KV store, attention), each
 * with its own dispatch, allocations and thread start. This file runs the same ops, the same
 * kernels and the same roundings, for every layer of a decode step: one call for the whole
 * model (or, with tensor parallelism, one before and one after each all-reduce).
 *
 * Each sublayer is exactly the unfused model's (models/llama.py), built from the kernels the
 * unfused path calls (cpu_ops.c) and the decode-shaped linear (cpu_gemv.c):
 *   attention: x, residual = add_rms_norm(h, residual) (the first layer: residual = h,
 *              x = rms_norm(h)); qkv = x Wqkv^T (+ b); [Qwen3: q, k = rms_norm per head];
 *              q, k = rotary(q, k); store k, v; attn = paged_attention(q); h = attn Wo^T
 *   MLP:       x, residual = add_rms_norm(h, residual); gu = x Wgu^T; a = silu(g) * u;
 *              h = a Wdown^T
 * Activations are in the model dtype (float32 or bfloat16) and rounded where the torch path
 * rounds them. Linear weights are the model dtype's, or int8 with a float32 scale per output
 * row (W8A16: x rounded per row to 15-bit integers, cpu_gemv.c), row-major or packed; on
 * CPUs without AMX-INT8, steps of more tokens than the gemv kernel takes multiply the
 * weights (7-bit without VNNI, 8-bit with AVX512-VNNI) by x quantized per row to 8 bits
 * (W7A8 / W8A8, cpu_gemm_i8.c), as the model's Int8Linear does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { D_F32 = 0, D_BF16 = 1, D_I8 = 2 };

/* cpu_gemv.c and cpu_ops.c, same library. */
int gemv(const void *x, int xtype, int64_t ldx, int64_t M, const void *w, int wtype,
         const float *scales, const float *in_scale, const float *bias, int64_t N, int64_t K,
         void *out, int otype, int64_t ldo);
int store_kv(const char *src, int64_t token_stride, int64_t head_stride, const int64_t *slots,
             int64_t num_tokens, int64_t heads, int64_t row_bytes, int64_t num_slots,
             char *cache);
int store_kv_f32_to_bf16(const char *src, int64_t token_stride, int64_t head_stride,
                         const int64_t *slots, int64_t num_tokens, int64_t heads,
                         int64_t head_dim, int64_t num_slots, uint16_t *cache);
int paged_attention_f32_kv_bf16(const float *q, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *block_tables,
                                int64_t num_tables, const int32_t *table_rows,
                                const int32_t *context_lens, const int64_t *q_rows,
                                int64_t num_q_rows, int64_t num_entries, int64_t max_blocks,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t num_slots, float scale,
                                float *out);
#define DECLARE_KV_I8(T, S)                                                                   \
int store_kv_i8_##S(const char *src, int64_t token_stride, int64_t head_stride,               \
                    const int64_t *slots, int64_t num_tokens, int64_t heads, int64_t head_dim, \
                    int64_t num_slots, int8_t *cache);                                        \
int paged_attention_kv_i8_##S(const T *q, const int8_t *k_cache, const int8_t *v_cache,     \
                                const int32_t *block_tables, int64_t num_tables,              \
                                const int32_t *table_rows, const int32_t *context_lens,      \
                                const int64_t *q_rows, int64_t num_q_rows, int64_t num_entries, \
                                int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, \
                                int64_t head_dim, int64_t block_size, int64_t num_slots,     \
                                float scale, T *out);
DECLARE_KV_I8(float, f32)
DECLARE_KV_I8(uint16_t, bf16)
int i8_gemm(const uint8_t *xq, int64_t ldx, int64_t M, int64_t K, const int8_t *packed,
            const int32_t *comp, int64_t N, const float *wscale, const float *xscale,
            const float *bias, void *out, int64_t ldo, int obf16);
void quantize_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t n, uint8_t *q,
                       float *scales);
void quantize_rows_bf16(const uint16_t *x, int64_t stride, int64_t rows, int64_t n,
                        uint8_t *q, float *scales);
#define DECLARE_OPS(T, S)                                                                     \
void rms_norm_##S(const T *x, int64_t stride, const T *w, int64_t rows, int64_t n, float eps, \
                  T *out);                                                                    \
void add_rms_norm_##S(const T *x, int64_t stride, T *residual, const T *w, int64_t rows,     \
                      int64_t n, float eps, T *out);                                          \
void silu_and_mul_##S(const T *x, int64_t stride, int64_t rows, int64_t n, T *out);          \
void rotary_##S(const T *x, int64_t stride, const int64_t *positions, const float *cos_table, \
                const float *sin_table, int64_t rows, int64_t heads, int64_t d, T *out);     \
int paged_attention_##S(const T *q, const T *k_cache, const T *v_cache,                      \
                        const int32_t *block_tables, int64_t num_tables,                      \
                        const int32_t *table_rows, const int32_t *context_lens,              \
                        const int64_t *q_rows, int64_t num_q_rows, int64_t num_entries,      \
                        int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,         \
                        int64_t head_dim, int64_t block_size, int64_t num_slots, float scale, \
                        T *out);
DECLARE_OPS(float, f32)
DECLARE_OPS(uint16_t, bf16)

/* One linear layer's weight: W [n, k] of `type` (cpu_gemv.c's codes: row-major, or packed in
 * AMX tiles or panels), int8's scale per row and SmoothQuant's per input channel, bias. */
typedef struct {
    const void *w;
    const float *scales;          /* int8 only, else NULL */
    const float *in_scale;        /* int8 with SmoothQuant: x is multiplied by it; or NULL */
    const float *bias;            /* float32, or NULL */
    int32_t type;                 /* D_F32, D_BF16, D_I8, or a packed layout's (3 to 7) */
    int64_t n, k;
    const void *one_row;          /* w in 12 bits, read by steps of up to one_row_rows
                                   * tokens instead: one_row_type 6 (beside panels) or 8
                                   * (beside pair panels or AMX tiles); or NULL */
    int32_t one_row_type;
    int64_t one_row_rows;
    /* int8 on kvflow's GEMM (no AMX-INT8): the smoothed weights packed for i8_gemm (or
     * NULL), their compensation and scales (padded to 16; bias too), used past gemv_rows
     * tokens. */
    const int8_t *gemm;
    const int32_t *gemm_comp;
    const float *gemm_scales;
    int64_t gemv_rows;
} Linear;

typedef struct {
    const void *input_norm, *post_norm;   /* [hidden], model dtype */
    const void *q_norm, *k_norm;          /* [head_dim] (Qwen3), or NULL */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;              /* [num_kv_heads, num_slots, head_dim (+ 4: int8)] */
} DecodeLayer;

typedef struct {
    int32_t dtype;                        /* D_F32 or D_BF16 */
    int32_t first;                        /* 1: h is the embedding, no residual yet */
    int32_t kv_dtype;                     /* the KV cache's: dtype's, D_BF16 under D_F32, or D_I8 */
    int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, inter;
    int64_t num_slots, block_size;
    float eps, scale;
    const int64_t *positions, *slots;     /* [num_tokens] */
    const float *cos, *sin;               /* rotary tables [max_position, head_dim] */
    const int32_t *block_tables;          /* the cpu backend's metadata (CpuMetadata) */
    int64_t num_tables, max_blocks;
    const int32_t *table_rows, *context_lens;
    const int64_t *q_rows;
    /* model-dtype buffers */
    void *h;                              /* [T, hidden] in: last sublayer's output; out: this */
    void *residual;                       /* [T, hidden] the running sum */
    void *x;                              /* [T, hidden] normed */
    void *qkv;                            /* [T, (nh + 2 nkv) d] */
    void *qn, *kn;                        /* [T, nh, d], [T, nkv, d] (Qwen3's normed q, k) */
    void *q, *k;                          /* [T, nh, d], [T, nkv, d] rotated */
    void *attn;                           /* [T, nh d] */
    void *gate_up;                        /* [T, 2 inter] */
    void *act;                            /* [T, inter] */
    const void *final_norm;               /* [hidden]: the model's last norm, or NULL */
    float final_eps;                      /* its eps */
    uint8_t *xq;                          /* [T, max(hidden, inter)]: x in 8 bits (i8_gemm) */
    float *xscales;                       /* [T] */
} DecodeStep;

static inline int64_t esize(int32_t dtype) { return dtype == D_F32 ? 4 : 2; }

static inline char *at(void *base, int64_t elements, int32_t dtype) {
    return (char *)base + elements * esize(dtype);
}

static int linear(const DecodeStep *s, const Linear *l, const void *x, void *out) {
    if (l->gemm != NULL && s->num_tokens > l->gemv_rows) {
        if (s->dtype == D_F32) quantize_rows_f32(x, l->k, s->num_tokens, l->k, s->xq, s->xscales);
        else quantize_rows_bf16(x, l->k, s->num_tokens, l->k, s->xq, s->xscales);
        return i8_gemm(s->xq, l->k, s->num_tokens, l->k, l->gemm, l->gemm_comp, l->n,
                       l->gemm_scales, s->xscales, l->bias, out, l->n, s->dtype == D_BF16);
    }
    if (l->one_row != NULL && s->num_tokens <= l->one_row_rows)     /* the 12-bit copy */
        return gemv(x, s->dtype, l->k, s->num_tokens, l->one_row, l->one_row_type,
                    l->scales, l->in_scale, l->bias, l->n, l->k, out, s->dtype, l->n);
    return gemv(x, s->dtype, l->k, s->num_tokens, l->w, l->type, l->scales, l->in_scale,
                l->bias, l->n, l->k, out, s->dtype, l->n);
}

#define DISPATCH(s, OP, ...)                                                                  \
    ((s)->dtype == D_F32 ? OP##_f32(__VA_ARGS__) : OP##_bf16(__VA_ARGS__))

static void norm_input(const DecodeStep *s, const void *w, int first) {
    const int64_t T = s->num_tokens, H = s->hidden;
    if (first) {
        memcpy(s->residual, s->h, (size_t)(T * H * esize(s->dtype)));
        if (s->dtype == D_F32) rms_norm_f32(s->h, H, w, T, H, s->eps, s->x);
        else rms_norm_bf16(s->h, H, w, T, H, s->eps, s->x);
    } else if (s->dtype == D_F32) {
        add_rms_norm_f32(s->h, H, s->residual, w, T, H, s->eps, s->x);
    } else {
        add_rms_norm_bf16(s->h, H, s->residual, w, T, H, s->eps, s->x);
    }
}

/* Qwen3: RMSNorm over each head of q and k (rows of qkv, heads d apart), into qn and kn. */
static void norm_heads(const DecodeStep *s, const DecodeLayer *L, int64_t qkv_width) {
    const int64_t d = s->head_dim, nh = s->num_heads, nkv = s->num_kv_heads;
    for (int64_t t = 0; t < s->num_tokens; t++) {
        const char *row = at(s->qkv, t * qkv_width, s->dtype);
        if (s->dtype == D_F32) {
            rms_norm_f32((const float *)row, d, L->q_norm, nh, d, s->eps,
                         (float *)at(s->qn, t * nh * d, s->dtype));
            rms_norm_f32((const float *)at((void *)row, nh * d, s->dtype), d, L->k_norm, nkv, d,
                         s->eps, (float *)at(s->kn, t * nkv * d, s->dtype));
        } else {
            rms_norm_bf16((const uint16_t *)row, d, L->q_norm, nh, d, s->eps,
                          (uint16_t *)at(s->qn, t * nh * d, s->dtype));
            rms_norm_bf16((const uint16_t *)at((void *)row, nh * d, s->dtype), d, L->k_norm,
                          nkv, d, s->eps, (uint16_t *)at(s->kn, t * nkv * d, s->dtype));
        }
    }
}

/* The step's new K or V rows (`heads` rows a token, token_stride bytes apart) into a cache of
 * the step's kv_dtype: copied, rounded from float32 into bfloat16, or quantized into int8. */
static int store_rows(const DecodeStep *s, const char *src, int64_t token_stride,
                      int64_t heads, void *cache) {
    const int64_t d = s->head_dim, e = esize(s->dtype);
    if (s->kv_dtype == D_I8)
        return DISPATCH(s, store_kv_i8, src, token_stride, d * e, s->slots, s->num_tokens,
                        heads, d, s->num_slots, cache);
    if (s->kv_dtype != s->dtype)
        return store_kv_f32_to_bf16(src, token_stride, d * e, s->slots, s->num_tokens, heads,
                                    d, s->num_slots, cache);
    return store_kv(src, token_stride, d * e, s->slots, s->num_tokens, heads, d * e,
                    s->num_slots, cache);
}

/* The attention sublayer; its output (before any all-reduce) in s->h. */
int decode_attention(const DecodeLayer *L, DecodeStep *s) {
    const int64_t T = s->num_tokens, d = s->head_dim, nh = s->num_heads, nkv = s->num_kv_heads;
    const int64_t width = (nh + 2 * nkv) * d, e = esize(s->dtype);
    norm_input(s, L->input_norm, s->first);
    s->first = 0;
    if (linear(s, &L->qkv, s->x, s->qkv)) return 2;
    const void *q_src = s->qkv, *k_src = at(s->qkv, nh * d, s->dtype);
    int64_t q_stride = width, k_stride = width;
    if (L->q_norm != NULL) {
        norm_heads(s, L, width);
        q_src = s->qn, k_src = s->kn, q_stride = nh * d, k_stride = nkv * d;
    }
    DISPATCH(s, rotary, q_src, q_stride, s->positions, s->cos, s->sin, T, nh, d, s->q);
    DISPATCH(s, rotary, k_src, k_stride, s->positions, s->cos, s->sin, T, nkv, d, s->k);
    const char *v_src = at(s->qkv, (nh + nkv) * d, s->dtype);
    if (store_rows(s, (const char *)s->k, nkv * d * e, nkv, L->k_cache)
        || store_rows(s, v_src, width * e, nkv, L->v_cache))
        return 3;
    const int status =
        s->kv_dtype == D_I8                       /* an int8 cache */
            ? DISPATCH(s, paged_attention_kv_i8, s->q, L->k_cache, L->v_cache, s->block_tables,
                       s->num_tables, s->table_rows, s->context_lens, s->q_rows, T, T,
                       s->max_blocks, nh, nkv, d, s->block_size, s->num_slots, s->scale,
                       s->attn)
        : s->kv_dtype != s->dtype                 /* float32 queries, a bfloat16 cache */
            ? paged_attention_f32_kv_bf16(s->q, L->k_cache, L->v_cache, s->block_tables,
                                          s->num_tables, s->table_rows, s->context_lens,
                                          s->q_rows, T, T, s->max_blocks, nh, nkv, d,
                                          s->block_size, s->num_slots, s->scale, s->attn)
            : DISPATCH(s, paged_attention, s->q, L->k_cache, L->v_cache, s->block_tables,
                       s->num_tables, s->table_rows, s->context_lens, s->q_rows, T, T,
                       s->max_blocks, nh, nkv, d, s->block_size, s->num_slots, s->scale,
                       s->attn);
    if (status) return 10 + status;
    return linear(s, &L->o, s->attn, s->h) ? 2 : 0;
}

/* The MLP sublayer; its output (before any all-reduce) in s->h. */
int decode_mlp(const DecodeLayer *L, DecodeStep *s) {
    const int64_t T = s->num_tokens, I = s->inter;
    norm_input(s, L->post_norm, 0);
    if (linear(s, &L->gate_up, s->x, s->gate_up)) return 2;
    DISPATCH(s, silu_and_mul, s->gate_up, 2 * I, T, I, s->act);
    return linear(s, &L->down, s->act, s->h) ? 2 : 0;
}

/* The model's final norm: x = rms_norm(h + residual), residual += h. */
int decode_final_norm(DecodeStep *s) {
    const int64_t T = s->num_tokens, H = s->hidden;
    if (s->dtype == D_F32)
        add_rms_norm_f32(s->h, H, s->residual, s->final_norm, T, H, s->final_eps, s->x);
    else add_rms_norm_bf16(s->h, H, s->residual, s->final_norm, T, H, s->final_eps, s->x);
    return 0;
}

/* Every layer of a tensor-parallel size 1 model, then the final norm where final_norm is set
 * (x: the hidden states the LM head reads), else h: the last MLP's output, residual: the sum
 * before it. 0, or the first failure's code. */
int decode_layers(const DecodeLayer *layers, int64_t num_layers, DecodeStep *s) {
    for (int64_t i = 0; i < num_layers; i++) {
        int status = decode_attention(&layers[i], s);
        if (!status) status = decode_mlp(&layers[i], s);
        if (status) return status;
    }
    if (s->final_norm != NULL) decode_final_norm(s);
    return 0;
}
