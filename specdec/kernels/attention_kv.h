/* The part of attention_split.h's arithmetic that reads the cache's keys and values, for one element type
 * of the cache. attention.c includes it once per type, with
 *   KV      the element: float (an fp32 cache) or uint16_t (bfloat16 bits, a cache of --kv-cache-dtype bfloat16)
 *   KV_BF16 0 or 1 accordingly
 *   KVN(f)  f's name for this type (f_f32, f_bf16)
 * Every load widens a key or value to fp32 exactly (bfloat16: a 16-bit shift) and the arithmetic after it
 * is the same for both types: a bf16 cache changes what is stored (each key and value rounded once, when
 * written), not how a score or an output is computed, so a query's result depends on its own keys alone
 * with either type (batch invariance, attention.c). No include guard: it is meant to be included twice. */
#if KV_BF16
static inline float KVN(get)(const KV *p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#ifdef __AVX2__
static inline __m256 KVN(load8)(const KV *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
#ifdef ATTN_W16
static inline __m512 KVN(load16)(const KV *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif
#else
static inline float KVN(get)(const KV *p) { return *p; }
#ifdef __AVX2__
static inline __m256 KVN(load8)(const KV *p) { return _mm256_loadu_ps(p); }
#endif
#ifdef ATTN_W16
static inline __m512 KVN(load16)(const KV *p) { return _mm512_loadu_ps(p); }
#endif
#endif

#ifdef __AVX2__
/* Two queries against four keys: each key chunk is loaded once for both queries (8 chains). */
static inline void KVN(dots_2x4)(const float *q0, const float *q1, const KV *const k[4], int64_t D,
                            float *out0, float *out1) {
    __m256 a[2][4];
    for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m256 kv = KVN(load8)(k[i] + d);
            a[0][i] = _mm256_fmadd_ps(x0, kv, a[0][i]);
            a[1][i] = _mm256_fmadd_ps(x1, kv, a[1][i]);
        }
    }
    store4(hsum4(a[0][0], a[0][1], a[0][2], a[0][3]), out0);
    store4(hsum4(a[1][0], a[1][1], a[1][2], a[1][3]), out1);
}

static inline void KVN(dots_1x4)(const float *q, const KV *const k[4], int64_t D, float *out) {
    __m256 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(x, KVN(load8)(k[i] + d), a[i]);
    }
    store4(hsum4(a[0], a[1], a[2], a[3]), out);
}

/* o_m[c, c + 8 NR) += s_m[j - base] v_j for the keys j in [j0, j1), ascending: one FMA per element and
 * key, in registers (NR x 8 lanes per query), for two queries (s1 NULL: one) sharing each v load. A
 * masked key's weight is 0 and adds an exact zero (a + 0 * v = a for a finite v; an accumulator that
 * starts at +0 never becomes -0), so o is what skipping the masked keys would give, without a branch
 * per key (those branches were ~10% of a verify pass's attention over a long context). */
static inline __attribute__((always_inline)) void KVN(pv_chunk)(const float *s0, const float *s1, const KV *vc,
                                                            const int64_t *gather, int64_t stride, int64_t base,
                                                            int64_t j0, int64_t j1, int64_t c, const int NR,
                                                            float *o0, float *o1, const Remap *rm) {
    __m256 a[2][4];
    for (int r = 0; r < NR; r++) {
        a[0][r] = _mm256_loadu_ps(o0 + c + 8 * r);
        a[1][r] = s1 ? _mm256_loadu_ps(o1 + c + 8 * r) : _mm256_setzero_ps();
    }
    if (s1)
        for (int64_t j = j0; j < j1; j++) {
            const KV *v = vc + key_row(gather, rm, j) * stride + c;
            const __m256 w0 = _mm256_broadcast_ss(s0 + (j - base)), w1 = _mm256_broadcast_ss(s1 + (j - base));
            for (int r = 0; r < NR; r++) {
                const __m256 vv = KVN(load8)(v + 8 * r);
                a[0][r] = _mm256_fmadd_ps(w0, vv, a[0][r]);
                a[1][r] = _mm256_fmadd_ps(w1, vv, a[1][r]);
            }
        }
    else
        for (int64_t j = j0; j < j1; j++) {
            const KV *v = vc + key_row(gather, rm, j) * stride + c;
            const __m256 w0 = _mm256_broadcast_ss(s0 + (j - base));
            for (int r = 0; r < NR; r++) a[0][r] = _mm256_fmadd_ps(w0, KVN(load8)(v + 8 * r), a[0][r]);
        }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(o0 + c + 8 * r, a[0][r]);
        if (s1) _mm256_storeu_ps(o1 + c + 8 * r, a[1][r]);
    }
}
#endif

