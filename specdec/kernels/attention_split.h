/* The arithmetic of attention.c over one split of keys, for a few queries that share a kv head: scores
 * (one dot product per key with a fixed reduction tree), the split's softmax numerators, max and sum
 * (aligned 8-lane chunks), the exponential-weighted values (one FMA chain per element, keys ascending),
 * and the fold of a query's partials over its splits in ascending order. attention.c says why every
 * query's result is the same whatever it is computed with. Included by attention.c alone. */
#ifndef SPECDEC_ATTENTION_SPLIT_H
#define SPECDEC_ATTENTION_SPLIT_H
#include <stdint.h>
#include <math.h>
#include "common.h"

/* A query's key columns in the order of their positions. A tree pass writes its new tokens' keys at
 * columns past, past + 1, .. in node order, so a node's ancestors are not contiguous (siblings sit between
 * them) and near a multiple of KEY_SPLIT one may fall in the next split. A tree row's virtual column
 * c >= start (= past) reads column path[c - start] instead (while c - start < width; its visibility row
 * sees c <= its position): its root path laid out by depth, which is where a single-token pass at its
 * position finds those keys, so its score lanes, splits and FMA chains are that pass's
 * (specdec.spec.tree.root_path_columns). NULL: the columns as they are. */
typedef struct {
    int64_t start, width;
    const int64_t *path;
} Remap;

static inline int64_t key_row(const int64_t *gather, const Remap *rm, int64_t j) {
    const int64_t col = rm && j >= rm->start && j - rm->start < rm->width ? rm->path[j - rm->start] : j;
    return gather ? gather[col] : col;
}

#ifdef __AVX2__
/* exp(x) for x <= 0 in 8 lanes (Cephes-style: 2^n * poly(r), ~2 ulp), 0 where x = -inf. Applied
 * to aligned chunks of 8 scores, so a score's value never depends on how many keys a row has. */
static inline __m256 exp8(__m256 x) {
    const __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm256_blendv_ps(exp8_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))), _mm256_setzero_ps(), dead);
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

/* o_m[c, c + 8 NR) += s_m[j - base] v_j for the keys j in [j0, j1), ascending: one FMA per element and
 * key, in registers (NR x 8 lanes per query), for two queries (s1 NULL: one) sharing each v load. A
 * masked key's weight is 0 and adds an exact zero (a + 0 * v = a for a finite v; an accumulator that
 * starts at +0 never becomes -0), so o is what skipping the masked keys would give, without a branch
 * per key (those branches were ~10% of a verify pass's attention over a long context). */
static inline __attribute__((always_inline)) void pv_chunk(const float *s0, const float *s1, const float *vc,
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
            const float *v = vc + key_row(gather, rm, j) * stride + c;
            const __m256 w0 = _mm256_broadcast_ss(s0 + (j - base)), w1 = _mm256_broadcast_ss(s1 + (j - base));
            for (int r = 0; r < NR; r++) {
                const __m256 vv = _mm256_loadu_ps(v + 8 * r);
                a[0][r] = _mm256_fmadd_ps(w0, vv, a[0][r]);
                a[1][r] = _mm256_fmadd_ps(w1, vv, a[1][r]);
            }
        }
    else
        for (int64_t j = j0; j < j1; j++) {
            const float *v = vc + key_row(gather, rm, j) * stride + c;
            const __m256 w0 = _mm256_broadcast_ss(s0 + (j - base));
            for (int r = 0; r < NR; r++) a[0][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v + 8 * r), a[0][r]);
        }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(o0 + c + 8 * r, a[0][r]);
        if (s1) _mm256_storeu_ps(o1 + c + 8 * r, a[1][r]);
    }
}

static inline int any4(const uint8_t *v) { return v[0] | v[1] | v[2] | v[3]; }
#endif

