/* The int8 GEMM of CPUs without AMX-INT8 (cpu_ops.py `i8_gemm`): out = x W^T for
 * prefill-sized products of Int8Linear (layers/linear.py), activations in uint8 with zero
 * point 128 (quantize_rows) and 7-bit weights (|w| <= 63, gemm_weight_levels) on AVX2, 8-bit
 * ones where the build has AVX512-VNNI (below, i8g_gemm512), exact 32-bit integer sums, then
 * each output scaled by its weight row's and its token's scale.
 *
 * Why not oneDNN's: without VNNI an x86 core multiplies bytes with vpmaddubsw (32 u8 x s8
 * products, summed in pairs into 16 bits; 2 x 255 x 63 never saturates) and widens the pairs
 * with vpmaddwd against ones: two multiplies and an add per 32 products, ~1.7x the products
 * a cycle of float32 FMAs (a Zen 3 core: ~80 against ~48 G a second). oneDNN's u8 x s8 GEMM
 * on that path reached 60% of it on the default model's prefill shapes; this kernel keeps a
 * 4 x 16 tile of sums in registers (8 vectors), with the weights packed once at load into
 * panels of 16 outputs by groups of 4 inputs ([N / 16][K / 4][16][4], `i8_gemm_pack`), so
 * each step loads two vectors of weights and broadcasts 4 bytes of each of 4 rows.
 *
 * The sums: sum_k q_x[m][k] w[n][k] over uint8 q_x = x_int + 128, so the packed weights come
 * with comp[n] = 128 sum_k w[n][k], subtracted before scaling:
 *   out[m][n] = (float)(acc - comp[n]) * wscale[n] * xscale[m] (+ bias[n]).
 * AVX2 (an AVX-512 build without VNNI runs it too: every CPU with AVX-512 has AVX2), or
 * AVX512-VNNI; elsewhere the functions return -1 and Int8Linear uses oneDNN's GEMM. */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* The AVX512-VNNI path (below, i8g_gemm512) where the build has it. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512VNNI__)
#define I8G_VNNI 1
#endif

#define I8G_NR 16          /* outputs a panel */
#define I8G_MR 4           /* rows a tile */
#define I8G_MB 64          /* rows a work item: its x rows stay in L2 over every panel */

static inline int64_t i8g_kp(int64_t K) { return (K + 3) / 4 * 4; }

/* 1 where this build has the kernel (AVX2), else 0. */
int i8_gemm_available(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* The weight range this build's kernel takes, |w| <= this: 127 with AVX512-VNNI (vpdpbusd adds
 * four u8 x s8 products into 32 bits, nothing saturates), else 63 (AVX2, above); 0 without. */
int i8_gemm_weight_levels(void) {
#ifdef I8G_VNNI
    return 127;
#elif defined(__AVX2__)
    return 63;
#else
    return 0;
#endif
}

/* Bytes of the packed weights of an [N, K] int8 matrix. */
int64_t i8_gemm_packed_bytes(int64_t N, int64_t K) {
    return (N + I8G_NR - 1) / I8G_NR * I8G_NR * i8g_kp(K);
}

/* w [N, K] int8 row-major -> out (i8_gemm_packed_bytes), comp [N padded to 16] int32. */
int i8_gemm_pack(const int8_t *w, int64_t N, int64_t K, int8_t *out, int32_t *comp) {
#if defined(__AVX2__)
    const int64_t kp = i8g_kp(K), panels = (N + I8G_NR - 1) / I8G_NR;
    #pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = out + p * I8G_NR * kp;
        for (int64_t g = 0; g < kp / 4; g++)
            for (int j = 0; j < I8G_NR; j++)
                for (int i = 0; i < 4; i++) {
                    const int64_t n = p * I8G_NR + j, k = g * 4 + i;
                    dst[(g * I8G_NR + j) * 4 + i] = n < N && k < K ? w[n * K + k] : 0;
                }
        for (int j = 0; j < I8G_NR; j++) {
            const int64_t n = p * I8G_NR + j;
            int32_t s = 0;
            for (int64_t k = 0; n < N && k < K; k++) s += w[n * K + k];
            comp[n] = 128 * s;
        }
    }
    return 0;
