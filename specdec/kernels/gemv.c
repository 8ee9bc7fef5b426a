/* Small-batch matrix multiply for decoding on CPUs: y[T, N] = x[T, K] @ W[N, K]^T (+ bias).
 *
 * Decoding reads every weight once per forward pass, so speed is memory bandwidth. This kernel
 * streams W once for all T (<= 64, specdec.kernels.MAX_ROWS) rows of x, splitting the N output rows across threads (pool.c),
 * and computes each y[t, n] with the same summation order whatever T is (batch invariance: a
 * verify pass over k+1 tokens gives bitwise the same logits as k+1 single-token passes).
 * From WIDE_T rows on the work is compute-bound, and a blocked kernel (wide_block) with the same
 * summation order takes over. Built with -O3 -march=native; specdec falls back to torch when absent.
 *
 * The same kernel serves bf16 weights (specdec_linear_bf16: W stored as bfloat16, half the bytes to
 * stream): each weight is widened exactly to fp32 in registers (a 16-bit shift) and the sums are the
 * fp32 ones, so the result is x @ W.float()^T with the same order and batch invariance as fp32 weights.
 * Where the CPU has bf16 dot products, bf16 models round their inputs and run bf16dot.c instead.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "common.h"


/* The vector unit: 16-lane AVX-512 where the CPU has it (32 registers), else 8-lane AVX2 (16). The
 * width is fixed per build (-march=native), so every call on a machine sums in the same order. */
#if defined(__AVX512F__) && !defined(GEMV_NO_AVX512)
#define VW 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vloadu _mm512_loadu_ps
#define vfmadd _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define PIN_REG "+v"
static inline float vhsum(__m512 s) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(s), hi));
}
static inline vec widen_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vloadu _mm256_loadu_ps
#define vfmadd _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define PIN_REG "+x"
#define vhsum hsum256
static inline vec widen_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* Every y[t, n] is: ACC VW-lane FMA accumulators striding over k in steps of VW*ACC, summed in a
 * fixed order, a horizontal sum, then the scalar tail: the same order for every tile shape below,
 * so results do not depend on T or on the tiling (two accumulators also halve the rounding error
 * of one long chain). A verify pass over T tokens streams each weight row once and applies it to
 * tiles of up to MAX_TILE_T input rows held in L1, T split into near-equal tiles (5 = one tile of 5,
 * not 4 + 1: a 1-row tile has only ACC FMA chains and stalls on their latency). A tile of 7 rows
 * holds 14 accumulators and the weight vector in AVX2's 16 registers (the inputs are memory
 * operands). Measured on the 135M model's matrices (AMD EPYC, 2 cores): T = 5 costs 1.12x T = 1
 * (1.28x with tiles of at most 4), T = 7 1.37x (1.49x), T = 8 1.65x (4 + 4, unchanged). With AVX-512
 * (Intel Xeon, 2 cores, same matrices, in one process) 16 lanes and 32 registers cut T = 2..32 by
 * 10-20% against the AVX2 build (T = 4 30.7 vs 36.3 ms, 32 rows 79.5 vs 96.6), T = 1 unchanged. */
#ifndef ACC
#define ACC 2
#endif
#ifndef MAX_TILE_T
#if VW == 16
#define MAX_TILE_T 8 /* input rows per tile: 16 accumulators + the weight in AVX-512's 32 registers (T = 8: one tile, 0.88x of 4 + 4, measured on a Xeon) */
#else
#define MAX_TILE_T 7 /* input rows per tile */
#endif
#endif
#ifndef PF_AHEAD
/* fp32 row_tiles passes prefetch the weights this many bytes ahead of the line they read, one line per
 * line read (rows are contiguous, so it runs on into the next rows). From DRAM a pass over 2-7 input rows
 * was ~1.4x a single-token one though the arithmetic is not the limit (in cache 1.16x): the tile's
 * extra instructions let fewer weight lines be in flight, and prefetching each next row as a burst at
 * its start (PF_ROWS) did not help. AMD EPYC (AVX2, 2 threads, 40 matrices 3072 x 576 from DRAM, one
 * process): T = 1 / 2 / 4 / 8 rows 11.6 / 17.4 / 17.5 / 19.9 ms -> 11.5 / 11.9 / 12.9 / 16.4 (1024 bytes;
 * 512: 14.0 / 13.9 / 14.9 / 19.9; 2048 about as 1024). bf16 weights gained nothing: they keep PF_ROWS. */
#define PF_AHEAD 1024
#endif
#define WIDE_ROWS 2 /* weight rows per tile, at most (only the wide tiles take more than one) */