#ifdef ATTN_W16
static inline void KVN(dots16_2x4)(const float *q0, const float *q1, const KV *const k[4], int64_t D,
                              float *out0, float *out1) {
    __m512 a[2][4];
    for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x0 = _mm512_loadu_ps(q0 + d), x1 = _mm512_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m512 kv = KVN(load16)(k[i] + d);
            a[0][i] = _mm512_fmadd_ps(x0, kv, a[0][i]);
            a[1][i] = _mm512_fmadd_ps(x1, kv, a[1][i]);
        }
    }
    store4(hsum4(fold16(a[0][0]), fold16(a[0][1]), fold16(a[0][2]), fold16(a[0][3])), out0);
    store4(hsum4(fold16(a[1][0]), fold16(a[1][1]), fold16(a[1][2]), fold16(a[1][3])), out1);
}

static inline void KVN(dots16_1x4)(const float *q, const KV *const k[4], int64_t D, float *out) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 4; i++) a[i] = _mm512_fmadd_ps(x, KVN(load16)(k[i] + d), a[i]);
    }
    store4(hsum4(fold16(a[0]), fold16(a[1]), fold16(a[2]), fold16(a[3])), out);
}

/* pv_chunk over NR x 16 lanes */
static inline __attribute__((always_inline)) void KVN(pv_chunk16)(const float *s0, const float *s1, const KV *vc,
                                                              const int64_t *gather, int64_t stride, int64_t base,
                                                              int64_t j0, int64_t j1, int64_t c, const int NR,
                                                              float *o0, float *o1, const Remap *rm) {
    __m512 a[2][4];
    for (int r = 0; r < NR; r++) {
        a[0][r] = _mm512_loadu_ps(o0 + c + 16 * r);
        a[1][r] = s1 ? _mm512_loadu_ps(o1 + c + 16 * r) : _mm512_setzero_ps();
    }
    if (s1)
        for (int64_t j = j0; j < j1; j++) {
            const KV *v = vc + key_row(gather, rm, j) * stride + c;
            const __m512 w0 = _mm512_set1_ps(s0[j - base]), w1 = _mm512_set1_ps(s1[j - base]);
            for (int r = 0; r < NR; r++) {
                const __m512 vv = KVN(load16)(v + 16 * r);
                a[0][r] = _mm512_fmadd_ps(w0, vv, a[0][r]);
                a[1][r] = _mm512_fmadd_ps(w1, vv, a[1][r]);
            }
        }
    else
        for (int64_t j = j0; j < j1; j++) {
            const KV *v = vc + key_row(gather, rm, j) * stride + c;
            const __m512 w0 = _mm512_set1_ps(s0[j - base]);
            for (int r = 0; r < NR; r++) a[0][r] = _mm512_fmadd_ps(w0, KVN(load16)(v + 16 * r), a[0][r]);
        }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(o0 + c + 16 * r, a[0][r]);
        if (s1) _mm512_storeu_ps(o1 + c + 16 * r, a[1][r]);
    }
}
#endif

