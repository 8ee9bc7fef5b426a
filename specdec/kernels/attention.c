/* Decode-shaped attention for one sequence in a static KV cache, fp32: rotary embedding, the KV
 * write and attention over the cached prefix plus T new tokens, in one call per layer.
 *
 * For T <= 32 new tokens the work is small and a chain of ~25 torch ops per layer (split, views,
 * rotary, cache slices, SDPA, transposes) costs more in dispatch than in arithmetic; here it is
 * one loop nest. Each query row is computed on its own in a fixed order over the keys it may see
 * (the whole prefix, then the new tokens its mask allows, ascending), so a verify pass over k+1
 * tokens gives bitwise the same rows as k+1 single-token passes (batch invariance, as gemv.c).
 *
 * qkv:   [T, (Hq + 2 Hkv) * D]  the fused projection (q heads, then k heads, then v heads)
 * cos, sin: [max_pos, D]        tables; sin has its first half negated (rotate_half layout)
 * pos:   [T]                     positions of the new tokens
 * kc, vc: [Hkv, max_len, D]      this layer's cache; new k/v are written at [past, past + T)
 * mask:  [T, T] uint8 or NULL    which new tokens each new token sees (NULL: causal)
 * out:   [T, Hq * D]             attention output, heads concatenated (o_proj's input layout)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static void rope(const float *x, const float *c, const float *s, float *y, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) y[i] = x[i] * c[i] + x[i + h] * s[i];
    for (int64_t i = h; i < D; i++) y[i] = x[i] * c[i] + x[i - h] * s[i];
}

#ifdef __AVX2__
/* exp(x) for x <= 0 in 8 lanes (Cephes-style: 2^n * poly(r), ~2 ulp), 0 where x = -inf. Applied
 * to aligned chunks of 8 scores, so a score's value never depends on how many keys a row has. */
static inline __m256 exp8(__m256 x) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 dead = _mm256_cmp_ps(x, neg_inf, _CMP_EQ_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_setzero_ps(), dead);
}

/* The dot product of q with one key: an FMA chain per 8 lanes over D, then the reduction tree
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Every score below is computed this way, so a
 * score's value never depends on which keys or queries were computed with it. */
static inline __m256 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
}
static inline void store4(__m256 h, float *out) {
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* Two queries against four keys: each key chunk is loaded once for both queries (8 chains). */
static inline void dots_2x4(const float *q0, const float *q1, const float *const k[4], int64_t D,
                            float *out0, float *out1) {
    __m256 a[2][4];
    for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m256 kv = _mm256_loadu_ps(k[i] + d);
            a[0][i] = _mm256_fmadd_ps(x0, kv, a[0][i]);
            a[1][i] = _mm256_fmadd_ps(x1, kv, a[1][i]);
        }
    }
    store4(hsum4(a[0][0], a[0][1], a[0][2], a[0][3]), out0);
    store4(hsum4(a[1][0], a[1][1], a[1][2], a[1][3]), out1);
}

static inline void dots_1x4(const float *q, const float *const k[4], int64_t D, float *out) {
    __m256 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + d), a[i]);
    }
    store4(hsum4(a[0], a[1], a[2], a[3]), out);
}

/* o_m[c, c + 8 NR) = sum over visible keys j, ascending, of s_m[j] v_j: one FMA per element and key,
 * in registers (NR x 8 lanes per query), for two queries (s1 NULL: one) sharing each v load. */
static inline __attribute__((always_inline)) void pv_chunk(const float *s0, const float *s1, const float *vc,
                                                            const int64_t *gather, int64_t stride, int64_t n_keys,
                                                            int64_t c, const int NR, float *o0, float *o1) {
    __m256 a[2][4];
    for (int r = 0; r < NR; r++) a[0][r] = a[1][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n_keys; j++) {
        const float w0 = s0[j], w1 = s1 ? s1[j] : 0.f;
        if (w0 == 0.f && w1 == 0.f) continue;
        const float *v = vc + (gather ? gather[j] : j) * stride + c;
        __m256 vv[4];
        for (int r = 0; r < NR; r++) vv[r] = _mm256_loadu_ps(v + 8 * r);
        if (w0 != 0.f)
            for (int r = 0; r < NR; r++) a[0][r] = _mm256_fmadd_ps(_mm256_set1_ps(w0), vv[r], a[0][r]);
        if (w1 != 0.f)
            for (int r = 0; r < NR; r++) a[1][r] = _mm256_fmadd_ps(_mm256_set1_ps(w1), vv[r], a[1][r]);
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(o0 + c + 8 * r, a[0][r]);
        if (s1) _mm256_storeu_ps(o1 + c + 8 * r, a[1][r]);
    }
}
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
#ifdef __AVX2__
    if (D % 8 == 0) { /* the same reduction tree as dots_1x4 */
        __m256 acc = _mm256_setzero_ps(), z = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        float out[4];
        store4(hsum4(acc, z, z, z), out);
        return out[0];
    }