/* The 16-lane (AVX-512) forms, where the CPU has it and D is a multiple of 16: one FMA chain per 16
 * lanes over D, the two halves added (lane i + lane i + 8), then the 8-lane tree above. A build on an
 * AVX-512 CPU computes every score this way (dot() too), so a score's value never depends on which
 * keys or queries came with it; the width is fixed per build (-march=native), as in gemv.c. The weighted
 * values are element-wise FMA chains, the same at any width: pv_chunk16 gives pv_chunk's bits.
 * Intel Xeon with AVX-512 (2 vCPUs), SmolLM2-135M in bf16 on AMX tiles, this build against the 8-lane
 * one in alternating processes, two rounds: a 900-token prompt's pass 567 / 535 -> 464 / 457 ms; after
 * 900 cached tokens a pass over 8 tokens 19.2 / 18.5 -> 17.5 / 17.1 ms, over 1 token 13.8 / 13.1 ->
 * 12.5 / 12.6 ms (fp32: 3-10% less). */
#if defined(__AVX512F__) && !defined(ATTN_NO_AVX512)
#define ATTN_W16 1
static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline void dots16_2x4(const float *q0, const float *q1, const float *const k[4], int64_t D,
                              float *out0, float *out1) {
    __m512 a[2][4];
    for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x0 = _mm512_loadu_ps(q0 + d), x1 = _mm512_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m512 kv = _mm512_loadu_ps(k[i] + d);
            a[0][i] = _mm512_fmadd_ps(x0, kv, a[0][i]);
            a[1][i] = _mm512_fmadd_ps(x1, kv, a[1][i]);
        }
    }
    store4(hsum4(fold16(a[0][0]), fold16(a[0][1]), fold16(a[0][2]), fold16(a[0][3])), out0);
    store4(hsum4(fold16(a[1][0]), fold16(a[1][1]), fold16(a[1][2]), fold16(a[1][3])), out1);
}

static inline void dots16_1x4(const float *q, const float *const k[4], int64_t D, float *out) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 4; i++) a[i] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[i] + d), a[i]);
    }
    store4(hsum4(fold16(a[0]), fold16(a[1]), fold16(a[2]), fold16(a[3])), out);
}

/* pv_chunk over NR x 16 lanes */
static inline __attribute__((always_inline)) void pv_chunk16(const float *s0, const float *s1, const float *vc,
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
            const float *v = vc + key_row(gather, rm, j) * stride + c;
            const __m512 w0 = _mm512_set1_ps(s0[j - base]), w1 = _mm512_set1_ps(s1[j - base]);
            for (int r = 0; r < NR; r++) {
                const __m512 vv = _mm512_loadu_ps(v + 16 * r);
                a[0][r] = _mm512_fmadd_ps(w0, vv, a[0][r]);
                a[1][r] = _mm512_fmadd_ps(w1, vv, a[1][r]);
            }
        }
    else
        for (int64_t j = j0; j < j1; j++) {
            const float *v = vc + key_row(gather, rm, j) * stride + c;
            const __m512 w0 = _mm512_set1_ps(s0[j - base]);
            for (int r = 0; r < NR; r++) a[0][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + 16 * r), a[0][r]);
        }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(o0 + c + 16 * r, a[0][r]);
        if (s1) _mm512_storeu_ps(o1 + c + 16 * r, a[1][r]);
    }
}
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
#ifdef ATTN_W16
    if (D % 16 == 0) { /* the same reduction tree as dots16_1x4 */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        const __m256 z = _mm256_setzero_ps();
        float out[4];
        store4(hsum4(fold16(acc), z, z, z), out);
        return out[0];
    }
#endif
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

/* s[j] = exp(s[j] * scale - max) over the visible keys j < n_keys, 0 elsewhere up to padded; returns
 * their sum, and their max in *max_out (-inf, and a sum of 0, when no key is visible). The sum runs over
 * aligned chunks of 8 (lane j % 8, then a fixed tree), so keys a row does not see, and the padding, add
 * exact zeros: a row's sum does not depend on n_keys (batch invariance). */
