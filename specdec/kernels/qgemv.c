/* Quantized small-batch matmul for decoding on CPUs: y[T, N] = x[T, K] @ dequant(W)[N, K]^T (+ bias).
 *
 * Decoding is memory-bound, so reading 1 (int8) or 0.5 (int4) bytes per weight instead of 4 is the
 * speed-up, provided the arithmetic keeps up. Widening every weight to fp32 does not (it ran at
 * ~3-6 G weights/s per core, far below the memory stream); so, as llama.cpp does, the activations
 * are quantized too, per row and per block of 32 (int8, scale d = max|x| / 127, round to nearest
 * even), and each block is an integer dot product (AVX2 maddubs: 32 byte products per instruction).
 *
 * Weight format (specdec/quant/schemes.py writes it): row n of W is cut into groups of G consecutive k
 * (G a multiple of 32; the last group of a row may be shorter). Group g of row n has a scale
 * s = scales[n, g] and a zero z = zeros[n, g] (both fp16) and w[n, k] = q[n, k] * s + z:
 *   int8: q int8 (zeros == NULL: symmetric) or uint8 (with zeros) [N, K]; in each block of 32 k,
 *         byte 4i + c holds k = 8c + i (the activations' block is permuted the same way);
 *   int4: q uint4, two per byte [N, K/2]; in each block of 32 k, byte j holds k = j in its low
 *         nibble and k = j + 16 in its high nibble (the llama.cpp Q4 block layout); z required.
 * With xq, d the quantized activations and S the exact fp32 sum of x over a group:
 *     y[t, n] = sum_g ( s_g * sum_{b in g} d_b * <q_b, xq_b>  +  z_g * S_g )
 * (uint8 weights are stored as q - 128 in the dot product, and z_g becomes z_g + 128 s_g.)
 *
 * On AVX512-VNNI CPUs int4 with group size 32 (the quantized self-draft) runs four blocks per 512-bit
 * step instead (qquad.h), with the activations in that file's quad order.
 *
 * Batch invariance: activations are quantized row by row, and every y[t, n] is the same sequence of
 * integer dots and fp32 operations whatever T is and however rows are tiled. So a verify pass over
 * k+1 tokens gives bitwise the same logits as k+1 single-token passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "common.h"
#include "qblock.h"

#ifndef QPF
#define QPF 2048 /* bytes ahead to prefetch each weight row: the hardware prefetcher alone left
                      * int8 decode at ~5 GB/s of DRAM per core, with it ~10-13 (AMD EPYC) */
#endif
#ifndef PARALLEL_MIN
#define PARALLEL_MIN (1 << 18) /* weights x rows below which one thread does the whole matmul */
#endif
#include "qquad.h"
#define USES_QUAD(KIND, G) (QUAD_I4 && (KIND) == I4 && (G) == QBLOCK) /* int4-g32 on AVX512-VNNI: qquad.h */

#ifdef __AVX2__
/* nr (<= 4) weight rows x nt (<= 2) activation rows; NR, NT literal at every call site so the
 * accumulators stay in registers. Per (n, t): for each group, acc = sum over its blocks of
 * cvt(dot) * d_b (8 lanes), tot = tot + acc * s_g, zt = zt + z_g * S_g; y = hsum(tot) + zt. */