#endif
    float r = 0.f;
    for (int64_t i = 0; i < D; i++) r += a[i] * b[i];
    return r;
}

static inline void axpy(float a, const float *x, float *y, int64_t D) {
    for (int64_t i = 0; i < D; i++) y[i] += a * x[i];
}

/* Attention for the nq query heads q [nq, D] (already rotated) that share one kv head and one
 * visibility row vis [n_keys]: out[m] = softmax(q[m] k^T * scale) v over the visible keys. Key j's
 * row is kc + row_j * stride (row_j = gather[j], or j when gather is NULL), likewise for v. Each
 * query's result is the same whichever queries share the call (batch invariance).
 * scores: nq * padded floats of scratch, sums: nq; out rows are out_stride apart. */
static void attend(const float *q, int64_t nq, const float *kc, const float *vc, const int64_t *gather,
                   int64_t stride, const uint8_t *vis, int64_t n_keys, int64_t D, float scale,
                   float *scores, float *sums, int64_t padded, float *out, int64_t out_stride) {
#define ROW(base, j) ((base) + (gather ? gather[j] : (j)) * stride)
    int64_t j = 0;
#ifdef __AVX2__
    if (D % 8 == 0)
        for (; j + 4 <= n_keys; j += 4) {
            if (!(vis[j] | vis[j + 1] | vis[j + 2] | vis[j + 3])) continue; /* masked below */
            const float *k[4] = {ROW(kc, j), ROW(kc, j + 1), ROW(kc, j + 2), ROW(kc, j + 3)};
            int64_t m = 0;
            for (; m + 2 <= nq; m += 2)
                dots_2x4(q + m * D, q + (m + 1) * D, k, D, scores + m * padded + j, scores + (m + 1) * padded + j);
            if (m < nq) dots_1x4(q + m * D, k, D, scores + m * padded + j);
        }
#endif
    for (; j < n_keys; j++)
        if (vis[j])
            for (int64_t m = 0; m < nq; m++) scores[m * padded + j] = dot(q + m * D, ROW(kc, j), D);
    for (int64_t m = 0; m < nq; m++) { /* softmax numerators in place; their sum in sums[m] */
        float *s = scores + m * padded, mx = -INFINITY, l = 0.f;
        for (j = 0; j < n_keys; j++) {
            s[j] = vis[j] ? s[j] * scale : -INFINITY;
            if (s[j] > mx) mx = s[j];
        }
        for (j = n_keys; j < padded; j++) s[j] = -INFINITY;
#ifdef __AVX2__
        for (j = 0; j < padded; j += 8)
            _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx))));
#else
        for (j = 0; j < padded; j++) s[j] = s[j] == -INFINITY ? 0.f : expf(s[j] - mx);
#endif
        for (j = 0; j < n_keys; j++) l += s[j];
        sums[m] = l;
    }
    int64_t m = 0;
#ifdef __AVX2__
    if (D % 8 == 0)
        for (; m < nq; m += 2) { /* two queries at a time share each v load */
            const float *s0 = scores + m * padded, *s1 = m + 1 < nq ? s0 + padded : NULL;
            float *o0 = out + m * out_stride, *o1 = o0 + out_stride;
            int64_t c = 0;
            for (; c + 32 <= D; c += 32) pv_chunk(s0, s1, vc, gather, stride, n_keys, c, 4, o0, o1);
            for (; c < D; c += 8) pv_chunk(s0, s1, vc, gather, stride, n_keys, c, 1, o0, o1);
        }
#endif
    for (; m < nq; m++) {
        float *o = out + m * out_stride;
        const float *s = scores + m * padded;
        for (int64_t i = 0; i < D; i++) o[i] = 0.f;
        for (j = 0; j < n_keys; j++)
            if (s[j] != 0.f) axpy(s[j], ROW(vc, j), o, D);
    }
    for (m = 0; m < nq; m++) {
        float *o = out + m * out_stride, inv = 1.0f / sums[m];
        for (int64_t i = 0; i < D; i++) o[i] *= inv;
    }
#undef ROW
}
/* Query heads per work unit: the heads of one kv head at one new token share its keys and its
 * visibility row; two of them share each key and value load (attend), and units of two keep both
 * cores busy even at T = 1 (a group of 3 makes units of 2 and 1). */
#define QCHUNK 2

/* Writes the new tokens' rotated keys and their values: token t's at kd(t), vd(t). */
static void write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *pos, float *kc, float *vc,
                     int64_t t, int64_t Hq, int64_t Hkv, int64_t D, int64_t dst, int64_t head_stride) {
    const int64_t row = (Hq + 2 * Hkv) * D;
    const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
    for (int64_t h = 0; h < Hkv; h++) {
        const float *k = qkv + t * row + (Hq + h) * D, *v = qkv + t * row + (Hq + Hkv + h) * D;
        rope(k, c, s, kc + dst + h * head_stride, D);
        for (int64_t i = 0; i < D; i++) vc[dst + h * head_stride + i] = v[i];
    }
}