/* Weights are fp32 (WBF16 = 0) or bfloat16 (WBF16 = 1, widened to fp32 exactly as they are loaded);
 * WBF16 is a literal at every call, so each kind compiles to its own loop. */
static inline float wget(const void *W, const int WBF16, int64_t i) {
    if (!WBF16) return ((const float *)W)[i];
    union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)W)[i] << 16};
    return v.f;
}

#ifdef VW
static inline __attribute__((always_inline)) vec wload(const void *W, const int WBF16, int64_t i) {
    return WBF16 ? widen_bf16((const uint16_t *)W + i) : vloadu((const float *)W + i);
}
#endif

/* pin: keep the loaded inputs and weight vector in registers (an empty asm stops the compiler folding
 * them into a memory operand of every FMA, which re-loads an input once per weight row); for tiles
 * where nr * nt * ACC + nt + 1 <= 16 registers. */
static inline __attribute__((always_inline)) void tile(const void *W, const int WBF16, const float *x, float *y,
                                                       const int nr, const int nt, int64_t K, int64_t N, const int pin) {
    int64_t k = 0;
    float out[WIDE_ROWS][MAX_TILE_T];
#ifdef VW
    vec acc[WIDE_ROWS][MAX_TILE_T][ACC];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            for (int a = 0; a < ACC; a++) acc[r][t][a] = vzero();
    for (; k + VW * ACC <= K; k += VW * ACC) {
        if (!pin && !WBF16) /* fp32 row_tiles: the weights PF_AHEAD bytes on, line by line (see PF_AHEAD) */
            for (int line = 0; line < VW * ACC * 4; line += 64) _mm_prefetch((const char *)W + k * 4 + PF_AHEAD + line, _MM_HINT_T0);
        for (int a = 0; a < ACC; a++) {
            vec xv[MAX_TILE_T];
            for (int t = 0; t < nt; t++) {
                xv[t] = vloadu(x + t * K + k + VW * a);
                if (pin) __asm__("" : PIN_REG(xv[t]));
            }
            for (int r = 0; r < nr; r++) {
                vec wv = wload(W, WBF16, r * K + k + VW * a);
                if (pin) __asm__("" : PIN_REG(wv));
                for (int t = 0; t < nt; t++) acc[r][t][a] = vfmadd(wv, xv[t], acc[r][t][a]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            vec s = acc[r][t][0];
            for (int a = 1; a < ACC; a++) s = vadd(s, acc[r][t][a]);
            out[r][t] = vhsum(s);
        }
#else
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = 0.f;
#endif
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float v = out[r][t];
            /* fmaf, not `v += w * x`: whether the compiler contracts that into an FMA differed between
             * the fp32 and bf16 copies of this loop on an AMD EPYC (Zen 4) build, so their tails disagreed */
            for (int64_t j = k; j < K; j++) v = fmaf(wget(W, WBF16, r * K + j), x[t * K + j], v);
            y[t * N + r] = v;
        }
}

static void add_bias(float *y, const float *bias, int64_t T, int64_t N, int64_t n0, int64_t nr) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < nr; r++) y[t * N + n0 + r] += bias[n0 + r];
}

/* The weight matrix from row or element i on, whatever its kind. */
static inline const void *wat(const void *W, const int WBF16, int64_t i) {
    return WBF16 ? (const void *)((const uint16_t *)W + i) : (const void *)((const float *)W + i);
}

/* One weight row against every input row, in near-equal tiles of at most MAX_TILE_T rows; literal
 * tile sizes let the compiler keep the accumulators in registers. */
static inline __attribute__((always_inline)) void row_tiles(const void *w, const int WBF16, const float *x, float *y,
                                                            int64_t T, int64_t K, int64_t N) {
    const int64_t ntiles = (T + MAX_TILE_T - 1) / MAX_TILE_T;
    for (int64_t i = 0, t0 = 0, nt; i < ntiles; i++, t0 += nt) {
        const float *xt = x + t0 * K;
        float *yt = y + t0 * N;
        nt = (T - t0) / (ntiles - i);
        switch (nt) {
#if MAX_TILE_T >= 12
            case 12: tile(w, WBF16, xt, yt, 1, 12, K, N, 0); break;
            case 11: tile(w, WBF16, xt, yt, 1, 11, K, N, 0); break;
#endif
#if MAX_TILE_T >= 10
            case 10: tile(w, WBF16, xt, yt, 1, 10, K, N, 0); break;
            case 9: tile(w, WBF16, xt, yt, 1, 9, K, N, 0); break;
#endif
#if MAX_TILE_T >= 8
            case 8: tile(w, WBF16, xt, yt, 1, 8, K, N, 0); break;
#endif
            case 7: tile(w, WBF16, xt, yt, 1, 7, K, N, 0); break;
            case 6: tile(w, WBF16, xt, yt, 1, 6, K, N, 0); break;
            case 5: tile(w, WBF16, xt, yt, 1, 5, K, N, 0); break;
            case 4: tile(w, WBF16, xt, yt, 1, 4, K, N, 0); break;
            case 3: tile(w, WBF16, xt, yt, 1, 3, K, N, 0); break;
            case 2: tile(w, WBF16, xt, yt, 1, 2, K, N, 0); break;
            default: tile(w, WBF16, xt, yt, 1, 1, K, N, 0);
        }
    }
}

