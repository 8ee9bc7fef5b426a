/* The quantized formats' element-level helpers for qgemv.c (see its header comment for the formats):
 * the block size and weight kinds, fp16 scales, the activations' quantization and byte order, and the
 * AVX2 primitives on one or a few blocks of 32 weights. Included by qgemv.c only. */
#ifndef SPECDEC_QBLOCK_H
#define SPECDEC_QBLOCK_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "common.h"

#define QBLOCK 32
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
        int finite = 1; /* a NaN or inf: the block's scale NaN, its bytes 0 (a NaN's cast is undefined; fabsf
                         * and > dropped it, and symmetric int8, which has no group sums, gave a finite y) */
        for (int i = 0; i < QBLOCK; i++) {
            amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            finite &= isfinite(xb[i]) != 0;
        }
        const float db = finite ? amax / 127.f : NAN, inv = finite && db > 0.f ? 1.f / db : 0.f;
        d[b] = db;
        for (int i = 0; i < QBLOCK; i++) {
            const int8_t v = finite ? (int8_t)nearbyintf(xb[i] * inv) : 0;
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

#endif
#endif
