/* Small-batch matrix multiply for decoding on CPUs: y[T, N] = x[T, K] @ W[N, K]^T (+ bias).
 *
 * Decoding reads every weight once per forward pass, so speed is memory bandwidth. This kernel
 * streams W once for all T (<= 64, specdec.kernels.MAX_ROWS) rows of x, splitting the N output rows across OpenMP threads,
 * and computes each y[t, n] with the same summation order whatever T is (batch invariance: a
 * verify pass over k+1 tokens gives bitwise the same logits as k+1 single-token passes).
 * From WIDE_T rows on the work is compute-bound, and a blocked kernel (wide_block) with the same
 * summation order takes over. Built with -O3 -march=native; specdec falls back to torch when absent.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifdef __AVX2__
static inline float hsum256(__m256 s) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}
#endif

/* Every y[t, n] is: ACC 8-lane FMA accumulators striding over k in steps of 8*ACC, summed in a
 * fixed order, a horizontal sum, then the scalar tail: the same order for every tile shape below,
 * so results do not depend on T or on the tiling (two accumulators also halve the rounding error
 * of one long chain). A verify pass over T tokens streams each weight row once and applies it to
 * tiles of up to MAX_TILE_T input rows held in L1, T split into near-equal tiles (5 = one tile of 5,
 * not 4 + 1: a 1-row tile has only ACC FMA chains and stalls on their latency). A tile of 7 rows
 * holds 14 accumulators and the weight vector in AVX2's 16 registers (the inputs are memory
 * operands). Measured on the 135M model's matrices (AMD EPYC, 2 cores): T = 5 costs 1.12x T = 1
 * (1.28x with tiles of at most 4), T = 7 1.37x (1.49x), T = 8 1.65x (4 + 4, unchanged). */
#ifndef ACC
#define ACC 2
#endif
#ifndef MAX_TILE_T
#define MAX_TILE_T 7 /* input rows per tile */
#endif
#ifndef ROWS_T1
#define ROWS_T1 6 /* weight rows per tile when T == 1: independent FMA chains, parallel streams (6: 2-4% faster than 4, measured) */
#endif

/* pin: keep the loaded inputs and weight vector in registers (an empty asm stops the compiler folding
 * them into a memory operand of every FMA, which re-loads an input once per weight row); for tiles
 * where nr * nt * ACC + nt + 1 <= 16 registers. */
static inline __attribute__((always_inline)) void tile(const float *W, const float *x, float *y, const int nr,
                                                       const int nt, int64_t K, int64_t N, const int pin) {
    int64_t k = 0;
    float out[ROWS_T1][MAX_TILE_T];
#ifdef __AVX2__
    __m256 acc[ROWS_T1][MAX_TILE_T][ACC];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            for (int a = 0; a < ACC; a++) acc[r][t][a] = _mm256_setzero_ps();
    for (; k + 8 * ACC <= K; k += 8 * ACC)
        for (int a = 0; a < ACC; a++) {
            __m256 xv[MAX_TILE_T];
            for (int t = 0; t < nt; t++) {
                xv[t] = _mm256_loadu_ps(x + t * K + k + 8 * a);
                if (pin) __asm__("" : "+x"(xv[t]));
            }
            for (int r = 0; r < nr; r++) {
                __m256 wv = _mm256_loadu_ps(W + r * K + k + 8 * a);
                if (pin) __asm__("" : "+x"(wv));
                for (int t = 0; t < nt; t++) acc[r][t][a] = _mm256_fmadd_ps(wv, xv[t], acc[r][t][a]);
            }
        }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            __m256 s = acc[r][t][0];
            for (int a = 1; a < ACC; a++) s = _mm256_add_ps(s, acc[r][t][a]);
            out[r][t] = hsum256(s);
        }
#else
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = 0.f;
#endif
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float v = out[r][t];
            for (int64_t j = k; j < K; j++) v += W[r * K + j] * x[t * K + j];
            y[t * N + r] = v;
        }
}

static void add_bias(float *y, const float *bias, int64_t T, int64_t N, int64_t n0, int64_t nr) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < nr; r++) y[t * N + n0 + r] += bias[n0 + r];
}

/* One weight row against every input row, in near-equal tiles of at most MAX_TILE_T rows; literal
 * tile sizes let the compiler keep the accumulators in registers. */
static inline void row_tiles(const float *w, const float *x, float *y, int64_t T, int64_t K, int64_t N) {
    const int64_t ntiles = (T + MAX_TILE_T - 1) / MAX_TILE_T;
    for (int64_t i = 0, t0 = 0, nt; i < ntiles; i++, t0 += nt) {
        const float *xt = x + t0 * K;
        float *yt = y + t0 * N;
        nt = (T - t0) / (ntiles - i);
        switch (nt) {
            case 7: tile(w, xt, yt, 1, 7, K, N, 0); break;
            case 6: tile(w, xt, yt, 1, 6, K, N, 0); break;
            case 5: tile(w, xt, yt, 1, 5, K, N, 0); break;
            case 4: tile(w, xt, yt, 1, 4, K, N, 0); break;
            case 3: tile(w, xt, yt, 1, 3, K, N, 0); break;
            case 2: tile(w, xt, yt, 1, 2, K, N, 0); break;
            default: tile(w, xt, yt, 1, 1, K, N, 0);
        }
    }
}

