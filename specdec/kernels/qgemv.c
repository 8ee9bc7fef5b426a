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
 * Batch invariance: activations are quantized row by row, and every y[t, n] is the same sequence of
 * integer dots and fp32 operations whatever T is and however rows are tiled. So a verify pass over
 * k+1 tokens gives bitwise the same logits as k+1 single-token passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"

#define QBLOCK 32
#ifndef QPF
#define QPF 2048 /* bytes ahead to prefetch each weight row: the hardware prefetcher alone left
                      * int8 decode at ~5 GB/s of DRAM per core, with it ~10-13 (AMD EPYC) */
#endif
#ifndef PARALLEL_MIN
#define PARALLEL_MIN (1 << 18) /* weights x rows below which one thread does the whole matmul */
#endif
enum { I8_SYM = 0, I8_ASYM = 1, I4 = 2 };

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
#define PAIRED_I4(KIND, G) ((KIND) == I4 && (G) == QBLOCK) /* qtile32's int4 order, see pair_pos */
#else
#define PAIRED_I4(KIND, G) 0
#endif

/* Where element i of block b goes in the int4-g32 activation order: blocks 2p and 2p+1 (a full pair)
 * fill 64 bytes as [x_2p[0:16], x_2p+1[0:16], x_2p[16:32], x_2p+1[16:32]], so ONE 32-byte load of the
 * two blocks' packed weights gives their low nibbles (k < 16) and high nibbles (k >= 16) in the
 * order of those activation halves; a last unpaired block keeps its own order. */
static inline int64_t pair_pos(int64_t b, int i, int64_t nb) {
    if ((b | 1) >= nb) return b * QBLOCK + i;
    return (b & ~(int64_t)1) * QBLOCK + (i < 16 ? 0 : 32) + (b & 1) * 16 + i % 16;
}

/* Row t of x -> xq (int8, [K], in the weights' byte order), d ([K/32] block scales) and S ([ng]
 * exact group sums). Scalar: a few microseconds per row, and the same on every build. */
static void quantize_row(const int KIND, const float *x, int64_t K, int64_t G, int8_t *xq, float *d, float *S) {
    const int paired = PAIRED_I4(KIND, G);
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.f;
        for (int i = 0; i < QBLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
        d[b] = db;
        for (int i = 0; i < QBLOCK; i++) {
            const int8_t v = (int8_t)nearbyintf(xb[i] * inv);
            if (paired) xq[pair_pos(b, i, K / QBLOCK)] = v;
            else xq[b * QBLOCK + (KIND == I4 ? i : 4 * (i % 8) + i / 8)] = v; /* int8: column 8c + i at byte 4i + c */
        }
    }
    for (int64_t g = 0; g * G < K; g++) {
        float s = 0.f;
        for (int64_t k = g * G; k < K && k < (g + 1) * G; k++) s += x[k];
        S[g] = s;
    }
}

#ifdef __AVX2__
/* 32 weights of block b of a row as signed bytes in the activations' order */
static inline __m256i load_block(const int KIND, const uint8_t *qr, int64_t b) {
    if (KIND == I4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(qr + b * 16)), m = _mm_set1_epi8(0x0f);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qr + b * QBLOCK));
    return KIND == I8_ASYM ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}

/* 8 int32 partial sums of <w, x> over 32 bytes. int4 weights are unsigned (0..15): maddubs takes
 * them as they are; signed weights go through |w| and sign(x, w) (|w| <= 128, pairs <= 32512). */
static inline __m256i dot_block(const int KIND, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p = KIND == I4 ? _mm256_maddubs_epi16(w, x)
                                 : _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, ones);
}

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

/* Sum of each of the 8 int32 vectors p[0..7] -> one vector [sum p0, ..., sum p7] (exact). */
static inline __m256i reduce8(const __m256i p[8]) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* n (<= 8) fp16 values -> 8 floats, zero past n */
static inline __m256 load_halves(const uint16_t *h, int n) {
    if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* a masked load: the copy through the stack below stalls on store-to-load forwarding, once per
     * weight row for the last blocks of every K = 576 row of the 135M model */
    return _mm256_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1), h));
#else
    if ((n & 1) == 0) { /* AVX2: a masked load of n / 2 pairs (K = 576 leaves n = 2), no stack copy */
        const __m128i pairs = _mm_cmpgt_epi32(_mm_set1_epi32(n / 2), _mm_setr_epi32(0, 1, 2, 3));
        return _mm256_cvtph_ps(_mm_maskload_epi32((const int *)h, pairs));
    }
#endif
    uint16_t tmp[8] = {0};
    memcpy(tmp, h, sizeof(uint16_t) * n);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
}

/* Int4 blocks c and c + 1 against activations in pair_pos order: lanes 0-3 sum to block c's dot,
 * lanes 4-7 to block c + 1's (zero past nb). Per pair: one load, two maddubs, one madd (the two
 * int16 pair sums add without overflow: |2 * 2 * 15 * 127| < 2^15). */
static inline __m256i pair_dot(const uint8_t *qr, const int8_t *xq, int64_t c, int64_t nb) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    if (c >= nb) return _mm256_setzero_si256();
    if (c + 1 >= nb) { /* a last unpaired block: its 8 partial sums folded into lanes 0-3 */
        const __m256i d = dot_block(I4, load_block(I4, qr, c), _mm256_loadu_si256((const __m256i *)(xq + c * QBLOCK)));
        return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1)));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qr + c * 16));
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    const __m256i xlo = _mm256_loadu_si256((const __m256i *)(xq + c * QBLOCK));
    const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xq + c * QBLOCK + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)ones;
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
#endif
}

/* Four pair_dot vectors -> [dot of block 0, ..., dot of block 7] (exact). */
static inline __m256i reduce_pairs(const __m256i p[4]) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    return _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* [0 2 4 6 | 1 3 5 7] */
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
static inline __attribute__((always_inline)) void row_tile(const int KIND, int64_t n0, const QActs *a,
                                                           const uint8_t *q, const uint16_t *sc, const uint16_t *zp,
                                                           const float *bias, float *y, int64_t T, int64_t K,
                                                           int64_t N, int64_t G) {
    const int64_t ng = (K + G - 1) / G, nb = K / QBLOCK, qrow = KIND == I4 ? K / 2 : K;
    const int nr = N - n0 < ROWS(KIND, T) ? (int)(N - n0) : ROWS(KIND, T);
    const uint8_t *qn = q + n0 * qrow;
    const uint16_t *sn = sc + n0 * ng, *zn = zp ? zp + n0 * ng : NULL;
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
        free(a.xq), free(a.xd);                                                                            \
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
