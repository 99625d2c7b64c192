/* A decode step's linears as the fused step runs them, against a plain read of the same bytes
 * (benchmarks/gemv_stream.py builds and runs this; see there).
 *
 *   gemv_stream LAYOUT XTYPE ROWS LAYERS REPS SHAPES LIB [LIB ...]
 *
 * LAYOUT: cpu_gemv.c's weight code (4 panels, 5 int8 panels, 6 12-bit panels, 7 pair panels,
 * 8 12-bit pair panels); XTYPE: x's and the output's type (0 float32, 1 bfloat16), as the
 * fused step passes its dtype; SHAPES: "NxK,NxK,..." (a layer's linears in order); each LIB:
 * a build of kvflow's kernel library. Each library packs its own LAYERS copies of every
 * shape (seeded normal weights x 0.05, rounded to bfloat16; int8: to integers in -127..127)
 * into 2 MB pages, and a step calls its `gemv` once per shape and layer, every call on
 * another copy, so every byte comes from memory. The plain read: the same buffers, each
 * split evenly over the threads (OpenMP static), one 64-bit load a cache line. The
 * libraries and the read take turns, REPS rounds (the first not counted), so a drift in the
 * machine's speed falls on each.
 * Prints per library: the best and median step, GB/s of the bytes it holds, its share of the
 * plain read's speed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef int (*gemv_fn)(const void *, int, int64_t, int64_t, const void *, int, const void *,
                       const void *, const void *, int64_t, int64_t, void *, int, int64_t);
enum { MAX_LIBS = 8, MAX_SHAPES = 8, MAX_REPS = 1000 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static uint64_t seed = 88172645463325252ull;
static double uniform(void) {                                  /* xorshift64, (0, 1) */
    seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
    return ((seed >> 11) + 0.5) / 9007199254740992.0;
}
static float normal(void) {
    return (float)(sqrt(-2 * log(uniform())) * cos(6.283185307179586 * uniform()));
}

static void *in_huge_pages(size_t n) {                 /* zeroed; exits when out of memory */
    const size_t page = (size_t)2 << 20;
    n = (n + page - 1) / page * page;
    void *p = aligned_alloc(page, n);
    if (p == NULL) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0, n);
    return p;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A symbol of `lib`, or NULL (with a message) where it has none. */
static void *symbol(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (f == NULL) fprintf(stderr, "the library has no %s\n", name);
    return f;
}

/* Weights [N, K] packed by `lib` in `layout` into a new buffer (its size in *bytes), or NULL
 * where that build cannot (this layout, or this shape in it). */