static inline float KVN(dot)(const float *a, const KV *b, int64_t D) {
#ifdef ATTN_W16
    if (D % 16 == 0) { /* the same reduction tree as dots16_1x4 */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), KVN(load16)(b + i), acc);
        const __m256 z = _mm256_setzero_ps();
        float out[4];
        store4(hsum4(fold16(acc), z, z, z), out);
        return out[0];
    }
#endif
#ifdef __AVX2__
    if (D % 8 == 0) { /* the same reduction tree as dots_1x4 */
        __m256 acc = _mm256_setzero_ps(), z = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), KVN(load8)(b + i), acc);
        float out[4];
        store4(hsum4(acc, z, z, z), out);
        return out[0];
    }
#endif
    float r = 0.f;
    for (int64_t i = 0; i < D; i++) r += a[i] * KVN(get)(b + i);
    return r;
}

static inline void KVN(axpy)(float a, const KV *x, float *y, int64_t D) {
    for (int64_t i = 0; i < D; i++) y[i] += a * KVN(get)(x + i);
}

/* The partials of queries q [nq, D] (already rotated) that share one kv head's keys, over the key columns
 * [j0, j1): part[m] = {max, sum, acc} of the keys j with vis[m][j] (scores softmax(q k^T * scale)'s
 * numerators relative to the split's max; max -inf and sum 0 when none is visible). Key j's row is kc +
 * row_j * stride (row_j = gather[j], or j when gather is NULL), likewise for v. scores: nq * KEY_SPLIT
 * floats of scratch. */
