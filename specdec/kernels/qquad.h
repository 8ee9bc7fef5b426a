/* int4 weights with group size 32 on AVX512-VNNI (Zen 4, Intel Xeon since Ice Lake): four blocks of 32
 * weights per 512-bit step. Included by qgemv.c only, after qblock.h; QUAD_I4 is 1 where it applies.
 *
 * The AVX2 tile (qtile32) reduces each pair of blocks' dot products across lanes with horizontal adds
 * before it can scale them. Here the scales are spread over the lanes instead: one 64-byte load holds
 * the packed weights of blocks c..c+3 (16 bytes each: low nibbles k < 16, high nibbles k >= 16), so
 * its low and high nibbles meet the activations in "quad order" (per 4 blocks, 128 bytes: the first
 * halves x_c[0:16] .. x_c+3[0:16], then the second halves), and two vpdpbusd leave block c+i's integer
 * dot spread over lanes 4i..4i+3. Each lane is converted and scaled by its block's d_b * s_b (expanded
 * 4x), and the zero term z_b * S_b is added in lane 4i only. Per (n, t):
 *     tot += float(dot lanes) * (d_b s_b),  zt += z_b S_b,  y = reduce(tot) + reduce(zt)
 * the same sequence for every tile shape, so results are batch invariant. The 121 int4 matrices of the
 * 135M model's int4-g32 copy (2-vCPU Zen 4, from DRAM, raw kernel calls, the two builds alternated twice):
 * T = 1 / 2 / 4 / 8 rows 3.80-3.95 / 4.82-5.15 / 7.66-8.44 / 14.0-16.3 ms with qtile32, 3.37-3.49 /
 * 3.79-3.98 / 5.86-5.91 / 10.3-12.4 ms here. */
#ifndef SPECDEC_QQUAD_H
#define SPECDEC_QQUAD_H

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QUAD_I4 1
#define QUAD_T 4 /* activation rows per tile when T > 1 (2 weight rows x 4: 8 + 8 accumulators) */

/* blocks of a row rounded up to whole quads */
static inline int64_t quad_count(int64_t K) { return (K / QBLOCK + 3) / 4; }

/* The calling thread's buffer for a call's quad-order activations (kept and grown, not a malloc per
 * call: 1.1-1.2x on the int4 matrices at 4-8 rows); NULL if it cannot grow. */
static float *quad_buffer(int64_t floats) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    return grow_buffer(&buf, &size, (int64_t)sizeof(float) * floats);
}

/* Row t of x -> xq [quads * 128] int8 in quad order, d16 [quads * 16] (d_b in lanes 4i..4i+3), S16
 * [quads * 16] (the block's exact sum in lane 4i, zero elsewhere); a last partial quad zero-padded. */
static void quantize_row_quad(const float *x, int64_t K, int8_t *xq, float *d16, float *S16) {
    const int64_t nb = K / QBLOCK, nq = quad_count(K);
    memset(xq, 0, (size_t)(nq * 128));
    memset(d16, 0, sizeof(float) * nq * 16);
    memset(S16, 0, sizeof(float) * nq * 16);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.f, sum = 0.f;
        int finite = 1; /* as quantize_row: a NaN or inf makes the block's scale NaN and its bytes 0 */
        for (int i = 0; i < QBLOCK; i++) {
            amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            finite &= isfinite(xb[i]) != 0;
        }
        for (int i = 0; i < QBLOCK; i++) sum += xb[i];
        const float db = finite ? amax / 127.f : NAN, inv = finite && db > 0.f ? 1.f / db : 0.f;
        const int64_t quad = b / 4, j = b % 4;
        for (int i = 0; i < QBLOCK; i++)
            xq[quad * 128 + (i < 16 ? 0 : 64) + j * 16 + i % 16] = finite ? (int8_t)nearbyintf(xb[i] * inv) : 0;
        for (int l = 0; l < 4; l++) d16[quad * 16 + j * 4 + l] = db;
        S16[quad * 16 + j * 4] = sum;
    }
}

/* n (<= 4) fp16 values -> 16 floats, lanes 4i..4i+3 = h[i] (zero past n) */
static inline __m512 expand_halves4(const uint16_t *h, int n) {
    const __m128 f = _mm_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1), h));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(f));
}

/* NR (<= 4) weight rows x NT (<= QUAD_T) activation rows, literal at every call; the loops over them are
 * unrolled by pragma, or GCC kept the accumulators in memory (a 2 x 4 tile 1.4x slower). q: [NR, K / 2] packed
 * int4 rows; sc, zp: [NR, K / 32] fp16; xq, d16, S16: [NT, quads * ...] quad-order activations. */
static inline __attribute__((always_inline)) void qtile_quad(const int NR, const int NT, const uint8_t *q,
                                                             const uint16_t *sc, const uint16_t *zp,
                                                             const int8_t *xq, const float *d16,
                                                             const float *S16, float *y, int64_t K, int64_t N) {
    const int64_t nb = K / QBLOCK, nq = quad_count(K), qrow = K / 2;
    __m512 tot[4][QUAD_T], zt[4][QUAD_T];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) tot[r][t] = zt[r][t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t c = 0; c < nq; c++) {
        const int n = nb - 4 * c < 4 ? (int)(nb - 4 * c) : 4;
        const __mmask64 in_row = n == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * n)) - 1);
        __m512i xlo[QUAD_T], xhi[QUAD_T];
        __m512 dv[QUAD_T], Sv[QUAD_T];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            xlo[t] = _mm512_loadu_si512(xq + (t * nq + c) * 128);
            xhi[t] = _mm512_loadu_si512(xq + (t * nq + c) * 128 + 64);
            dv[t] = _mm512_loadu_ps(d16 + (t * nq + c) * 16);
            Sv[t] = _mm512_loadu_ps(S16 + (t * nq + c) * 16);
        }
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const uint8_t *qr = q + r * qrow + c * 64;
#if QPF
            _mm_prefetch((const char *)qr + QPF, _MM_HINT_T0);
#endif
            const __m512i v = _mm512_maskz_loadu_epi8(in_row, qr); /* a row's last quad may hold < 4 blocks */
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512 sv = expand_halves4(sc + r * nb + 4 * c, n), zv = expand_halves4(zp + r * nb + 4 * c, n);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const __m512i dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[t]),
                                                         hi, xhi[t]);
                tot[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dv[t], sv), tot[r][t]);
                zt[r][t] = _mm512_fmadd_ps(zv, Sv[t], zt[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) y[t * N + r] = _mm512_reduce_add_ps(tot[r][t]) + _mm512_reduce_add_ps(zt[r][t]);
}
#else
#define QUAD_I4 0
#endif
#endif