typedef int (*pack_fn)(const void *, int64_t, int64_t, void *);   /* int8, pairs: 0 = done */
typedef void (*pack_void_fn)(const void *, int64_t, int64_t, void *);
static void *pack(void *lib, int layout, const uint16_t *wb, const int8_t *wi, int64_t N,
                  int64_t K, int64_t *bytes) {
    static const char *const names[] = {"pack_panels", "pack_i8_panels", "pack_panels12",
                                        "pack_pairs", "pack_pairs12"};
    if (layout < 4 || layout > 8) return NULL;
    void *fn = symbol(lib, names[layout - 4]);
    if (fn == NULL) return NULL;
    if (layout == 4) {                                /* pack_panels checks nothing itself */
        int (*width)(void) = (int (*)(void))symbol(lib, "gemv_panel_width");
        if (width == NULL || width() == 0 || N % width()) return NULL;
    }
    if (layout == 6 || layout == 8) {                                /* 12 bits: sized */
        int64_t (*size)(const uint16_t *, int64_t, int64_t) = (int64_t (*)(
            const uint16_t *, int64_t, int64_t))symbol(lib, layout == 6 ? "panels12_bytes"
                                                                        : "pairs12_bytes");
        *bytes = size == NULL ? 0 : size(wb, N, K);
        if (*bytes == 0) return NULL;
    } else {
        *bytes = N * K * (layout == 5 ? 1 : 2);
    }
    void *out = in_huge_pages((size_t)*bytes);
    const void *w = layout == 5 ? (const void *)wi : (const void *)wb;
    if (layout == 5 || layout == 7) return ((pack_fn)fn)(w, N, K, out) ? NULL : out;
    ((pack_void_fn)fn)(w, N, K, out);
    return out;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s LAYOUT XTYPE ROWS LAYERS REPS NxK,... LIB [LIB ...]\n",
                argv[0]);
        return 2;
    }
    const int layout = atoi(argv[1]), xtype = atoi(argv[2]);
    const int64_t M = atoll(argv[3]), layers = atoll(argv[4]);
    const int reps = atoi(argv[5]), nlibs = argc - 7;
    int64_t shape[MAX_SHAPES][2], nshapes = 0, maxk = 0, maxn = 0;
    for (char *s = argv[6]; *s; nshapes++) {
        char *end;
        if (nshapes == MAX_SHAPES) {
            fprintf(stderr, "at most %d shapes\n", MAX_SHAPES);
            return 2;
        }
        shape[nshapes][0] = strtoll(s, &end, 10);
        if (*end != 'x') {
            fprintf(stderr, "a shape is NxK: %s\n", s);
            return 2;
        }
        shape[nshapes][1] = strtoll(end + 1, &s, 10);
        if (shape[nshapes][0] < 1 || shape[nshapes][1] < 1 || (*s && *s != ',')) {
            fprintf(stderr, "a shape is NxK with N, K >= 1: %s\n", argv[6]);
            return 2;
        }
        if (*s == ',') s++;
        maxn = shape[nshapes][0] > maxn ? shape[nshapes][0] : maxn;
        maxk = shape[nshapes][1] > maxk ? shape[nshapes][1] : maxk;
    }
    if (nshapes == 0 || nlibs > MAX_LIBS || reps < 2 || reps > MAX_REPS || layers < 1 || M < 1
        || (xtype != 0 && xtype != 1)) {
        fprintf(stderr, "need 1..%d shapes, at most %d libraries, 2..%d rounds, layers and "
                "rows >= 1, XTYPE 0 or 1\n", MAX_SHAPES, MAX_LIBS, MAX_REPS);
        return 2;
    }
    void *lib[MAX_LIBS];
    gemv_fn gemv[MAX_LIBS];
    for (int i = 0; i < nlibs; i++) {
        lib[i] = dlopen(argv[7 + i], RTLD_NOW | RTLD_LOCAL);
        if (lib[i] == NULL) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        gemv[i] = (gemv_fn)symbol(lib[i], "gemv");
        if (gemv[i] == NULL) return 1;
    }
    /* the weights, then each library's copies */
    void **w = calloc((size_t)(nlibs * layers * nshapes), sizeof(void *));
    int64_t *bytes = calloc((size_t)(nlibs * layers * nshapes), sizeof(int64_t));
    float *scales = malloc((size_t)maxn * sizeof(float));
    for (int64_t n = 0; n < maxn; n++) scales[n] = 0.2f / 127;
    int64_t total[MAX_LIBS] = {0};
    int usable[MAX_LIBS];
    for (int i = 0; i < nlibs; i++) usable[i] = 1;
    for (int64_t m = 0; m < nshapes; m++) {
        const int64_t N = shape[m][0], K = shape[m][1];
        uint16_t *wb = malloc((size_t)(N * K) * 2);
        int8_t *wi = malloc((size_t)(N * K));
        for (int64_t e = 0; e < N * K; e++) {
            const float v = normal() * 0.05f;
            const long q = lrintf(v / 0.2f * 127);
            wb[e] = to_bf16(v);
            wi[e] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
        for (int i = 0; i < nlibs; i++)
            for (int64_t l = 0; l < layers && usable[i]; l++) {
                const int64_t at = (i * layers + l) * nshapes + m;
                w[at] = pack(lib[i], layout, wb, wi, N, K, &bytes[at]);
                usable[i] = w[at] != NULL;
                total[i] += bytes[at];
            }
        free(wb), free(wi);
    }
    float *x = malloc((size_t)(M * maxk) * sizeof(float));     /* float32 x, or bfloat16 in */
    for (int64_t e = 0; e < M * maxk; e++) {                   /* its first half */
        const float v = normal();
        if (xtype == 0) x[e] = v;
        else ((uint16_t *)x)[e] = to_bf16(v);
    }
    float *out = malloc((size_t)(M * maxn) * sizeof(float));
    static double step[MAX_LIBS][MAX_REPS], plain[MAX_LIBS][MAX_REPS];
    volatile int64_t sink = 0;
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < nlibs; i++) {
            if (!usable[i]) continue;
            double start = now();
            for (int64_t l = 0; l < layers; l++)
                for (int64_t m = 0; m < nshapes; m++) {
                    const int64_t at = (i * layers + l) * nshapes + m;
                    if (gemv[i](x, xtype, shape[m][1], M, w[at], layout,
                                layout == 5 ? scales : NULL, NULL, NULL, shape[m][0],
                                shape[m][1], out, xtype, shape[m][0])) {
                        fprintf(stderr, "%s: gemv refused %lld rows x %lldx%lld in layout %d "
                                "(x type %d)\n", argv[7 + i], (long long)M,
                                (long long)shape[m][0], (long long)shape[m][1], layout, xtype);
                        return 1;
                    }
                }
            step[i][r] = now() - start;
            start = now();
            int64_t acc = 0;
            for (int64_t l = 0; l < layers; l++)
                for (int64_t m = 0; m < nshapes; m++) {
                    const int64_t at = (i * layers + l) * nshapes + m;
                    const char *p = w[at];
                    const int64_t lines = bytes[at] / 64;
                    #pragma omp parallel for schedule(static) reduction(^ : acc)
                    for (int64_t c = 0; c < lines; c++)
                        acc ^= *(const volatile int64_t *)(p + c * 64);
                }
            sink ^= acc;
            plain[i][r] = now() - start;
        }
    for (int i = 0; i < nlibs; i++) {
        if (!usable[i]) {
            printf("%s: this build cannot pack these shapes in layout %d\n", argv[7 + i],
                   layout);
            continue;
        }
        qsort(step[i] + 1, (size_t)(reps - 1), sizeof(double), cmp_double);
        qsort(plain[i] + 1, (size_t)(reps - 1), sizeof(double), cmp_double);
        const double best = step[i][1], median = step[i][1 + (reps - 1) / 2];
        const double read = plain[i][1], read_median = plain[i][1 + (reps - 1) / 2];
        printf("%s: %.1f MB a step; best %.3f ms (%.1f GB/s), median %.3f ms (%.1f GB/s); "
               "plain read best %.3f ms (%.1f GB/s), median %.3f; kernel / read %.0f%% (best), "
               "%.0f%% (median)\n", argv[7 + i], total[i] / 1e6, best * 1e3, total[i] / best / 1e9,
               median * 1e3, total[i] / median / 1e9, read * 1e3, total[i] / read / 1e9,
               read_median * 1e3, 100 * read / best, 100 * read_median / median);
    }
    return (int)(sink & 0);
}