static void KVN(attend_split)(const float *q, int64_t nq, const uint8_t *const *vis, float *const *part, const KV *kc,
                         const KV *vc, const int64_t *gather, const Remap *const *rm, int64_t stride, int64_t j0,
                         int64_t j1, int64_t D, float scale, float *scores) {
#define ROW(base, j) ((base) + (gather ? gather[j] : (j)) * stride)
#define QROW(base, m, j) ((base) + key_row(gather, rm[m], j) * stride)
    const int64_t n = j1 - j0, padded = (n + 7) / 8 * 8;
    int64_t shared = j1; /* columns before this are every query's own (no remap): their loads are shared */
    for (int64_t m = 0; m < nq; m++)
        if (rm[m] && rm[m]->start < shared) shared = rm[m]->start;
    for (int64_t b0 = j0; b0 < j1; b0 += KEY_BLOCK) { /* 1. scores of the visible keys */
        const int64_t b1 = b0 + KEY_BLOCK < j1 ? b0 + KEY_BLOCK : j1;
        const int64_t bs = shared < b0 ? b0 : shared < b1 ? shared : b1;
        for (int64_t m = 0; m < nq; m += 2) {
            const int two = m + 1 < nq;
            float *s0 = scores + m * KEY_SPLIT, *s1 = s0 + KEY_SPLIT; /* column j at [j - j0] */
            int64_t j = b0;
#ifdef __AVX2__
            if (D % 8 == 0)
                for (; j + 4 <= bs; j += 4) {
                    if (!any4(vis[m] + j) && !(two && any4(vis[m + 1] + j))) continue; /* masked below */
                    const KV *k[4] = {ROW(kc, j), ROW(kc, j + 1), ROW(kc, j + 2), ROW(kc, j + 3)};
                    if (m == 0) /* the values these keys weigh, on their way while the scores are made */
                        for (int i = 0; i < 4; i++)
                            for (int64_t o = 0; o < D; o += 64 / (int64_t)sizeof(KV)) _mm_prefetch((const char *)(ROW(vc, j + i) + o), _MM_HINT_T0);
#ifdef ATTN_W16
                    if (D % 16 == 0) {
                        if (two) KVN(dots16_2x4)(q + m * D, q + (m + 1) * D, k, D, s0 + (j - j0), s1 + (j - j0));
                        else KVN(dots16_1x4)(q + m * D, k, D, s0 + (j - j0));
                        continue;
                    }
#endif
                    if (two) KVN(dots_2x4)(q + m * D, q + (m + 1) * D, k, D, s0 + (j - j0), s1 + (j - j0));
                    else KVN(dots_1x4)(q + m * D, k, D, s0 + (j - j0));
                }
#endif
            for (; j < b1; j++) { /* the same dot products, one key at a time: the rest, and remapped keys */
                if (vis[m][j]) s0[j - j0] = KVN(dot)(q + m * D, QROW(kc, m, j), D);
                if (two && vis[m + 1][j]) s1[j - j0] = KVN(dot)(q + (m + 1) * D, QROW(kc, m + 1, j), D);
            }
        }
    }
    for (int64_t m = 0; m < nq; m++) { /* 2. the numerators in place, their max and sum */
        part[m][1] = softmax_numerators(scores + m * KEY_SPLIT, vis[m] + j0, n, padded, scale, &part[m][0]);
        for (int64_t i = 0; i < D; i++) part[m][2 + i] = 0.f;
    }
    for (int64_t b0 = j0; b0 < j1; b0 += KEY_BLOCK) { /* 3. the weighted values, block by block */
        const int64_t b1 = b0 + KEY_BLOCK < j1 ? b0 + KEY_BLOCK : j1;
        const int64_t bs = shared < b0 ? b0 : shared < b1 ? shared : b1;
#ifdef __AVX2__
        if (D % 8 == 0) {
            for (int64_t m = 0; m < nq && b0 < bs; m += 2) { /* [b0, bs): pairs share each value load */
                const int two = m + 1 < nq && part[m + 1][0] != -INFINITY;
                if (part[m][0] == -INFINITY && !two) continue;
                /* a query with nothing visible here has weights of 0 on no set key: it pairs as s1 = NULL */
                const int first = part[m][0] != -INFINITY;
                const int64_t a = first ? m : m + 1;
                const float *s0 = scores + a * KEY_SPLIT, *s1 = first && two ? scores + (m + 1) * KEY_SPLIT : NULL;
                float *o0 = part[a] + 2, *o1 = first && two ? part[m + 1] + 2 : NULL;
                int64_t c = 0;
#ifdef ATTN_W16
                for (; c + 64 <= D; c += 64) KVN(pv_chunk16)(s0, s1, vc, gather, stride, j0, b0, bs, c, 4, o0, o1, NULL);
                for (; c + 16 <= D; c += 16) KVN(pv_chunk16)(s0, s1, vc, gather, stride, j0, b0, bs, c, 1, o0, o1, NULL);
#endif
                for (; c + 32 <= D; c += 32) KVN(pv_chunk)(s0, s1, vc, gather, stride, j0, b0, bs, c, 4, o0, o1, NULL);
                for (; c < D; c += 8) KVN(pv_chunk)(s0, s1, vc, gather, stride, j0, b0, bs, c, 1, o0, o1, NULL);
            }
            for (int64_t m = 0; m < nq && bs < b1; m++) { /* [bs, b1): each query its own keys, in order */
                if (part[m][0] == -INFINITY) continue;
                int64_t c = 0;
#ifdef ATTN_W16
                for (; c + 64 <= D; c += 64)
                    KVN(pv_chunk16)(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 4, part[m] + 2, NULL, rm[m]);
                for (; c + 16 <= D; c += 16)
                    KVN(pv_chunk16)(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 1, part[m] + 2, NULL, rm[m]);
#endif
                for (; c + 32 <= D; c += 32)
                    KVN(pv_chunk)(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 4, part[m] + 2, NULL, rm[m]);
                for (; c < D; c += 8)
                    KVN(pv_chunk)(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 1, part[m] + 2, NULL, rm[m]);
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < nq; m++) {
            if (part[m][0] == -INFINITY) continue;
            for (int64_t j = b0; j < b1; j++)
                if (scores[m * KEY_SPLIT + j - j0] != 0.f) KVN(axpy)(scores[m * KEY_SPLIT + j - j0], QROW(vc, m, j), part[m] + 2, D);
        }
    }
#undef ROW
#undef QROW
}