static inline __attribute__((always_inline)) void qtile(const int KIND, const int NR, const int NT,
                                                        const uint8_t *q, const uint16_t *sc, const uint16_t *zp,
                                                        const int8_t *xq, const float *xd, const float *xs,
                                                        float *y, int64_t K, int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, nb = K / QBLOCK, qrow = KIND == I4 ? K / 2 : K;
    __m256 tot[4][2];
    float zt[4][2];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) tot[r][t] = _mm256_setzero_ps(), zt[r][t] = 0.f;
    for (int64_t g = 0; g < ng; g++) {
        const int64_t b0 = g * (G / QBLOCK), b1 = b0 + G / QBLOCK < nb ? b0 + G / QBLOCK : nb;
        __m256 acc[4][2];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            __m256i xv[2];
            __m256 dv[2];
            for (int t = 0; t < NT; t++) {
                xv[t] = _mm256_loadu_si256((const __m256i *)(xq + t * K + b * QBLOCK));
                dv[t] = _mm256_broadcast_ss(xd + t * nb + b);
            }
            for (int r = 0; r < NR; r++) {
#if QPF
                if (KIND == I4 ? (b & 3) == 0 : (b & 1) == 0)
                    _mm_prefetch((const char *)(q + r * qrow + (KIND == I4 ? b * 16 : b * 32) + QPF), _MM_HINT_T0);
#endif
                const __m256i w = load_block(KIND, q + r * qrow, b);
                for (int t = 0; t < NT; t++)
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block(KIND, w, xv[t])), dv[t], acc[r][t]);
            }
        }
        for (int r = 0; r < NR; r++) {
            const float s = half_to_float(sc[r * ng + g]);
            const __m256 sv = _mm256_set1_ps(s);
            for (int t = 0; t < NT; t++) tot[r][t] = _mm256_fmadd_ps(acc[r][t], sv, tot[r][t]);
            if (KIND != I8_SYM) {
                const float z = half_to_float(zp[r * ng + g]) + (KIND == I8_ASYM ? 128.f * s : 0.f);
                for (int t = 0; t < NT; t++) zt[r][t] = fmaf(z, xs[t * ng + g], zt[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) y[t * N + r] = hsum256(tot[r][t]) + zt[r][t];
}

/* The group-size-32 case (every block its own weight scale: the int4 default and the quantized
 * self-draft), eight blocks at a time: the 8 blocks' integer dots are reduced to one vector, so
 * the scales apply lane-wise (d_b s_b per lane) instead of once per block with scalar fp16
 * conversions, ~2x fewer instructions per block than qtile. Per (n, t):
 *     tot += float(dot_b) * (d_b * s_b),  zt += z_b * S_b   (lane b % 8; the tail chunk zero-padded)
 *     y = hsum(tot) + hsum(zt). */
static inline __attribute__((always_inline)) void qtile32(const int KIND, const int NR, const int NT,
                                                          const uint8_t *q, const uint16_t *sc, const uint16_t *zp,
                                                          const int8_t *xq, const float *xd, const float *xs,
                                                          float *y, int64_t K, int64_t N) {
    const int64_t nb = K / QBLOCK, qrow = KIND == I4 ? K / 2 : K;
    __m256 tot[4][2], zt[4][2];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) tot[r][t] = zt[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 8) {
        const int n = nb - b < 8 ? (int)(nb - b) : 8;
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 dv[2], Sv[2];
        for (int t = 0; t < NT; t++) {
            dv[t] = _mm256_maskload_ps(xd + t * nb + b, lanes);
            Sv[t] = _mm256_maskload_ps(xs + t * nb + b, lanes);
        }
        for (int r = 0; r < NR; r++) {
            const uint8_t *qr = q + r * qrow;
#if QPF
            _mm_prefetch((const char *)(qr + (KIND == I4 ? b * 16 : b * 32) + QPF), _MM_HINT_T0);
            _mm_prefetch((const char *)(qr + (KIND == I4 ? b * 16 : b * 32) + QPF + 64), _MM_HINT_T0);
            if (KIND != I4) {
                _mm_prefetch((const char *)(qr + b * 32 + QPF + 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(qr + b * 32 + QPF + 192), _MM_HINT_T0);
            }
#endif
            const __m256 sv = load_halves(sc + r * nb + b, n);
            __m256 zv = _mm256_setzero_ps();
            if (KIND != I8_SYM) {
                zv = load_halves(zp + r * nb + b, n);
                if (KIND == I8_ASYM) zv = _mm256_fmadd_ps(_mm256_set1_ps(128.f), sv, zv);
            }
            __m256i sums[2]; /* [t]: the 8 blocks' integer dots, one lane each */
            if (KIND == I4) {
                __m256i p[2][4]; /* [t][pair]: lanes 0-3 block b + 2m, lanes 4-7 block b + 2m + 1 */
                for (int m = 0; m < 4; m++)
                    for (int t = 0; t < NT; t++) p[t][m] = pair_dot(qr, xq + t * K, b + 2 * m, nb);
                for (int t = 0; t < NT; t++) sums[t] = reduce_pairs(p[t]);
            } else {
                __m256i p[2][8]; /* [t][block]: each weight block unpacked once for every activation row */
                for (int i = 0; i < 8; i++) {
                    if (i >= n) {
                        for (int t = 0; t < NT; t++) p[t][i] = _mm256_setzero_si256();
                        continue;
                    }
                    const __m256i w = load_block(KIND, qr, b + i);
                    for (int t = 0; t < NT; t++)
                        p[t][i] = dot_block(KIND, w, _mm256_loadu_si256((const __m256i *)(xq + t * K + (b + i) * QBLOCK)));
                }
                for (int t = 0; t < NT; t++) sums[t] = reduce8(p[t]);
            }
            for (int t = 0; t < NT; t++) {
                const __m256 dots = _mm256_cvtepi32_ps(sums[t]);
                tot[r][t] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dv[t], sv), tot[r][t]);
                if (KIND != I8_SYM) zt[r][t] = _mm256_fmadd_ps(zv, Sv[t], zt[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) y[t * N + r] = hsum256(tot[r][t]) + hsum256(zt[r][t]);
}
#else
/* Portable fallback: the same quantities with scalar sums (not bitwise the AVX2 order). */
static void qtile(const int KIND, const int NR, const int NT, const uint8_t *q, const uint16_t *sc,
                  const uint16_t *zp, const int8_t *xq, const float *xd, const float *xs, float *y, int64_t K,
                  int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, nb = K / QBLOCK, qrow = KIND == I4 ? K / 2 : K;
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) {
            const uint8_t *qr = q + r * qrow;
            float tot = 0.f, zt = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                float acc = 0.f;
                for (int64_t b = g * (G / QBLOCK); b < nb && b < (g + 1) * (G / QBLOCK); b++) {
                    int32_t dot = 0;
                    for (int i = 0; i < QBLOCK; i++) {
                        int w = KIND == I4 ? (i < 16 ? qr[b * 16 + i] & 15 : qr[b * 16 + i - 16] >> 4)
                                : KIND == I8_SYM ? (int8_t)qr[b * QBLOCK + i] : (int)qr[b * QBLOCK + i] - 128;
                        dot += w * xq[t * K + b * QBLOCK + i];
                    }
                    acc += (float)dot * xd[t * nb + b];
                }
                const float s = half_to_float(sc[r * ng + g]);
                tot += acc * s;
                if (KIND != I8_SYM) zt += (half_to_float(zp[r * ng + g]) + (KIND == I8_ASYM ? 128.f * s : 0.f)) * xs[t * ng + g];
            }
            y[t * N + r] = tot + zt;
        }
}
#endif

/* The activations of one call, quantized row by row (see quantize_row). */
typedef struct {
    int8_t *xq; /* [T, K] */
    float *xd;  /* [T, K / 32] block scales */
    float *xs;  /* [T, ng] group sums */
} QActs;

static int quantize_acts(const int KIND, const float *x, int64_t T, int64_t K, int64_t G, QActs *a) {
    const int64_t ng = (K + G - 1) / G, nb = K / QBLOCK;
#if QUAD_I4
    if (USES_QUAD(KIND, G)) { /* quad order: [T, quads * 128] bytes, d16 and S16 [T, quads * 16] floats */
        const int64_t nq = quad_count(K);
        float *buf = quad_buffer(T * nq * 64); /* 128 bytes of xq, 16 + 16 floats of d16, S16 per quad */
        if (buf == NULL) return -1;
        a->xq = (int8_t *)buf, a->xd = buf + T * nq * 32, a->xs = a->xd + T * nq * 16; /* the thread's: kept */
        for (int64_t t = 0; t < T; t++)
            quantize_row_quad(x + t * K, K, a->xq + t * nq * 128, a->xd + t * nq * 16, a->xs + t * nq * 16);
        return 0;
    }
#endif
    a->xq = malloc((size_t)(T * K));
    a->xd = malloc(sizeof(float) * T * (nb + ng));
    if (!a->xq || !a->xd) {
        free(a->xq), free(a->xd);
        return -1;
    }
    a->xs = a->xd + T * nb;
    for (int64_t t = 0; t < T; t++) quantize_row(KIND, x + t * K, K, G, a->xq + t * K, a->xd + t * nb, a->xs + t * ng);
    return 0;
}

/* Output rows [n0, n0 + ROWS(T)) for every input row: literal tile shapes (4 x 1 for decode, 2 x 2
 * for verify), edges one (row, token) at a time with the same per-(n, t) order. */
#ifndef ROWS_I8
#define ROWS_I8 1
#endif
#ifndef ROWS_I4
#define ROWS_I4 4
#endif
#ifdef __AVX2__ /* group size 32: the vectorised-scales tile */
#define QTILE(KIND, NR, NT, q, sc, zp, xq, xd, xs, y, K, N, G)                                   \
    do {                                                                                       \
        if ((G) == QBLOCK) qtile32(KIND, NR, NT, q, sc, zp, xq, xd, xs, y, K, N);              \
        else qtile(KIND, NR, NT, q, sc, zp, xq, xd, xs, y, K, N, G);                           \
    } while (0)
#else
#define QTILE qtile
#endif
#define ROWS(KIND, T) ((T) > 1 ? 2 : (KIND) == I4 ? ROWS_I4 : ROWS_I8)
#if QUAD_I4
/* One function per qtile_quad shape (NR weight rows x NT activation rows), each compiled on its own. */
#define QUAD_SHAPE(r, t) \
    static __attribute__((noinline)) void quad_##r##x##t(const uint8_t *q, const uint16_t *sc, const uint16_t *zp, \
                                                         const int8_t *xq, const float *d, const float *S, float *y, \
                                                         int64_t K, int64_t N) { qtile_quad(r, t, q, sc, zp, xq, d, S, y, K, N); }
QUAD_SHAPE(1, 1) QUAD_SHAPE(1, 2) QUAD_SHAPE(1, 3) QUAD_SHAPE(1, 4) QUAD_SHAPE(2, 1) QUAD_SHAPE(2, 2) QUAD_SHAPE(2, 3)
QUAD_SHAPE(2, 4) QUAD_SHAPE(3, 1) QUAD_SHAPE(4, 1)
typedef void (*quad_fn)(const uint8_t *, const uint16_t *, const uint16_t *, const int8_t *, const float *,
                        const float *, float *, int64_t, int64_t);
static const quad_fn quad_shapes[4][QUAD_T] = {{quad_1x1, quad_1x2, quad_1x3, quad_1x4},
                                               {quad_2x1, quad_2x2, quad_2x3, quad_2x4},
                                               {quad_3x1, NULL, NULL, NULL}, {quad_4x1, NULL, NULL, NULL}};

/* nr weight rows (ROWS(I4, T): 4 for T = 1, else 2) against every activation row, QUAD_T at a time */
static void quad_rows(int nr, const QActs *a, const uint8_t *q, const uint16_t *sc, const uint16_t *zp, float *y,
                      int64_t T, int64_t K, int64_t N) {
    const int64_t nq = quad_count(K);
    for (int64_t t0 = 0; t0 < T; t0 += QUAD_T) {
        const int nt = T - t0 < QUAD_T ? (int)(T - t0) : QUAD_T;
        quad_shapes[nr - 1][nt - 1](q, sc, zp, a->xq + t0 * nq * 128, a->xd + t0 * nq * 16, a->xs + t0 * nq * 16,
                                    y + t0 * N, K, N);
    }
}
#endif
static inline __attribute__((always_inline)) void row_tile(const int KIND, int64_t n0, const QActs *a,
                                                           const uint8_t *q, const uint16_t *sc, const uint16_t *zp,
                                                           const float *bias, float *y, int64_t T, int64_t K,
                                                           int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, nb = K / QBLOCK, qrow = KIND == I4 ? K / 2 : K;
    const int nr = N - n0 < ROWS(KIND, T) ? (int)(N - n0) : ROWS(KIND, T);
    const uint8_t *qn = q + n0 * qrow;
    const uint16_t *sn = sc + n0 * ng, *zn = zp ? zp + n0 * ng : NULL;
#if QUAD_I4
    if (USES_QUAD(KIND, G)) {
        quad_rows(nr, a, qn, sn, zn, y + n0, T, K, N);
        if (bias)
            for (int64_t t = 0; t < T; t++)
                for (int r = 0; r < nr; r++) y[t * N + n0 + r] += bias[n0 + r];
        return;
    }
#endif
    for (int64_t t0 = 0; t0 < T; t0 += 2) {
        const int nt = T - t0 < 2 ? (int)(T - t0) : 2;
        const int8_t *xq = a->xq + t0 * K;
        const float *xd = a->xd + t0 * nb, *xs = a->xs + t0 * ng;
        float *yt = y + t0 * N + n0;
        if (T == 1 && nr == ROWS(KIND, 1)) QTILE(KIND, ROWS(KIND, 1), 1, qn, sn, zn, xq, xd, xs, yt, K, N, G);
        else if (nr == 2 && nt == 2) QTILE(KIND, 2, 2, qn, sn, zn, xq, xd, xs, yt, K, N, G);
        else
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++)
                    QTILE(KIND, 1, 1, qn + r * qrow, sn + r * ng, zn ? zn + r * ng : NULL, xq + t * K,
                          xd + t * nb, xs + t * ng, yt + t * N + r, K, N, G);
    }
    if (bias)
        for (int64_t t = 0; t < T; t++)
            for (int r = 0; r < nr; r++) y[t * N + n0 + r] += bias[n0 + r];
}

