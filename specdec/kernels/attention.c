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

/* Dots of q with 4 keys at once: one FMA chain per key over D, then a shared reduction tree (the
 * same per key whichever 4 keys share it). */
static inline void dot4(const float *q, const float *k, int64_t D, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < D; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + i), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
#ifdef __AVX2__
    if (D % 8 == 0) { /* the same reduction tree as dot4 */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m256 z = _mm256_setzero_ps(), h = _mm256_hadd_ps(_mm256_hadd_ps(acc, z), _mm256_hadd_ps(z, z));
        return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
#endif
    float r = 0.f;
    for (int64_t i = 0; i < D; i++) r += a[i] * b[i];
    return r;
}

static inline void axpy(float a, const float *x, float *y, int64_t D) {
    for (int64_t i = 0; i < D; i++) y[i] += a * x[i];
}

/* Returns 0, or -1 when the scratch buffer cannot be allocated. */
int specdec_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                          float *kc, float *vc, const uint8_t *mask, float *out,
                          int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past, int64_t max_len,
                          float scale) {
    const int64_t row = (Hq + 2 * Hkv) * D, group = Hq / Hkv, n_keys = past + T, padded = (n_keys + 7) / 8 * 8;
    /* 1. rotary on k, write k and v of the new tokens into the cache */
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *k = qkv + t * row + (Hq + h) * D, *v = qkv + t * row + (Hq + Hkv + h) * D;
            float *kd = kc + (h * max_len + past + t) * D, *vd = vc + (h * max_len + past + t) * D;
            rope(k, c, s, kd, D);
            for (int64_t i = 0; i < D; i++) vd[i] = v[i];
        }
    }
    /* 2. every (query head, new token) row: softmax(q k^T * scale) v over its visible keys */
    int failed = 0;
    #pragma omp parallel if (Hq * T * n_keys * D > 200000)
    {
        float *buf = malloc(sizeof(float) * (padded + D));
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t t = 0; t < T; t++) {
                if (buf == NULL) continue;
                float *scores = buf, *q = buf + padded;
                const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
                const float *kh = kc + (h / group) * max_len * D, *vh = vc + (h / group) * max_len * D;
                rope(qkv + t * row + h * D, c, s, q, D);
                int64_t j = 0;
#ifdef __AVX2__
                if (D % 8 == 0)
                    for (; j + 4 <= n_keys; j += 4) dot4(q, kh + j * D, D, scores + j);
#endif
                for (; j < n_keys; j++) scores[j] = dot(q, kh + j * D, D);
                float m = -INFINITY;
                for (j = 0; j < n_keys; j++) {
                    int visible = j < past || (mask ? mask[t * T + (j - past)] : j - past <= t);
                    scores[j] = visible ? scores[j] * scale : -INFINITY;
                    if (scores[j] > m) m = scores[j];
                }
                for (j = n_keys; j < padded; j++) scores[j] = -INFINITY;
                float l = 0.f;
#ifdef __AVX2__
                for (j = 0; j < padded; j += 8)
                    _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(m))));
#else
                for (j = 0; j < padded; j++) scores[j] = scores[j] == -INFINITY ? 0.f : expf(scores[j] - m);
#endif
                for (j = 0; j < n_keys; j++) l += scores[j];
                float *o = out + t * Hq * D + h * D;
                for (int64_t i = 0; i < D; i++) o[i] = 0.f;
                for (int64_t j = 0; j < n_keys; j++)
                    if (scores[j] != 0.f) axpy(scores[j], vh + j * D, o, D);
                float inv = 1.0f / l;
                for (int64_t i = 0; i < D; i++) o[i] *= inv;
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
    for (int64_t bt = 0; bt < B * T; bt++) {
        if (new_slot[bt] < 0) continue;
        const float *c = cos + pos[bt] * D, *s = sin + pos[bt] * D;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *k = qkv + bt * row + (Hq + h) * D, *v = qkv + bt * row + (Hq + Hkv + h) * D;
            float *kd = kc + new_slot[bt] * slot + h * D, *vd = vc + new_slot[bt] * slot + h * D;
            rope(k, c, s, kd, D);
            for (int64_t i = 0; i < D; i++) vd[i] = v[i];
        }
    }
    int failed = 0;
    #pragma omp parallel if (B * Hq * T * L * D > 200000)
    {
        float *buf = malloc(sizeof(float) * (padded + D));
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static) collapse(2)
        for (int64_t bt = 0; bt < B * T; bt++)
            for (int64_t h = 0; h < Hq; h++) {
                if (buf == NULL) continue;
                float *scores = buf, *q = buf + padded;
                const int64_t b = bt / T, kv = (h / group) * D;
                const uint8_t *visible = mask + bt * L;
                rope(qkv + bt * row + h * D, cos + pos[bt] * D, sin + pos[bt] * D, q, D);
                float m = -INFINITY;
                for (int64_t j = 0; j < L; j++) {
                    scores[j] = visible[j] ? dot(q, kc + gather[b * L + j] * slot + kv, D) * scale : -INFINITY;
                    if (scores[j] > m) m = scores[j];
                }
                for (int64_t j = L; j < padded; j++) scores[j] = -INFINITY;
#ifdef __AVX2__
                for (int64_t j = 0; j < padded; j += 8)
                    _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(m))));
#else
                for (int64_t j = 0; j < padded; j++) scores[j] = scores[j] == -INFINITY ? 0.f : expf(scores[j] - m);
#endif
                float l = 0.f;
                for (int64_t j = 0; j < L; j++) l += scores[j];
                float *o = out + bt * Hq * D + h * D;
                for (int64_t i = 0; i < D; i++) o[i] = 0.f;
                for (int64_t j = 0; j < L; j++)
                    if (scores[j] != 0.f) axpy(scores[j], vc + gather[b * L + j] * slot + kv, o, D);
                const float inv = 1.0f / l;
                for (int64_t i = 0; i < D; i++) o[i] *= inv;
            }
        free(buf);
    }
    return failed ? -1 : 0;
}