/* From WIDE_T input rows on (bf16 weights: WIDE_T_BF16) wide_block beats row_tiles; where depends on the
 * core. An AMD Zen core with AVX-512 (Zen 4: GCC 12 calls it znver3) double-pumps 512-bit operations.
 * There, before wide_block prefetched its next block (WIDE_PF), the 30 layers' linears (2 threads, one
 * process, the two builds interleaved, 11 repeats) took fp32 7 rows 31.0 (row_tiles) vs 32.2 ms (wide),
 * 8 36.4 vs 34.7, 10 40.9 vs 34.2; bf16 14 rows 28.6 vs 29.1, 16 38.9 vs 32.0, 20 48.8 vs 36.3. With
 * WIDE_PF (session 21, a 2-vCPU Zen 4 EPYC, 40 matrices 3072 x 576 from DRAM, builds interleaved,
 * medians of 15-25) the wide path wins from 3 rows in fp32 (3 / 4 / 5 / 6 / 7 rows: row_tiles 12.7 /
 * 11.5 / 14.6 / 13.5 / 14.4 ms, wide 11.1 / 9.9 / 9.6 / 9.9 / 9.9; 2 rows even) and from 2 in bf16
 * (2 / 3 / 4 / 6 / 8 rows: 5.9 / 5.2 / 6.9 / 7.7 / 10.1 ms vs 4.8 / 4.5 / 4.9 / 6.4 / 8.5): row_tiles'
 * 5-7-row tiles ran at ~2/3 of its 4-row speed there. Elsewhere: the earlier measurements below. Both
 * paths sum in the same order, so the choice never changes a result. */
#if VW == 16 && (defined(__znver3__) || defined(__znver4__) || defined(__znver5__))
#define ZEN_AVX512 1
#endif
#ifndef WIDE_T
#ifdef ZEN_AVX512
#define WIDE_T 3
#elif VW == 8
/* AMD EPYC (Zen 3), AVX2, since wide_block prefetches the next block (WIDE_PF): 8 rows 19.0 (row_tiles)
 * vs 19.9 ms (wide), 10 23.4 vs 19.5, 12 23.8 vs 19.8, 14 26.7 vs 20.8 (40 matrices 3072 x 576 from
 * DRAM, 2 threads, builds interleaved, medians of 25; single row 15-16 ms) */
#define WIDE_T 9
#else
#define WIDE_T 13 /* Intel Xeon, measured before WIDE_PF (as Zen 4's 8 was, which WIDE_PF moved to 3): re-measure */
#endif
#endif
#ifndef WIDE_T_BF16
#ifdef ZEN_AVX512
#define WIDE_T_BF16 2
#elif VW == 8
#define WIDE_T_BF16 10 /* the same AVX2 EPYC, 80 bf16 matrices 3072 x 576: 8 rows 32.1 vs 32.9 ms, 12 47.6 vs 42.5, 16 69.9 vs 57.1, 20 91.8 vs 68.5 */
#else
#define WIDE_T_BF16 22 /* row_tiles (prefetching, each weight widened once) stays ahead up to 20 rows (Xeon: 16 rows 28.5 vs 35.9 ms, 20: 36.0 vs 39.7, 24: 53.5 vs 45.3; before WIDE_PF) */
#endif
#endif
#define WIDE_TILE_T 3 /* input rows per wide tile: 2 x 3 x ACC accumulators + 3 inputs + 1 weight = 16 registers */
#define BLOCK_ROWS 48 /* weight rows (<= 288 KB) that stay in L2 while every input tile passes over them */
/* While the input tiles pass over one block, wide_block prefetches the next into L2, a few lines before
 * each tile: without it a block's first pass waited on DRAM and the others on the FMAs, one after the
 * other. AMD EPYC (AVX2, 2 threads, 40 matrices 3072 x 576 from DRAM, builds interleaved, medians of 11):
 * 16 / 20 / 24 / 32 rows 36.0 / 39.1 / 45.6 / 50.1 -> 23.0 / 25.4 / 29.3 / 36.1 ms (_MM_HINT_T0 about
 * the same as T1). */