#else
    (void)w; (void)N; (void)K; (void)out; (void)comp;
    return -1;
#endif
}

#if defined(__AVX2__)
/* 4 bytes of x at k (k + 4 <= K), or the last group's K % 4 bytes and zeros. */
static inline __m256i i8g_bcast(const uint8_t *x, int64_t k, int64_t K) {
    int32_t v = 0;
    memcpy(&v, x + k, (size_t)(K - k < 4 ? K - k : 4));
    return _mm256_set1_epi32(v);
}

/* One tile: MR (<= 4, a constant after inlining) rows of x from x0 by one panel's 16
 * outputs, n0 .. n0 + nv - 1 of out. */
static inline __attribute__((always_inline)) void i8g_tile(
        const int MR, const uint8_t *x0, int64_t ldx, int64_t K, const int8_t *panel,
        const int8_t *pf,
        const int32_t *comp, const float *wscale, const float *xscale, const float *bias,
        void *out, int64_t ldo, int64_t nv, int obf16) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* Named sums (not an array): GCC kept one of an array's eight on the stack. */
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00,
            s21 = s00, s30 = s00, s31 = s00;
    const int64_t full = K / 4;
    const int8_t *b = panel;
    const uint8_t *x1 = x0 + ldx, *x2 = x0 + 2 * ldx, *x3 = x0 + 3 * ldx;
    if (MR == 4 && full > 0) {
        /* The hot loop in assembly: with intrinsics GCC kept sums on the stack (it issued
         * every row's products first, needing 8 more registers than there are). */
        const int64_t ldx3 = 3 * ldx;
        const uint8_t *xp = x0;
        const int8_t *b_end = b + full * 4 * I8G_NR;
        __m256i b0, b1, a, t;       /* one temporary: renaming keeps the products apart */
        __asm__ volatile(
            "1:\n\t"
            "prefetcht0 (%[pf])\n\t"
            "add $64, %[pf]\n\t"
            "vmovdqu (%[b]), %t[b0]\n\t"
            "vmovdqu 32(%[b]), %t[b1]\n\t"
#define I8G_ROW(ADDR, S0, S1)                                                                  \
            "vpbroadcastd " ADDR ", %t[a]\n\t"                                                  \
            "vpmaddubsw %t[b0], %t[a], %t[t]\n\t"                                               \
            "vpmaddwd %t[ones], %t[t], %t[t]\n\t"                                               \
            "vpaddd %t[t], %t[" S0 "], %t[" S0 "]\n\t"                                            \
            "vpmaddubsw %t[b1], %t[a], %t[t]\n\t"                                               \
            "vpmaddwd %t[ones], %t[t], %t[t]\n\t"                                               \
            "vpaddd %t[t], %t[" S1 "], %t[" S1 "]\n\t"
            I8G_ROW("(%[x])", "s00", "s01")
            I8G_ROW("(%[x],%[ldx])", "s10", "s11")
            I8G_ROW("(%[x],%[ldx],2)", "s20", "s21")
            I8G_ROW("(%[x],%[ldx3])", "s30", "s31")
#undef I8G_ROW
            "add $64, %[b]\n\t"
            "add $4, %[x]\n\t"
            "cmp %[b_end], %[b]\n\t"
            "jne 1b\n\t"
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
              [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
              [b0] "=&x"(b0), [b1] "=&x"(b1), [a] "=&x"(a), [t] "=&x"(t),
              [b] "+r"(b), [x] "+r"(xp), [pf] "+r"(pf)
            : [ones] "x"(ones), [ldx] "r"(ldx), [ldx3] "r"(ldx3), [b_end] "r"(b_end)
            : "memory", "cc");
    } else {
#define I8G_ROW(S0, S1, XR, K0)                                                              \
    {   int32_t v;                                                                            \
        memcpy(&v, XR + (K0), 4);                                                             \
        const __m256i a = _mm256_set1_epi32(v);                                               \
        S0 = _mm256_add_epi32(S0, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));      \
        S1 = _mm256_add_epi32(S1, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones)); }
        for (int64_t g = 0; g < full; g++, b += 4 * I8G_NR) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 32));
            I8G_ROW(s00, s01, x0, g * 4)
            if (MR > 1) I8G_ROW(s10, s11, x1, g * 4)
            if (MR > 2) I8G_ROW(s20, s21, x2, g * 4)
        }
