/* Weight-only quantized small-batch matmul for decoding on CPUs:
 *     y[T, N] = x[T, K] @ dequant(W)[N, K]^T (+ bias),  fp32 activations and accumulation.
 *
 * Decoding is memory-bound, so reading 1 (int8) or 0.5 (int4) bytes per weight instead of 4 is
 * the speed-up; the integers are widened to fp32 in registers, once per tile of <= 2 input rows.
 *
 * Format (specdec/quant/schemes.py writes it): row n of W is cut into groups of G consecutive k
 * (the last group of a row may be shorter; every group is a multiple of 32 long). Group g of row n
 * has a scale s = scales[n, g] and a zero z = zeros[n, g] (both fp16) and
 *     w[n, k] = q[n, k] * s + z
 *   int8: q int8 (zeros == NULL: symmetric) or uint8 (with zeros) [N, K]; in each block of 32 k,
 *         byte 4i + c holds k = 8c + i, so one 32-byte load splits into four 8-lane vectors by
 *         shifts alone (no cross-lane shuffles);
 *   int4: q uint4, two per byte [N, K/2]; in each block of 32 k, byte j holds k = j in its low
 *         nibble and k = j + 16 in its high nibble (the llama.cpp Q4 block layout); z required.
 * Per group the kernel sums q * x, then applies s (and z times the group's sum of x) once:
 *     y[t, n] = sum_g ( s_g * sum_{k in g} q[n, k] x[t, k]  +  z_g * sum_{k in g} x[t, k] )
 *
 * Batch invariance (as gemv.c): every y[t, n] is the same sequence of 8-lane FMAs and adds in the
 * same order whatever T is and however rows are tiled, then a horizontal sum, then the bias. So a
 * verify pass over k+1 tokens gives bitwise the same logits as k+1 single-token passes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifndef TILE_R
#define TILE_R 4 /* weight rows per tile */
#endif
#ifndef TILE_T
#define TILE_T 2 /* input rows per tile when T > 1 */
#endif
#ifndef PARALLEL_MIN
#define PARALLEL_MIN (1 << 18) /* weights x rows below which one thread does the whole matmul */
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#ifdef __AVX2__
static inline float hsum256(__m256 s) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* KIND: 0 = int8 signed (no zero), 1 = int8 unsigned + zero, 2 = int4 + zero.
 * q points at row n0 of the packed weights, sc/zp at row n0 of the scales/zeros, xs at the 8-lane
 * group sums of x for the tile's first input row ([T][ng][8], see group_sums).
 * Per (n, t): for each group g in order, acc = FMA chain of q * x over the group's chunks (int4:
 * columns k, k+16, k+8, k+24 of each block; int8: k, k+8, ...), then tot = tot + acc * s, then
 * (with zeros) tot = tot + xs[g] * z; finally y = hsum(tot). */