/* Scratch of one thread: scores [QCHUNK, padded], rotated queries [QCHUNK, D], sums [QCHUNK], a
 * visibility row [padded] (bytes). NULL when it cannot be allocated. */
static float *scratch(int64_t padded, int64_t D) {
    return malloc(sizeof(float) * (QCHUNK * (padded + D + 1)) + padded);
}

/* Returns 0, or -1 when the scratch buffer cannot be allocated. */
int specdec_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                          float *kc, float *vc, const uint8_t *mask, float *out,
                          int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past, int64_t max_len,
                          float scale) {
    const int64_t row = (Hq + 2 * Hkv) * D, group = Hq / Hkv, n_keys = past + T, padded = (n_keys + 7) / 8 * 8;
    const int64_t chunks = (group + QCHUNK - 1) / QCHUNK;
    /* 1. rotary on k, write k and v of the new tokens into the cache */
    for (int64_t t = 0; t < T; t++) write_kv(qkv, cos, sin, pos, kc, vc, t, Hq, Hkv, D, (past + t) * D, max_len * D);
    /* 2. every (kv head, new token, chunk of its query heads): softmax(q k^T * scale) v over the
     *    visible keys (the whole prefix, then the new tokens the mask allows) */
    int failed = 0;
    #pragma omp parallel if (Hq * T * n_keys * D > 200000)
    {
        float *buf = scratch(padded, D);
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(3)
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t ch = 0; ch < chunks; ch++) {
                    if (buf == NULL) continue;
                    const int64_t h0 = g * group + ch * QCHUNK, nq = group - ch * QCHUNK < QCHUNK ? group - ch * QCHUNK : QCHUNK;
                    float *scores = buf, *q = scores + QCHUNK * padded, *sums = q + QCHUNK * D;
                    uint8_t *vis = (uint8_t *)(sums + QCHUNK);
                    for (int64_t m = 0; m < nq; m++)
                        rope(qkv + t * row + (h0 + m) * D, cos + pos[t] * D, sin + pos[t] * D, q + m * D, D);
                    memset(vis, 1, past);
                    for (int64_t j = 0; j < T; j++) vis[past + j] = mask ? mask[t * T + j] : j <= t;
                    attend(q, nq, kc + g * max_len * D, vc + g * max_len * D, NULL, D, vis, n_keys, D, scale,
                           scores, sums, padded, out + t * Hq * D + h0 * D, D);
                }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* The same attention for a batch of sequences in the paged pool (the serving engine's BatchKV):
 * B rows left-padded to T new tokens, L key columns per row.
 *
 * kc, vc:   [num_slots, Hkv, D]  this layer's pool; the key column j of row b lives at slot gather[b, j]
 * new_slot: [B, T]               where column t's new k/v is written (-1: a padding column)
 * pos:      [B, T]               positions of the new tokens (rotary)
 * mask:     [B, T, L] uint8      which key columns each query column sees (chain, tree or padding)
 * out:      [B, T, Hq * D]
 * A row's value depends only on its own keys, visited in column order with the same dot products
 * and aligned-8 exponentials as above, so it does not depend on B, T, L or the other rows. */
int specdec_paged_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                                float *kc, float *vc, const int64_t *new_slot, const int64_t *gather,
                                const uint8_t *mask, float *out, int64_t B, int64_t T, int64_t L, int64_t Hq,
                                int64_t Hkv, int64_t D, float scale) {
    const int64_t row = (Hq + 2 * Hkv) * D, group = Hq / Hkv, padded = (L + 7) / 8 * 8, slot = Hkv * D;
    const int64_t chunks = (group + QCHUNK - 1) / QCHUNK;
    for (int64_t bt = 0; bt < B * T; bt++)
        if (new_slot[bt] >= 0) write_kv(qkv, cos, sin, pos, kc, vc, bt, Hq, Hkv, D, new_slot[bt] * slot, D);
    int failed = 0;
    #pragma omp parallel if (B * Hq * T * L * D > 200000)
    {
        float *buf = scratch(padded, D);
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(3)
        for (int64_t bt = 0; bt < B * T; bt++)
            for (int64_t g = 0; g < Hkv; g++)
                for (int64_t ch = 0; ch < chunks; ch++) {
                    if (buf == NULL) continue;
                    const int64_t h0 = g * group + ch * QCHUNK, nq = group - ch * QCHUNK < QCHUNK ? group - ch * QCHUNK : QCHUNK;
                    float *scores = buf, *q = scores + QCHUNK * padded, *sums = q + QCHUNK * D;
                    for (int64_t m = 0; m < nq; m++)
                        rope(qkv + bt * row + (h0 + m) * D, cos + pos[bt] * D, sin + pos[bt] * D, q + m * D, D);
                    attend(q, nq, kc + g * D, vc + g * D, gather + (bt / T) * L, slot, mask + bt * L, L, D, scale,
                           scores, sums, padded, out + bt * Hq * D + h0 * D, D);
                }
        free(buf);
    }
    return failed ? -1 : 0;
}