#undef I8G_ROW
    }
    if (full * 4 < K) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 32));
        const uint8_t *xr[4] = {x0, x1, x2, x3};
        __m256i *sr[4][2] = {{&s00, &s01}, {&s10, &s11}, {&s20, &s21}, {&s30, &s31}};
        for (int r = 0; r < MR; r++) {
            const __m256i a = i8g_bcast(xr[r], full * 4, K);
            *sr[r][0] = _mm256_add_epi32(*sr[r][0],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
            *sr[r][1] = _mm256_add_epi32(*sr[r][1],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
        }
    }
    /* Lane j of the sums s_r0 (s_r1) is output j (8 + j): vpmaddwd already added each
     * group's 4 products. */
    const __m256i acc[I8G_MR][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
    float tmp[I8G_NR];
    for (int r = 0; r < MR; r++) {
        const __m256 xs = _mm256_set1_ps(xscale[r]);
        float *o = nv == I8G_NR && !obf16 ? (float *)out + r * ldo : tmp;
        for (int h = 0; h < 2; h++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(comp + 8 * h));
            __m256 y = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][h], c));
            y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_loadu_ps(wscale + 8 * h)), xs);
            if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(o + 8 * h, y);
        }
        if (obf16) {                         /* rounded to nearest even, as torch rounds */
            uint16_t *ob = (uint16_t *)out + r * ldo;
            for (int64_t j = 0; j < nv; j++) {
                uint32_t u;
                memcpy(&u, tmp + j, 4);
                u += 0x7FFFu + ((u >> 16) & 1u);
                ob[j] = (uint16_t)(u >> 16);
            }
        } else if (o == tmp) {
            memcpy((float *)out + r * ldo, tmp, (size_t)nv * sizeof(float));
        }
    }
}
#endif


/* --- AVX512-VNNI (AMD EPYC Zen 4/5, Intel Cascade Lake to Ice Lake) ---------------------------
 * vpdpbusd multiplies 4 u8 x s8 pairs a lane and adds them into its 32-bit sum: 64 products
 * an instruction, no 16-bit step, so the weights keep 8 bits (i8_gemm_weight_levels). One zmm
 * load is a panel's group of 4 inputs (16 outputs x 4); a tile is I8G_MR512 rows by two
 * panels (32 outputs), 2 I8G_MR512 sums in registers, each step 2 weight loads and a 4-byte
 * broadcast a row. The same packed layout, comp and scaling as the AVX2 tile above. */
#ifdef I8G_VNNI
#define I8G_MR512 8

static inline __attribute__((always_inline)) void i8g_out512(
        __m512i acc, const int32_t *comp, const float *wscale, float xs, const float *bias,
        void *out, int64_t nv, int obf16) {
    if (nv <= 0) return;
    __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(comp)));
    y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_loadu_ps(wscale)), _mm512_set1_ps(xs));
    if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias));
    const __mmask16 m = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
    if (obf16) {                             /* rounded to nearest even, as torch rounds */
        __m512i u = _mm512_castps_si512(y);
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        _mm256_mask_storeu_epi16(out, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_mask_storeu_ps(out, m, y);
    }
}

/* MR (<= I8G_MR512, a constant after inlining) rows of x from x0 by NP (1 or 2) panels from
 * p0 (the second one panel further), outputs n0 .. n0 + nv - 1 of out (out at n0). */
