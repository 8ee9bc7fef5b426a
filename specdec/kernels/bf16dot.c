/* bf16 x bf16 matmul for decoding on CPUs with bf16 dot products: y[T, N] = bf16(x)[T, K] @ W[N, K]^T
 * (+ bias), fp32 sums. x is rounded to bfloat16 (nearest even) once per call, so every product is
 * exact in fp32 and only the sums round: what llama.cpp's BF16 matmul computes (its vec_dot_type) and
 * what the prompt pass's oneDNN matmul takes as input (specdec/quant/bf16.py).
 *
 * Why: gemv.c's bf16 path widens each weight to fp32 and does fp32 FMAs; at 5+ rows a verify pass is
 * bound by those FMAs, not by memory. vdpbf16ps does 32 multiply-adds per instruction where an fp32
 * FMA does 16 and needs no widening, so the rows a verify pass adds cost about half. A whole forward of
 * SmolLM2-135M over T new tokens after 128 cached (2-vCPU AMD EPYC Zen 4, one process, the two paths
 * interleaved, medians of 4 x 5): T = 1 / 2 / 4 / 6 / 8 / 12 / 16, widened fp32 FMAs 10.3 / 12.0 / 12.7 /
 * 15.1 / 19.2 / 26.1 / 34.3 ms, this kernel 10.6 / 10.7 / 11.0 / 11.8 / 13.0 / 16.7 / 21.0: c(8) / c(1)
 * 1.87 -> 1.24.
 *
 * Every y[t, n] is one 16-lane accumulator striding over k in steps of 32 (a vdpbf16ps adds two products
 * per lane), a fixed horizontal sum, then the scalar tail: the same order for every tile shape, so a
 * verify pass over T rows equals T single-row passes bit for bit (batch invariance). Tiles hold up to
 * DOT_ROWS weight rows x DOT_T input rows (16 accumulators, 4 inputs, 1 weight: 21 of 32 registers);
 * 16 independent chains hide the instruction's latency. Weight rows go by blocks of DOT_BLOCK rows, and
 * while the input tiles pass over one block the next is prefetched, spread evenly over the tiles (without
 * it the kernel waited on DRAM: T = 1 / 4 rows 12.8 / 18.2 ms instead of 10.4 / 12.5).
 *
 * Where AMX is on, a matrix packed as tiles goes to bf16amx.c instead (specdec_linear_bf16_tiles).
 *
 * Without AVX512-BF16 the same function rounds x and calls gemv.c's widening kernel: the same values up
 * to summation order (and batch invariant too), so the semantics can be tested on any x86 machine.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include "common.h"

void specdec_linear_bf16(const float *x, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K,
                         int64_t N);
int specdec_amx_linear(const uint16_t *xb, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K,
                       int64_t N);

#define DOT_ROWS 4   /* weight rows per tile */
#define DOT_T 4      /* input rows per tile */
#ifndef MIN_TILES
#define MIN_TILES 2 /* 2-4 input rows go in two tiles (the weights re-read from L1): the next block's
                       prefetches are then spread over twice the calls; in one tile T = 2-4 cost ~1.2x T = 1 */
#endif
#define DOT_BLOCK 16 /* weight rows per block (prefetch unit): 16 / 32 / 48 measured alike */

/* fp32 -> bf16, round to nearest even (NaN stays NaN): what vcvtneps2bf16 and torch's .bfloat16() do */
static inline uint16_t round_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* The calling thread's buffer for the rounded inputs (bf16, or widened back to fp32 without AVX512-BF16),
 * grown as needed and kept; NULL if it cannot grow. */
static void *input_buffer(int64_t bytes) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    return grow_buffer(&buf, &size, bytes);
}

#if defined(__AVX512BF16__)
static void round_rows(const float *x, uint16_t *xb, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_store_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) xb[i] = round_bf16(x[i]);
}

/* x [n] rounded to bf16 in the calling thread's input buffer; NULL if it cannot grow. */
static const uint16_t *rounded(const float *x, int64_t n) {
    uint16_t *xb = input_buffer((int64_t)sizeof(uint16_t) * n);
    if (xb != NULL) round_rows(x, xb, n);
    return xb;
}

static inline __attribute__((always_inline)) void dot_tile(const uint16_t *W, const uint16_t *x, float *y,
                                                           const int nr, const int nt, int64_t K, int64_t N) {
    __m512 acc[DOT_ROWS][DOT_T];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[DOT_T];
        for (int t = 0; t < nt; t++) {
            xv[t] = (__m512bh)_mm512_loadu_si512(x + t * K + k);
            __asm__("" : "+v"(xv[t])); /* keep the inputs in registers across the weight rows */
        }
        for (int r = 0; r < nr; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(W + r * K + k);
            __asm__("" : "+v"(wv));
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float v = _mm512_reduce_add_ps(acc[r][t]);
            for (int64_t j = k; j < K; j++) {
                union { uint32_t u; float f; } w = {.u = (uint32_t)W[r * K + j] << 16}, xj = {.u = (uint32_t)x[t * K + j] << 16};
                v = fmaf(w.f, xj.f, v);
            }
            y[t * N + r] = v;
        }
}

/* One function per tile shape, compiled on its own (literal shapes keep the accumulators in registers). */
#define DOT_SHAPE(r, t) \
    static __attribute__((noinline)) void dot_##r##x##t(const uint16_t *W, const uint16_t *x, float *y, int64_t K, int64_t N) \
    { dot_tile(W, x, y, r, t, K, N); }