static inline __attribute__((always_inline)) void qtile(const int KIND, const uint8_t *q, const uint16_t *sc,
                                                        const uint16_t *zp, const float *x, const float *xs,
                                                        float *y, int nr, int nt, int64_t K, int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, qrow = KIND == 2 ? K / 2 : K;
    const __m256i low4 = _mm256_set1_epi32(0x0f), low8 = _mm256_set1_epi32(0xff);
    __m256 tot[TILE_R][TILE_T];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) tot[r][t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const int64_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
        __m256 acc[TILE_R][TILE_T];
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) acc[r][t] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k += 32)
            for (int r = 0; r < nr; r++) {
                const uint8_t *qr = q + r * qrow;
                if (KIND == 2) {
                    for (int h = 0; h < 2; h++) { /* bytes 8h..8h+7: columns k+8h.. (low), k+16+8h.. (high) */
                        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qr + k / 2 + 8 * h)));
                        __m256 wl = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
                        __m256 wh = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                        for (int t = 0; t < nt; t++) {
                            acc[r][t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x + t * K + k + 8 * h), acc[r][t]);
                            acc[r][t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + t * K + k + 16 + 8 * h), acc[r][t]);
                        }
                    }
                } else { /* 32 bytes: byte c of 32-bit lane i is column k + 8c + i */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qr + k));
                    __m256i b[4];
                    if (KIND == 0) { /* sign-extend byte c: shift it to the top, arithmetic shift down */
                        b[0] = _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);
                        b[1] = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24);
                        b[2] = _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24);
                        b[3] = _mm256_srai_epi32(v, 24);
                    } else {
                        b[0] = _mm256_and_si256(v, low8);
                        b[1] = _mm256_and_si256(_mm256_srli_epi32(v, 8), low8);
                        b[2] = _mm256_and_si256(_mm256_srli_epi32(v, 16), low8);
                        b[3] = _mm256_srli_epi32(v, 24);
                    }
                    for (int c = 0; c < 4; c++) {
                        const __m256 w = _mm256_cvtepi32_ps(b[c]);
                        for (int t = 0; t < nt; t++)
                            acc[r][t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * K + k + 8 * c), acc[r][t]);
                    }
                }
            }
        for (int r = 0; r < nr; r++) {
            const __m256 s = _mm256_set1_ps(half_to_float(sc[r * ng + g]));
            for (int t = 0; t < nt; t++) tot[r][t] = _mm256_fmadd_ps(acc[r][t], s, tot[r][t]);
            if (KIND) {
                const __m256 z = _mm256_set1_ps(half_to_float(zp[r * ng + g]));
                for (int t = 0; t < nt; t++)
                    tot[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + (t * ng + g) * 8), z, tot[r][t]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) y[t * N + r] = hsum256(tot[r][t]);
}

/* xs[t][g][lane] = sum over the chunks of group g (in the order qtile visits them) of x[t, chunk + lane]. */
static void group_sums(const int KIND, const float *x, float *xs, int64_t T, int64_t K, int64_t G) {
    const int64_t ng = (K + G - 1) / G;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < ng; g++) {
            const int64_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
            __m256 a = _mm256_setzero_ps();
            for (int64_t k = k0; k < k1; k += 32) {
                static const int order4[4] = {0, 16, 8, 24}, order8[4] = {0, 8, 16, 24};
                for (int c = 0; c < 4; c++)
                    a = _mm256_add_ps(a, _mm256_loadu_ps(x + t * K + k + (KIND == 2 ? order4[c] : order8[c])));
            }
            _mm256_storeu_ps(xs + (t * ng + g) * 8, a);
        }
}
#else
/* Portable fallback: per (n, t) a plain sum over k of w * x (order independent of T and tiling). */
static void qtile(const int KIND, const uint8_t *q, const uint16_t *sc, const uint16_t *zp, const float *x,
                  const float *xs, float *y, int nr, int nt, int64_t K, int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, qrow = KIND == 2 ? K / 2 : K;
    (void)xs;
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            const uint8_t *qr = q + r * qrow;
            float sum = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const int64_t g = k / G;
                const float s = half_to_float(sc[r * ng + g]), z = KIND ? half_to_float(zp[r * ng + g]) : 0.f;
                float v;
                if (KIND == 2) {
                    const uint8_t b = qr[(k / 32) * 16 + (k % 16)];
                    v = (float)((k % 32) < 16 ? b & 15 : b >> 4);
                } else {
                    const uint8_t b = qr[(k / 32) * 32 + 4 * (k % 8) + (k % 32) / 8];
                    v = KIND == 0 ? (float)(int8_t)b : (float)b;
                }
                sum += (v * s + z) * x[t * K + k];
            }
            y[t * N + r] = sum;
        }
}

static void group_sums(const int KIND, const float *x, float *xs, int64_t T, int64_t K, int64_t G) {
    (void)KIND, (void)x, (void)xs, (void)T, (void)K, (void)G;
}
#endif