static inline __attribute__((always_inline)) void i8g_tile512(
        const int MR, const int NP, const uint8_t *x0, int64_t ldx, int64_t K,
        const int8_t *p0, int64_t panel_bytes, const int8_t *pf, const int32_t *comp,
        const float *wscale, const float *xscale, const float *bias, void *out, int64_t ldo,
        int64_t nv, int obf16) {
    __m512i s[I8G_MR512][2];
    for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
    const int64_t full = K / 4, groups = (K + 3) / 4;
    const int8_t *p1 = p0 + panel_bytes;
#define I8G_STEP512(g, LOADX)                                                                 \
    {   const __m512i b0 = _mm512_loadu_si512(p0 + (g) * 64);                                 \
        const __m512i b1 = NP == 2 ? _mm512_loadu_si512(p1 + (g) * 64) : b0;                  \
        for (int r = 0; r < MR; r++) {                                                        \
            int32_t v = 0;                                                                    \
            LOADX;                                                                            \
            const __m512i a = _mm512_set1_epi32(v);                                           \
            s[r][0] = _mm512_dpbusd_epi32(s[r][0], a, b0);                                    \
            if (NP == 2) s[r][1] = _mm512_dpbusd_epi32(s[r][1], a, b1);                       \
        } }
    if (MR == 8 && NP == 2 && full > 0) {
        /* The hot loop in assembly: with intrinsics GCC copied the sums between registers
         * every step and kept two on the stack (vpdpbusd overwrites its sum). Sums s[r][h]
         * in zmm(2r + h), the weights in zmm16/17, a row's broadcast in zmm18. */
        const int64_t ldx3 = 3 * ldx;
        const uint8_t *xp = x0, *xp4 = x0 + 4 * ldx;
        const int8_t *b = p0, *b_end = p0 + full * 64;
        const int8_t *pfp = pf != NULL ? pf : p0;     /* no next panel: its own lines, cached */
        __asm__ volatile(
#define I8G_LOAD(i) "vmovdqu64 " #i "*64(%[acc]), %%zmm" #i "\n\t"
#define I8G_SAVE(i) "vmovdqu64 %%zmm" #i ", " #i "*64(%[acc])\n\t"
            I8G_LOAD(0) I8G_LOAD(1) I8G_LOAD(2) I8G_LOAD(3) I8G_LOAD(4) I8G_LOAD(5)
            I8G_LOAD(6) I8G_LOAD(7) I8G_LOAD(8) I8G_LOAD(9) I8G_LOAD(10) I8G_LOAD(11)
            I8G_LOAD(12) I8G_LOAD(13) I8G_LOAD(14) I8G_LOAD(15)
            "1:\n\t"
            "prefetcht0 (%[pf])\n\t"
            "add $64, %[pf]\n\t"
            "vmovdqu64 (%[b]), %%zmm16\n\t"
            "vmovdqu64 (%[b],%[pb]), %%zmm17\n\t"
#define I8G_ROW512(ADDR, S0, S1)                                                              \
            "vpbroadcastd " ADDR ", %%zmm18\n\t"                                               \
            "vpdpbusd %%zmm16, %%zmm18, %%zmm" #S0 "\n\t"                                      \
            "vpdpbusd %%zmm17, %%zmm18, %%zmm" #S1 "\n\t"
            I8G_ROW512("(%[x])", 0, 1)
            I8G_ROW512("(%[x],%[ldx])", 2, 3)
            I8G_ROW512("(%[x],%[ldx],2)", 4, 5)
            I8G_ROW512("(%[x],%[ldx3])", 6, 7)
            I8G_ROW512("(%[x4])", 8, 9)
            I8G_ROW512("(%[x4],%[ldx])", 10, 11)
            I8G_ROW512("(%[x4],%[ldx],2)", 12, 13)
            I8G_ROW512("(%[x4],%[ldx3])", 14, 15)
            "add $64, %[b]\n\t"
            "add $4, %[x]\n\t"
            "add $4, %[x4]\n\t"
            "cmp %[b_end], %[b]\n\t"
            "jne 1b\n\t"
            I8G_SAVE(0) I8G_SAVE(1) I8G_SAVE(2) I8G_SAVE(3) I8G_SAVE(4) I8G_SAVE(5)
            I8G_SAVE(6) I8G_SAVE(7) I8G_SAVE(8) I8G_SAVE(9) I8G_SAVE(10) I8G_SAVE(11)
            I8G_SAVE(12) I8G_SAVE(13) I8G_SAVE(14) I8G_SAVE(15)
#undef I8G_ROW512
#undef I8G_LOAD
#undef I8G_SAVE
            : [b] "+r"(b), [x] "+r"(xp), [x4] "+r"(xp4), [pf] "+r"(pfp)
            : [acc] "r"(&s[0][0]), [ldx] "r"(ldx), [ldx3] "r"(ldx3), [pb] "r"(panel_bytes),
              [b_end] "r"(b_end)
            : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
              "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16",
              "xmm17", "xmm18");
    } else
        for (int64_t g = 0; g < full; g++) {
            if (pf != NULL) _mm_prefetch((const char *)pf + g * 64, _MM_HINT_T0);
            I8G_STEP512(g, memcpy(&v, x0 + r * ldx + g * 4, 4))
        }
    if (groups > full)                                                     /* the last group */
        I8G_STEP512(full, memcpy(&v, x0 + r * ldx + full * 4, (size_t)(K - full * 4)))
#undef I8G_STEP512
    const int64_t es = obf16 ? 2 : 4;
    for (int r = 0; r < MR; r++) {
        char *o = (char *)out + r * ldo * es;
        i8g_out512(s[r][0], comp, wscale, xscale[r], bias, o, nv, obf16);
        if (NP == 2)
            i8g_out512(s[r][1], comp + I8G_NR, wscale + I8G_NR, xscale[r],
                       bias ? bias + I8G_NR : NULL, o + I8G_NR * es, nv - I8G_NR, obf16);
    }
}