DOT_SHAPE(1, 1) DOT_SHAPE(1, 2) DOT_SHAPE(1, 3) DOT_SHAPE(1, 4) DOT_SHAPE(2, 1) DOT_SHAPE(2, 2) DOT_SHAPE(2, 3)
DOT_SHAPE(2, 4) DOT_SHAPE(3, 1) DOT_SHAPE(3, 2) DOT_SHAPE(3, 3) DOT_SHAPE(3, 4) DOT_SHAPE(4, 1) DOT_SHAPE(4, 2)
DOT_SHAPE(4, 3) DOT_SHAPE(4, 4)
typedef void (*dot_fn)(const uint16_t *, const uint16_t *, float *, int64_t, int64_t);
static const dot_fn dot_shapes[DOT_ROWS][DOT_T] = {{dot_1x1, dot_1x2, dot_1x3, dot_1x4}, {dot_2x1, dot_2x2, dot_2x3, dot_2x4},
                                                   {dot_3x1, dot_3x2, dot_3x3, dot_3x4}, {dot_4x1, dot_4x2, dot_4x3, dot_4x4}};

typedef struct {
    const uint16_t *W, *x; /* [N, K] weights, [T, K] rounded inputs */
    const float *bias;
    float *y;
    int64_t T, K, N;
} DotJob;

/* Output rows [lo, hi) by blocks of DOT_BLOCK; input rows in near-equal tiles of at most DOT_T. */
static void dot_rows(const DotJob *j, int64_t lo, int64_t hi) {
    const int64_t K = j->K, T = j->T, ntiles = T >= 2 && T <= DOT_T ? MIN_TILES : (T + DOT_T - 1) / DOT_T;
    for (int64_t b = lo; b < hi; b += DOT_BLOCK) {
        const int64_t end = b + DOT_BLOCK < hi ? b + DOT_BLOCK : hi;
        const int64_t next_rows = hi - end < DOT_BLOCK ? hi - end : DOT_BLOCK;
        const char *next = (const char *)(j->W + end * K);
        const int64_t next_lines = next_rows * K * 2 / 64, calls = ntiles * ((end - b + DOT_ROWS - 1) / DOT_ROWS);
        int64_t call = 0, fetched = 0;
        for (int64_t n = b; n < end; n += DOT_ROWS) {
            const int nr = end - n >= DOT_ROWS ? DOT_ROWS : (int)(end - n);
            for (int64_t i = 0, t0 = 0, nt; i < ntiles; i++, t0 += nt) {
                for (const int64_t upto = next_lines * ++call / calls; fetched < upto; fetched++)
                    _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
                nt = (T - t0) / (ntiles - i);
                dot_shapes[nr - 1][nt - 1](j->W + n * K, j->x + t0 * K, j->y + t0 * j->N + n, K, j->N);
            }
            if (j->bias)
                for (int64_t t = 0; t < T; t++)
                    for (int r = 0; r < nr; r++) j->y[t * j->N + n + r] += j->bias[n + r];
        }
    }
}

/* Thread `me` of nth: a contiguous, near-equal share of the DOT_ROWS-row groups (a static schedule). */
static void dot_share(void *ctx, int64_t me, int64_t nth) {
    const DotJob *j = ctx;
    const int64_t groups = (j->N + DOT_ROWS - 1) / DOT_ROWS;
    const int64_t lo = groups * me / nth * DOT_ROWS, hi_group = groups * (me + 1) / nth * DOT_ROWS;
    const int64_t hi = hi_group < j->N ? hi_group : j->N;
    if (lo < hi) dot_rows(j, lo, hi);
}
#endif

/* 1 where this build multiplies with vdpbf16ps, 0 where it rounds and widens (gemv.c) */
int specdec_bf16_dot_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* x: [T, K] fp32, W: [N, K] bfloat16 (raw 16 bits), bias: [N] or NULL, y: [T, N]:
 * y = bf16(x) @ float(W)^T + bias with fp32 sums. 0, or -1 when the input buffer cannot be allocated. */
int specdec_linear_bf16_dot(const float *x, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K,
                            int64_t N) {
#if defined(__AVX512BF16__)
    const uint16_t *xb = rounded(x, T * K);
    if (xb == NULL) return -1;
    DotJob job = {W, xb, bias, y, T, K, N};
    specdec_parallel(dot_share, &job, specdec_num_threads());
#else
    /* the rounded inputs widened back to fp32 (exact), through gemv.c's widening kernel */
    float *xr = input_buffer((int64_t)sizeof(float) * T * K);
    if (xr == NULL) return -1;
    for (int64_t i = 0; i < T * K; i++) {
        union { uint32_t u; float f; } v = {.u = (uint32_t)round_bf16(x[i]) << 16};
        xr[i] = v.f;
    }
    specdec_linear_bf16(xr, W, bias, y, T, K, N);
#endif
    return 0;
}

/* The same product from Wp, W packed as AMX tiles (bf16amx.c): the inputs rounded here, multiplied there.
 * 0, or -1 where AMX is off or a buffer cannot be allocated. */
int specdec_linear_bf16_tiles(const float *x, const uint16_t *Wp, const float *bias, float *y, int64_t T, int64_t K,
                              int64_t N) {
#if defined(__AVX512BF16__)
    const uint16_t *xb = rounded(x, T * K);
    return xb == NULL ? -1 : specdec_amx_linear(xb, Wp, bias, y, T, K, N);
#else
    (void)x, (void)Wp, (void)bias, (void)y, (void)T, (void)K, (void)N;
    return -1;
#endif
}