static float softmax_numerators(float *s, const uint8_t *vis, int64_t n_keys, int64_t padded, float scale,
                                float *max_out) {
    float mx = -INFINITY, l = 0.f;
    int64_t j = 0;
#ifdef __AVX2__
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    __m256 vmx = neg_inf;
    for (; j + 8 <= n_keys; j += 8) {
        __m256i seen = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vis + j)));
        __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, _mm256_setzero_si256()));
        __m256 v = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(s + j), vscale), keep);
        _mm256_storeu_ps(s + j, v);
        vmx = _mm256_max_ps(vmx, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; j < n_keys; j++) {
        s[j] = vis[j] ? s[j] * scale : -INFINITY;
        if (s[j] > mx) mx = s[j];
    }
    *max_out = mx;
    if (mx == -INFINITY) return 0.f; /* nothing visible here: the caller skips these keys */
    for (j = n_keys; j < padded; j++) s[j] = -INFINITY;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), z = acc;
    for (j = 0; j < padded; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    store4(hsum4(acc, z, z, z), lanes);
    l = lanes[0];
#else
    for (j = 0; j < padded; j++) s[j] = s[j] == -INFINITY ? 0.f : expf(s[j] - mx);
    for (j = 0; j < n_keys; j++) l += s[j];
#endif
    return l;
}

/* Keys are attended in fixed splits of KEY_SPLIT columns (column j: the sequence's key j, in the static
 * cache and in the paged pool alike). Each split gives a partial per query (the max of its visible
 * scores, the sum of their exponentials and the exponential-weighted sum of their values), and a query's
 * partials are folded in ascending order (fold). A partial is a function of its split's keys alone and the
 * fold's order is fixed, so a query's result depends on its own keys only: not on T, B, the work units or
 * the threads (batch invariance). Splits let both cores share a kv head's keys (a decode step over a long
 * context has 3 kv heads for 2 cores, and each thread reads only its splits), and a split's keys stay in
 * cache while the head's query units use it. With one split a query's result is exactly the unsplit
 * softmax (fold of one partial: acc / sum). */
#define KEY_SPLIT 128
#define KEY_BLOCK 64 /* keys a pair of queries passes over while they stay in L1 (KEY_SPLIT: a multiple) */
#define PART(D) ((D) + 2) /* floats of one partial: max, sum, acc[D] */

/* The partials of queries q [nq, D] (already rotated) that share one kv head's keys, over the key columns
 * [j0, j1): part[m] = {max, sum, acc} of the keys j with vis[m][j] (scores softmax(q k^T * scale)'s
 * numerators relative to the split's max; max -inf and sum 0 when none is visible). Key j's row is kc +
 * row_j * stride (row_j = gather[j], or j when gather is NULL), likewise for v. scores: nq * KEY_SPLIT
 * floats of scratch. */
static void attend_split(const float *q, int64_t nq, const uint8_t *const *vis, float *const *part, const float *kc,
                         const float *vc, const int64_t *gather, const Remap *const *rm, int64_t stride, int64_t j0,
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
                    const float *k[4] = {ROW(kc, j), ROW(kc, j + 1), ROW(kc, j + 2), ROW(kc, j + 3)};
                    if (m == 0) /* the values these keys weigh, on their way while the scores are made */
                        for (int i = 0; i < 4; i++)
                            for (int64_t o = 0; o < D; o += 16) _mm_prefetch((const char *)(ROW(vc, j + i) + o), _MM_HINT_T0);
#ifdef ATTN_W16
                    if (D % 16 == 0) {
                        if (two) dots16_2x4(q + m * D, q + (m + 1) * D, k, D, s0 + (j - j0), s1 + (j - j0));
                        else dots16_1x4(q + m * D, k, D, s0 + (j - j0));
                        continue;
                    }
#endif
                    if (two) dots_2x4(q + m * D, q + (m + 1) * D, k, D, s0 + (j - j0), s1 + (j - j0));
                    else dots_1x4(q + m * D, k, D, s0 + (j - j0));
                }