/* i8_gemm on this path: work items of I8G_MB rows by a pair of panels. */
static void i8g_gemm512(const uint8_t *xq, int64_t ldx, int64_t M, int64_t K,
                        const int8_t *packed, const int32_t *comp, int64_t N,
                        const float *wscale, const float *xscale, const float *bias, void *out,
                        int64_t ldo, int obf16) {
    const int64_t kp = i8g_kp(K), panels = (N + I8G_NR - 1) / I8G_NR, pairs = (panels + 1) / 2;
    const int64_t mblocks = (M + I8G_MB - 1) / I8G_MB, items = mblocks * pairs;
    const int64_t panel_bytes = I8G_NR * kp, es = obf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (M * N * K > 262144)
    for (int64_t item = 0; item < items; item++) {
        const int64_t mb = item / pairs, q = item % pairs;
        const int64_t n0 = q * 2 * I8G_NR, nv = N - n0 < 2 * I8G_NR ? N - n0 : 2 * I8G_NR;
        const int np = nv > I8G_NR ? 2 : 1;
        const int8_t *p0 = packed + 2 * q * panel_bytes;
        const int64_t m_end = (mb + 1) * I8G_MB < M ? (mb + 1) * I8G_MB : M;
        const float *b = bias ? bias + n0 : NULL;
        /* the first tile of an item brings the next pair's first panel into L1, a line a step */
        const int8_t *next = q + 1 < pairs && M <= 48 ? p0 + 2 * panel_bytes : NULL;
        int64_t m = mb * I8G_MB;
#define I8G_AT(m) xq + (m) * ldx, ldx, K, p0, panel_bytes, (m) == mb * I8G_MB ? next : NULL,  \
                  comp + n0, wscale + n0, xscale + (m), b, (char *)out + ((m) * ldo + n0) * es, \
                  ldo, nv, obf16
#define I8G_TILES(NP)                                                                         \
        for (; m + I8G_MR512 <= m_end; m += I8G_MR512) i8g_tile512(I8G_MR512, NP, I8G_AT(m)); \
        switch (m_end - m) {                                                                  \
        case 7: i8g_tile512(7, NP, I8G_AT(m)); break;                                         \
        case 6: i8g_tile512(6, NP, I8G_AT(m)); break;                                         \
        case 5: i8g_tile512(5, NP, I8G_AT(m)); break;                                         \
        case 4: i8g_tile512(4, NP, I8G_AT(m)); break;                                         \
        case 3: i8g_tile512(3, NP, I8G_AT(m)); break;                                         \
        case 2: i8g_tile512(2, NP, I8G_AT(m)); break;                                         \
        case 1: i8g_tile512(1, NP, I8G_AT(m)); break;                                         \
        default: break;                                                                       \
        }
        if (np == 2) { I8G_TILES(2) } else { I8G_TILES(1) }
#undef I8G_TILES
#undef I8G_AT
    }
}
#endif