#ifndef WIDE_PF
#define WIDE_PF 1
#endif
#ifndef WIDE_PF_HINT
#define WIDE_PF_HINT _MM_HINT_T1
#endif

/* The wide tiles: tile()'s sums (bit for bit a single-row pass's) with pinned registers, 5 loads per
 * 6 FMAs in the 2 x 3 tile instead of 8. One function per shape and weight kind, each compiled on its
 * own: inlined together, the compiler spilled an accumulator of the 2 x 3 tile to the stack (-20% measured). */
#define WIDE_SHAPE(r, t) \
    static __attribute__((noinline)) void wide_##r##x##t##_f32(const void *W, const float *x, float *y, int64_t K, int64_t N) \
    { tile(W, 0, x, y, r, t, K, N, 1); } \
    static __attribute__((noinline)) void wide_##r##x##t##_bf16(const void *W, const float *x, float *y, int64_t K, int64_t N) \
    { tile(W, 1, x, y, r, t, K, N, 1); }
WIDE_SHAPE(1, 1) WIDE_SHAPE(1, 2) WIDE_SHAPE(1, 3) WIDE_SHAPE(2, 1) WIDE_SHAPE(2, 2) WIDE_SHAPE(2, 3)
typedef void (*wide_fn)(const void *, const float *, float *, int64_t, int64_t);
static const wide_fn wide_shapes[2][WIDE_ROWS][WIDE_TILE_T] = {
    {{wide_1x1_f32, wide_1x2_f32, wide_1x3_f32}, {wide_2x1_f32, wide_2x2_f32, wide_2x3_f32}},
    {{wide_1x1_bf16, wide_1x2_bf16, wide_1x3_bf16}, {wide_2x1_bf16, wide_2x2_bf16, wide_2x3_bf16}}};

/* Weight rows [0, nr) of one block against every input row: near-equal input tiles of at most
 * WIDE_TILE_T rows (held in L1) pass over the block (in L2), WIDE_ROWS rows at a time; next_lines 64-byte
 * lines from `next` on (the next block) are prefetched meanwhile, spread evenly over the tiles. */
static void wide_block(const void *W, const int WBF16, const float *x, float *y, int64_t T, int64_t K, int64_t N,
                       int64_t nr, const char *next, int64_t next_lines) {
    const int64_t ntiles = (T + WIDE_TILE_T - 1) / WIDE_TILE_T, calls = ntiles * ((nr + WIDE_ROWS - 1) / WIDE_ROWS);
    int64_t call = 0, fetched = 0;
    for (int64_t i = 0, t0 = 0, nt; i < ntiles; i++, t0 += nt) {
        nt = (T - t0) / (ntiles - i);
        for (int64_t r = 0; r < nr; r += WIDE_ROWS) {
#if WIDE_PF
            for (const int64_t upto = next_lines * ++call / calls; fetched < upto; fetched++)
                _mm_prefetch(next + fetched * 64, WIDE_PF_HINT);
#endif
            const int64_t rows = nr - r < WIDE_ROWS ? nr - r : WIDE_ROWS;
            wide_shapes[WBF16][rows - 1][nt - 1](wat(W, WBF16, r * K), x + t0 * K, y + t0 * N + r, K, N);
        }
    }
}

#ifndef PF_ROWS
#define PF_ROWS 2 /* bf16 row_tiles passes (1-21 rows; fp32: PF_AHEAD) prefetch the weight row this far ahead: the 30 layers' linears at
                     2 / 4 / 8 rows, bf16 13.4 -> 9.2, 16.1 -> 10.5, 19.9 -> 14.4 ms; fp32 19.6 -> 17.1, 23.4 -> 19.2,
                     33.3 -> 27.8 ms (2-core Xeon, one process; 1 row ahead: a little less) */
#endif

/* Output rows in units of unit_rows(T, WBF16): blocks of BLOCK_ROWS from WIDE_T (bf16: WIDE_T_BF16)
 * rows on (compute-bound: weights from L2, inputs from L1, loads shared by more FMAs); else one weight
 * row at a time against all inputs, the row PF_ROWS ahead prefetched. Single-token passes too: on a
 * Zen 4 EPYC, streaming row by row beat tiles of 6 rows read side by side (the previous T == 1 path)
 * on the 30 layers' linears + LM head, one process, 15 interleaved repeats: fp32 21.3 -> 19.3 ms, bf16
 * 13.3 -> 9.6 ms (AVX-512 build); AVX2 build 22.9 -> 20.1, 14.6 -> 9.1 ms. The weights are one
 * sequential stream then, which the hardware prefetcher follows best. */