#endif
            for (; j < b1; j++) { /* the same dot products, one key at a time: the rest, and remapped keys */
                if (vis[m][j]) s0[j - j0] = dot(q + m * D, QROW(kc, m, j), D);
                if (two && vis[m + 1][j]) s1[j - j0] = dot(q + (m + 1) * D, QROW(kc, m + 1, j), D);
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
                for (; c + 64 <= D; c += 64) pv_chunk16(s0, s1, vc, gather, stride, j0, b0, bs, c, 4, o0, o1, NULL);
                for (; c + 16 <= D; c += 16) pv_chunk16(s0, s1, vc, gather, stride, j0, b0, bs, c, 1, o0, o1, NULL);
#endif
                for (; c + 32 <= D; c += 32) pv_chunk(s0, s1, vc, gather, stride, j0, b0, bs, c, 4, o0, o1, NULL);
                for (; c < D; c += 8) pv_chunk(s0, s1, vc, gather, stride, j0, b0, bs, c, 1, o0, o1, NULL);
            }
            for (int64_t m = 0; m < nq && bs < b1; m++) { /* [bs, b1): each query its own keys, in order */
                if (part[m][0] == -INFINITY) continue;
                int64_t c = 0;
#ifdef ATTN_W16
                for (; c + 64 <= D; c += 64)
                    pv_chunk16(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 4, part[m] + 2, NULL, rm[m]);
                for (; c + 16 <= D; c += 16)
                    pv_chunk16(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 1, part[m] + 2, NULL, rm[m]);
#endif
                for (; c + 32 <= D; c += 32)
                    pv_chunk(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 4, part[m] + 2, NULL, rm[m]);
                for (; c < D; c += 8)
                    pv_chunk(scores + m * KEY_SPLIT, NULL, vc, gather, stride, j0, bs, b1, c, 1, part[m] + 2, NULL, rm[m]);
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < nq; m++) {
            if (part[m][0] == -INFINITY) continue;
            for (int64_t j = b0; j < b1; j++)
                if (scores[m * KEY_SPLIT + j - j0] != 0.f) axpy(scores[m * KEY_SPLIT + j - j0], QROW(vc, m, j), part[m] + 2, D);
        }
    }
#undef ROW
#undef QROW
}

/* out[D] = a query's attention from its partials [nsplits, PART(D)], folded in ascending order (splits
 * with nothing visible skipped): max' = max(max, max_s), sum = sum e^(max - max') + sum_s e^(max_s - max'),
 * likewise acc; then out = acc / sum. One partial gives acc * (1 / sum), the unsplit kernel's result. */
static void fold(const float *part, int64_t nsplits, int64_t D, float *out) {
    float mx = -INFINITY, l = 0.f;
    for (int64_t s = 0; s < nsplits; s++) {
        const float *p = part + s * PART(D);
        if (p[0] == -INFINITY) continue;
        if (mx == -INFINITY) {
            mx = p[0], l = p[1];
            for (int64_t i = 0; i < D; i++) out[i] = p[2 + i];
            continue;
        }
        const float top = p[0] > mx ? p[0] : mx, a = expf(mx - top), c = expf(p[0] - top);
        /* one copy of this loop (fold has one caller), so however GCC contracts it, every query gets the
         * same; spelling it with fmaf measured 3-10% slower (A/B, 1024-2048 cached tokens) */
        l = l * a + p[1] * c;
        for (int64_t i = 0; i < D; i++) out[i] = out[i] * a + p[2 + i] * c;
        mx = top;
    }
    const float inv = 1.0f / l;
    for (int64_t i = 0; i < D; i++) out[i] *= inv;
}
#endif