/* out [M, N] float32, or bfloat16 where obf16 (row stride ldo) = dequantized xq [M, K]
 * (uint8, zero point 128, row stride ldx; x ~ (xq - 128) * xscale[m]) times the packed
 * weights' [N, K] (w ~ q * wscale[n]), plus bias [N] (float32) or NULL. wscale and bias are
 * read in whole panels: both padded to a multiple of 16 (cpu_ops.py pads them). */
int i8_gemm(const uint8_t *xq, int64_t ldx, int64_t M, int64_t K, const int8_t *packed,
            const int32_t *comp, int64_t N, const float *wscale, const float *xscale,
            const float *bias, void *out, int64_t ldo, int obf16) {
#ifdef I8G_VNNI
    i8g_gemm512(xq, ldx, M, K, packed, comp, N, wscale, xscale, bias, out, ldo, obf16);
    return 0;
#elif defined(__AVX2__)
    const int64_t kp = i8g_kp(K), panels = (N + I8G_NR - 1) / I8G_NR;
    const int64_t mblocks = (M + I8G_MB - 1) / I8G_MB, items = mblocks * panels;
    #pragma omp parallel for schedule(static) if (M * N * K > 262144)
    for (int64_t item = 0; item < items; item++) {
        const int64_t mb = item / panels, p = item % panels;
        const int64_t n0 = p * I8G_NR, nv = N - n0 < I8G_NR ? N - n0 : I8G_NR;
        const int8_t *panel = packed + p * I8G_NR * kp;
        const int64_t m_end = (mb + 1) * I8G_MB < M ? (mb + 1) * I8G_MB : M;
        const float *b = bias ? bias + n0 : NULL;
        const int64_t es = obf16 ? 2 : 4;
        int64_t m = mb * I8G_MB;
        /* The first tile of an item also brings the next panel's weights into L1, a line
         * a step (the weights of a few-row product come from memory). */
        const int8_t *next = p + 1 < panels && M <= 48 ? panel + I8G_NR * kp : panel;
#define I8G_AT(m) xq + (m) * ldx, ldx, K, panel, (m) == mb * I8G_MB ? next : panel,         \
                  comp + n0, wscale + n0, xscale + (m), b,                                    \
                  (char *)out + ((m) * ldo + n0) * es, ldo, nv, obf16
        for (; m + I8G_MR <= m_end; m += I8G_MR) i8g_tile(4, I8G_AT(m));
        switch (m_end - m) {
        case 3: i8g_tile(3, I8G_AT(m)); break;
        case 2: i8g_tile(2, I8G_AT(m)); break;
        case 1: i8g_tile(1, I8G_AT(m)); break;
        default: break;
        }
#undef I8G_AT
    }
    return 0;
#else
    (void)xq; (void)ldx; (void)M; (void)K; (void)packed; (void)comp; (void)N; (void)wscale;
    (void)xscale; (void)bias; (void)out; (void)ldo; (void)obf16;
    return -1;
#endif
}