static void qlinear(const int KIND, const float *x, const uint8_t *q, const uint16_t *sc, const uint16_t *zp,
                    const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, qrow = KIND == 2 ? K / 2 : K;
    float *xsum = KIND ? (float *)malloc(sizeof(float) * 8 * T * ng) : NULL;
    if (KIND && !xsum) return;
    if (KIND) group_sums(KIND, x, xsum, T, K, G);
    /* a thread team costs more than it saves on small matrices (and far more on a busy machine) */
    #pragma omp parallel for schedule(static) if (N * K * (T < 4 ? T : 4) >= PARALLEL_MIN)
    for (int64_t n0 = 0; n0 < N; n0 += TILE_R) {
        const int nr = N - n0 < TILE_R ? (int)(N - n0) : TILE_R;
        const uint8_t *qn = q + n0 * qrow;
        const uint16_t *sn = sc + n0 * ng, *zn = zp ? zp + n0 * ng : NULL;
        for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            const int nt = T - t0 < TILE_T ? (int)(T - t0) : TILE_T;
            const float *xt = x + t0 * K, *xs = xsum ? xsum + t0 * ng * 8 : NULL;
            float *ys = y + t0 * N + n0;
            /* literal tile sizes let the compiler keep the accumulators in registers; a column
             * split does not change any (n, t) sum */
            if (nt == TILE_T) {
                if (nr == TILE_R) qtile(KIND, qn, sn, zn, xt, xs, ys, TILE_R, TILE_T, K, N, G);
                else
                    for (int r = 0; r < nr; r++)
                        qtile(KIND, qn + r * qrow, sn + r * ng, zn ? zn + r * ng : NULL, xt, xs, ys + r, 1, TILE_T, K, N, G);
            } else
                for (int t = 0; t < nt; t++) {
                    if (nr == TILE_R) qtile(KIND, qn, sn, zn, xt + t * K, xs ? xs + t * ng * 8 : NULL, ys + t * N, TILE_R, 1, K, N, G);
                    else
                        for (int r = 0; r < nr; r++)
                            qtile(KIND, qn + r * qrow, sn + r * ng, zn ? zn + r * ng : NULL, xt + t * K,
                                  xs ? xs + t * ng * 8 : NULL, ys + t * N + r, 1, 1, K, N, G);
                }
        }
        if (bias)
            for (int64_t t = 0; t < T; t++)
                for (int r = 0; r < nr; r++) y[t * N + n0 + r] += bias[n0 + r];
    }
    free(xsum);
}

/* x: [T, K] fp32; q, scales, zeros as above; bias: [N] or NULL; y: [T, N]. K % 32 == 0, G % 32 == 0. */
void specdec_qlinear_i8(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                        const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {
    if (zeros) qlinear(1, x, q, scales, zeros, bias, y, T, K, N, G);
    else qlinear(0, x, q, scales, NULL, bias, y, T, K, N, G);
}

void specdec_qlinear_i4(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                        const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G) {
    qlinear(2, x, q, scales, zeros, bias, y, T, K, N, G);
}

/* The whole fp32 matrix out [N, K] (for long prompts, where a BLAS matmul wins). q * s is exact in
 * fp32 (<= 19 significant bits), so this equals the readable torch reference bit for bit. */
void specdec_dequant(int bits, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros, float *out,
                     int64_t K, int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, qrow = bits == 4 ? K / 2 : K;
    #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qr = q + n * qrow;
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = k / G;
            const float s = half_to_float(scales[n * ng + g]), z = zeros ? half_to_float(zeros[n * ng + g]) : 0.f;
            float v;
            if (bits == 4) {
                const uint8_t b = qr[(k / 32) * 16 + (k % 16)];
                v = (float)((k % 32) < 16 ? b & 15 : b >> 4);
            } else {
                const uint8_t b = qr[(k / 32) * 32 + 4 * (k % 8) + (k % 32) / 8];
                v = zeros ? (float)b : (float)(int8_t)b;
            }
            out[n * K + k] = zeros ? __builtin_fmaf(v, s, z) : v * s;
        }
    }
}

int specdec_qkernel_abi(void) { return 1; }