typedef struct {
    const QActs *a;
    const uint8_t *q;
    const uint16_t *sc, *zp;
    const float *bias;
    float *y;
    int64_t T, K, N, G;
} QJob;

/* One function per weight kind, each with its own share of the tiles (a static schedule): a shared
 * body would test the kind at run time in the innermost loop (3x slower, measured under OpenMP). */
#define DEFINE_QLINEAR(name, KIND)                                                                         \
    static void name##_share(void *ctx, int64_t me, int64_t nth) {                                         \
        const QJob *j = ctx;                                                                               \
        const int64_t step = ROWS(KIND, j->T), tiles = (j->N + step - 1) / step;                           \
        for (int64_t i = tiles * me / nth; i < tiles * (me + 1) / nth; i++)                                \
            row_tile(KIND, i * step, j->a, j->q, j->sc, j->zp, j->bias, j->y, j->T, j->K, j->N, j->G);     \
    }                                                                                                      \
    static int name(const float *x, const uint8_t *q, const uint16_t *sc, const uint16_t *zp,              \
                    const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {            \
        QActs a;                                                                                           \
        if (quantize_acts(KIND, x, T, K, G, &a) != 0) return -1;                                           \
        QJob job = {&a, q, sc, zp, bias, y, T, K, N, G};                                                   \
        specdec_parallel(name##_share, &job, N * K * (T < 4 ? T : 4) >= PARALLEL_MIN ? specdec_num_threads() : 1); \
        if (!USES_QUAD(KIND, G)) free(a.xq), free(a.xd); /* quad activations: the thread's buffer */       \
        return 0;                                                                                          \
    }
DEFINE_QLINEAR(qlinear_i8_sym, I8_SYM)
DEFINE_QLINEAR(qlinear_i8_asym, I8_ASYM)
DEFINE_QLINEAR(qlinear_i4, I4)

/* x: [T, K] fp32; q, scales, zeros as above; bias: [N] or NULL; y: [T, N]. K % 32 == 0, G % 32 == 0.
 * 0, or -1 when the quantized activations cannot be allocated (y is then not written). */
int specdec_qlinear_i8(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                       const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {
    return zeros ? qlinear_i8_asym(x, q, scales, zeros, bias, y, T, K, N, G)
                 : qlinear_i8_sym(x, q, scales, NULL, bias, y, T, K, N, G);
}

int specdec_qlinear_i4(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                       const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {
    return qlinear_i4(x, q, scales, zeros, bias, y, T, K, N, G);
}

/* The whole fp32 matrix out [N, K] (for long prompts, where a BLAS matmul wins). q * s is exact in
 * fp32 (<= 19 significant bits), so this equals the readable torch reference bit for bit. */
typedef struct {
    int bits;
    const uint8_t *q;
    const uint16_t *scales, *zeros;
    float *out;
    int64_t K, N, G;
} DequantJob;

static void dequant_share(void *ctx, int64_t me, int64_t nth) {
    const DequantJob *j = ctx;
    const int64_t K = j->K, G = j->G, ng = (K + G - 1) / G, qrow = j->bits == 4 ? K / 2 : K;
    for (int64_t n = j->N * me / nth; n < j->N * (me + 1) / nth; n++) {
        const uint8_t *qr = j->q + n * qrow;
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = k / G;
            const float s = half_to_float(j->scales[n * ng + g]), z = j->zeros ? half_to_float(j->zeros[n * ng + g]) : 0.f;
            float v;
            if (j->bits == 4) {
                const uint8_t b = qr[(k / 32) * 16 + (k % 16)];
                v = (float)((k % 32) < 16 ? b & 15 : b >> 4);
            } else {
                const uint8_t b = qr[(k / 32) * 32 + 4 * (k % 8) + (k % 32) / 8];
                v = j->zeros ? (float)b : (float)(int8_t)b;
            }
            j->out[n * K + k] = j->zeros ? __builtin_fmaf(v, s, z) : v * s;
        }
    }
}

void specdec_dequant(int bits, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros, float *out,
                     int64_t K, int64_t N, int64_t G) {
    DequantJob job = {bits, q, scales, zeros, out, K, N, G};
    specdec_parallel(dequant_share, &job, N * K >= PARALLEL_MIN ? specdec_num_threads() : 1);
}

int specdec_qkernel_abi(void) { return 2; }

/* 1 where int4-g32 runs on AVX512-VNNI quads (qquad.h), 0 where on AVX2 pairs (qtile32) */
int specdec_qlinear_quad(void) { return QUAD_I4; }