static inline int wide(int64_t T, const int WBF16) { return T >= (WBF16 ? WIDE_T_BF16 : WIDE_T); }
static inline int64_t unit_rows(int64_t T, const int WBF16) { return wide(T, WBF16) ? BLOCK_ROWS : 1; }

/* Output rows [n_lo, n_hi) (n_lo a multiple of unit_rows(T, WBF16)) of y = x W^T + bias. */
static inline __attribute__((always_inline)) void rows_range(const void *W, const int WBF16, const float *x,
                                                             const float *bias, float *y, int64_t T, int64_t K,
                                                             int64_t N, int64_t n_lo, int64_t n_hi) {
    const int64_t unit = unit_rows(T, WBF16);
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += unit) {
        const int64_t nr = n_hi - n0 < unit ? n_hi - n0 : unit;
        if (wide(T, WBF16)) {
            const int64_t next_rows = n_hi - n0 - nr < unit ? n_hi - n0 - nr : unit; /* the next block, read meanwhile */
            wide_block(wat(W, WBF16, n0 * K), WBF16, x, y + n0, T, K, N, nr, (const char *)wat(W, WBF16, (n0 + nr) * K),
                       next_rows * K * (WBF16 ? 2 : 4) / 64);
        }
        else {
#ifdef VW
            if (WBF16 && n0 + PF_ROWS < n_hi) { /* a later weight row into L1 while this one meets every input */
                const char *next = (const char *)wat(W, WBF16, (n0 + PF_ROWS) * K);
                for (int64_t off = 0; off < K * (WBF16 ? 2 : 4); off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
            }
#endif
            row_tiles(wat(W, WBF16, n0 * K), WBF16, x, y + n0, T, K, N);
        }
        if (bias) add_bias(y, bias, T, N, n0, nr);
    }
}

static __attribute__((noinline)) void rows_f32(const void *W, const float *x, const float *bias, float *y, int64_t T,
                                               int64_t K, int64_t N, int64_t n_lo, int64_t n_hi) {
    rows_range(W, 0, x, bias, y, T, K, N, n_lo, n_hi);
}

static __attribute__((noinline)) void rows_bf16(const void *W, const float *x, const float *bias, float *y, int64_t T,
                                                int64_t K, int64_t N, int64_t n_lo, int64_t n_hi) {
    rows_range(W, 1, x, bias, y, T, K, N, n_lo, n_hi);
}

typedef struct {
    const void *W;
    const float *x, *bias;
    float *y;
    int64_t T, K, N;
    int wbf16;
} LinearJob;

/* Thread `me` of nth takes a contiguous, near-equal share of the units (a static schedule). */
static void linear_share(void *ctx, int64_t me, int64_t nth) {
    const LinearJob *j = ctx;
    const int64_t unit = unit_rows(j->T, j->wbf16), units = (j->N + unit - 1) / unit;
    const int64_t lo = units * me / nth * unit, hi_unit = units * (me + 1) / nth * unit;
    const int64_t hi = hi_unit < j->N ? hi_unit : j->N;
    if (lo < hi) (j->wbf16 ? rows_bf16 : rows_f32)(j->W, j->x, j->bias, j->y, j->T, j->K, j->N, lo, hi);
}

static void linear_any(const void *W, const int wbf16, const float *x, const float *bias, float *y, int64_t T,
                       int64_t K, int64_t N) {
    LinearJob job = {W, x, bias, y, T, K, N, wbf16};
    specdec_parallel(linear_share, &job, specdec_num_threads());
}

/* x: [T, K], W: [N, K] row-major fp32, bias: [N] or NULL, y: [T, N]. */
void specdec_linear_f32(const float *x, const float *W, const float *bias, float *y, int64_t T, int64_t K, int64_t N) {
    linear_any(W, 0, x, bias, y, T, K, N);
}

/* The same with W bfloat16 [N, K] (the raw 16 bits): y = x @ float(W)^T + bias, fp32 sums. */
void specdec_linear_bf16(const float *x, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K,
                         int64_t N) {
    linear_any(W, 1, x, bias, y, T, K, N);
}

int specdec_kernel_abi(void) { return 4; }

/* fp32 lanes of the vector unit this build uses (16: AVX-512, 8: AVX2, 1: scalar) */
int specdec_gemv_lanes(void) {
#ifdef VW
    return VW;
#else
    return 1;
#endif
}
