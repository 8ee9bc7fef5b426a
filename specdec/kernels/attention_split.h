/* The arithmetic of attention.c over one split of keys, for a few queries that share a kv head: scores
 * (one dot product per key with a fixed reduction tree), the split's softmax numerators, max and sum
 * (aligned 8-lane chunks), the exponential-weighted values (one FMA chain per element, keys ascending),
 * and the fold of a query's partials over its splits in ascending order. attention.c says why every
 * query's result is the same whatever it is computed with. This file holds what does not read the cache;
 * attention_kv.h, what does (attend_split), once per cache element type. Included by attention.c alone. */
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

#endif

/* s[j] = exp(s[j] * scale - max) over the visible keys j < n_keys, 0 elsewhere up to padded; returns
 * their sum, and their max in *max_out (-inf, and a sum of 0, when no key is visible). The sum runs over
 * aligned chunks of 8 (lane j % 8, then a fixed tree), so keys a row does not see, and the padding, add
 * exact zeros: a row's sum does not depend on n_keys (batch invariance). A visible NaN score makes every
 * numerator, the max and the sum NaN, so the query's output is NaN, as torch's softmax gives it (max_ps
 * and a compare drop NaNs: a diverging model's NaN keys read as weight 0 and went unnoticed). */
static float softmax_numerators(float *s, const uint8_t *vis, int64_t n_keys, int64_t padded, float scale,
                                float *max_out) {
    float mx = -INFINITY, l = 0.f;
    int64_t j = 0;
    int nan_seen = 0;
#ifdef __AVX2__
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    __m256 vmx = neg_inf, vnan = _mm256_setzero_ps();
    for (; j + 8 <= n_keys; j += 8) {
        __m256i seen = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vis + j)));
        __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, _mm256_setzero_si256()));
        __m256 v = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(s + j), vscale), keep);
        _mm256_storeu_ps(s + j, v);
        vmx = _mm256_max_ps(vmx, v);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan_seen = _mm256_movemask_ps(vnan) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; j < n_keys; j++) {
        s[j] = vis[j] ? s[j] * scale : -INFINITY;
        if (s[j] > mx) mx = s[j];
        nan_seen |= s[j] != s[j];
    }
    if (nan_seen) {
        for (j = 0; j < padded; j++) s[j] = NAN;
        *max_out = NAN;
        return NAN;
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