#ifndef WIDE_T
#define WIDE_T 13 /* from this many input rows on wide_block beats row_tiles (its speed over row_tiles, measured: 12 rows 0.93x, 13 1.04x, 32 1.43x) */
#endif
#define WIDE_ROWS 2   /* weight rows per wide tile */
#define WIDE_TILE_T 3 /* input rows per wide tile: 2 x 3 x ACC accumulators + 3 inputs + 1 weight = 16 registers */
#define BLOCK_ROWS 48 /* weight rows (<= 288 KB) that stay in L2 while every input tile passes over them */

/* The wide tiles: tile()'s sums (bit for bit a single-row pass's) with pinned registers, 5 loads per
 * 6 FMAs in the 2 x 3 tile instead of 8. One function per shape, each compiled on its own: inlined
 * together, the compiler spilled an accumulator of the 2 x 3 tile to the stack (-20% measured). */
#define WIDE_SHAPE(r, t) \
    static __attribute__((noinline)) void wide_##r##x##t(const float *W, const float *x, float *y, int64_t K, int64_t N) \
    { tile(W, x, y, r, t, K, N, 1); }
WIDE_SHAPE(1, 1) WIDE_SHAPE(1, 2) WIDE_SHAPE(1, 3) WIDE_SHAPE(2, 1) WIDE_SHAPE(2, 2) WIDE_SHAPE(2, 3)
typedef void (*wide_fn)(const float *, const float *, float *, int64_t, int64_t);
static const wide_fn wide_shapes[WIDE_ROWS][WIDE_TILE_T] = {{wide_1x1, wide_1x2, wide_1x3}, {wide_2x1, wide_2x2, wide_2x3}};

/* Weight rows [0, nr) of one block against every input row: near-equal input tiles of at most
 * WIDE_TILE_T rows (held in L1) pass over the block (held in L2 after the first), WIDE_ROWS rows at a time. */
static void wide_block(const float *W, const float *x, float *y, int64_t T, int64_t K, int64_t N, int64_t nr) {
    const int64_t ntiles = (T + WIDE_TILE_T - 1) / WIDE_TILE_T;
    for (int64_t i = 0, t0 = 0, nt; i < ntiles; i++, t0 += nt) {
        nt = (T - t0) / (ntiles - i);
        for (int64_t r = 0; r < nr; r += WIDE_ROWS) {
            const int64_t rows = nr - r < WIDE_ROWS ? nr - r : WIDE_ROWS;
            wide_shapes[rows - 1][nt - 1](W + r * K, x + t0 * K, y + t0 * N + r, K, N);
        }
    }
}

/* x: [T, K], W: [N, K] row-major, bias: [N] or NULL, y: [T, N]. */
void specdec_linear_f32(const float *x, const float *W, const float *bias, float *y,
                        int64_t T, int64_t K, int64_t N) {
    if (T == 1) { /* ROWS_T1 weight streams per step: bandwidth-bound, so many loads in flight */
        #pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS_T1) {
            int64_t nr = N - n0 < ROWS_T1 ? N - n0 : ROWS_T1;
            if (nr == ROWS_T1) tile(W + n0 * K, x, y + n0, ROWS_T1, 1, K, N, 0);
            else for (int64_t r = 0; r < nr; r++) tile(W + (n0 + r) * K, x, y + n0 + r, 1, 1, K, N, 0);
            if (bias) add_bias(y, bias, 1, N, n0, nr);
        }
        return;
    }
    if (T >= WIDE_T) { /* compute-bound: weights from L2, inputs from L1, loads shared by more FMAs */
        #pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += BLOCK_ROWS) {
            int64_t nr = N - n0 < BLOCK_ROWS ? N - n0 : BLOCK_ROWS;
            wide_block(W + n0 * K, x, y + n0, T, K, N, nr);
            if (bias) add_bias(y, bias, T, N, n0, nr);
        }
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row_tiles(W + n * K, x, y + n, T, K, N);
        if (bias) add_bias(y, bias, T, N, n, 1);
    }
}

int specdec_kernel_abi(void) { return 3; }

/* RMSNorm over the last dim: y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. x, y: [T, H]. */
void specdec_rmsnorm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *yt = y + t * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xt[i] * xt[i];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) yt[i] = xt[i] * inv * w[i];
    }
}

/* SwiGLU: gu [T, 2I] holds gate then up; y [T, I] = silu(gate) * up. */
void specdec_silu_mul_f32(const float *gu, float *y, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *yt = y + t * I;
        for (int64_t i = 0; i < I; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
