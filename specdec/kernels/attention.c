/* Decode-shaped attention for one sequence in a static KV cache, fp32: rotary embedding, the KV
 * write and attention over the cached prefix plus T new tokens, in one call per layer.
 *
 * For T <= 64 new tokens (MAX_ROWS) the work is small and a chain of ~25 torch ops per layer (split, views,
 * rotary, cache slices, SDPA, transposes) costs more in dispatch than in arithmetic; here it is
 * one loop nest. The queries that read the same kv head (its group of query heads, at every new
 * token) share each key and value load, two at a time, over key blocks that stay in L1; yet every
 * query row is the same sequence of operations whatever shares its loads (each score one dot product
 * with a fixed reduction tree, the softmax sum over aligned 8-lane chunks, each output element one
 * FMA chain over the visible keys, ascending), so a verify pass over k+1 tokens gives bitwise the
 * same rows as k+1 single-token passes (batch invariance, as gemv.c).
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
#include <stdatomic.h>
#include "common.h"

static void rope(const float *x, const float *c, const float *s, float *y, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) y[i] = x[i] * c[i] + x[i + h] * s[i];
    for (int64_t i = h; i < D; i++) y[i] = x[i] * c[i] + x[i - h] * s[i];
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

/* o_m[c, c + 8 NR) += s_m[j] v_j for the keys j in [j0, j1), ascending: one FMA per element and key,
 * in registers (NR x 8 lanes per query), for two queries (s1 NULL: one) sharing each v load. Keys
 * with a zero weight (masked) are skipped, so o is what one unblocked pass over the keys gives. */
static inline __attribute__((always_inline)) void pv_chunk(const float *s0, const float *s1, const float *vc,
                                                            const int64_t *gather, int64_t stride, int64_t j0,
                                                            int64_t j1, int64_t c, const int NR, float *o0, float *o1) {
    __m256 a[2][4];
    for (int r = 0; r < NR; r++) {
        a[0][r] = _mm256_loadu_ps(o0 + c + 8 * r);
        a[1][r] = s1 ? _mm256_loadu_ps(o1 + c + 8 * r) : _mm256_setzero_ps();
    }
    for (int64_t j = j0; j < j1; j++) {
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

static inline int any4(const uint8_t *v) { return v[0] | v[1] | v[2] | v[3]; }
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

/* s[j] = exp(s[j] * scale - max) over the visible keys j < n_keys, 0 elsewhere up to padded; returns
 * their sum. The sum runs over aligned chunks of 8 (lane j % 8, then a fixed tree), so keys a row does
 * not see, and the padding, add exact zeros: a row's sum does not depend on n_keys (batch invariance). */
static float softmax_numerators(float *s, const uint8_t *vis, int64_t n_keys, int64_t padded, float scale) {
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

/* Attention for nq queries q [nq, D] (already rotated) that share one kv head's keys: out[m] =
 * softmax(q[m] k^T * scale) v over the keys j < n_keys with vis[m][j]. Key j's row is kc + row_j *
 * stride (row_j = gather[j], or j when gather is NULL), likewise for v. Keys are visited in blocks of
 * KEY_BLOCK that stay in L1 while every pair of queries uses them; each query's result is bitwise
 * the same whichever queries share the call and however the keys are blocked (batch invariance).
 * scores: nq * padded floats of scratch, sums: nq. */
#define KEY_BLOCK 64
static void attend(const float *q, int64_t nq, const uint8_t *const *vis, float *const *out, const float *kc,
                   const float *vc, const int64_t *gather, int64_t stride, int64_t n_keys, int64_t D, float scale,
                   float *scores, float *sums, int64_t padded) {
#define ROW(base, j) ((base) + (gather ? gather[j] : (j)) * stride)
    for (int64_t j0 = 0; j0 < n_keys; j0 += KEY_BLOCK) { /* 1. scores of the visible keys */
        const int64_t j1 = j0 + KEY_BLOCK < n_keys ? j0 + KEY_BLOCK : n_keys;
        for (int64_t m = 0; m < nq; m += 2) {
            const int two = m + 1 < nq;
            float *s0 = scores + m * padded, *s1 = s0 + padded;
            int64_t j = j0;
#ifdef __AVX2__
            if (D % 8 == 0)
                for (; j + 4 <= j1; j += 4) {
                    if (!any4(vis[m] + j) && !(two && any4(vis[m + 1] + j))) continue; /* masked below */
                    const float *k[4] = {ROW(kc, j), ROW(kc, j + 1), ROW(kc, j + 2), ROW(kc, j + 3)};
                    if (two) dots_2x4(q + m * D, q + (m + 1) * D, k, D, s0 + j, s1 + j);
                    else dots_1x4(q + m * D, k, D, s0 + j);
                }
#endif
            for (; j < j1; j++) {
                if (vis[m][j]) s0[j] = dot(q + m * D, ROW(kc, j), D);
                if (two && vis[m + 1][j]) s1[j] = dot(q + (m + 1) * D, ROW(kc, j), D);
            }
        }
    }
    for (int64_t m = 0; m < nq; m++) { /* 2. softmax numerators in place, their sum in sums[m] */
        sums[m] = softmax_numerators(scores + m * padded, vis[m], n_keys, padded, scale);
        for (int64_t i = 0; i < D; i++) out[m][i] = 0.f;
    }
    for (int64_t j0 = 0; j0 < n_keys; j0 += KEY_BLOCK) { /* 3. the weighted values, block by block */
        const int64_t j1 = j0 + KEY_BLOCK < n_keys ? j0 + KEY_BLOCK : n_keys;
#ifdef __AVX2__
        if (D % 8 == 0) {
            for (int64_t m = 0; m < nq; m += 2) {
                const float *s0 = scores + m * padded, *s1 = m + 1 < nq ? s0 + padded : NULL;
                float *o1 = m + 1 < nq ? out[m + 1] : NULL;
                int64_t c = 0;
                for (; c + 32 <= D; c += 32) pv_chunk(s0, s1, vc, gather, stride, j0, j1, c, 4, out[m], o1);
                for (; c < D; c += 8) pv_chunk(s0, s1, vc, gather, stride, j0, j1, c, 1, out[m], o1);
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < nq; m++)
            for (int64_t j = j0; j < j1; j++)
                if (scores[m * padded + j] != 0.f) axpy(scores[m * padded + j], ROW(vc, j), out[m], D);
    }
    for (int64_t m = 0; m < nq; m++) {
        const float inv = 1.0f / sums[m];
        for (int64_t i = 0; i < D; i++) out[m][i] *= inv;
    }
#undef ROW
}

/* The queries that share one kv head's keys (a "set": every new token's group of query heads, of one
 * sequence) are split into work units of at most MAX_Q consecutive queries, and into two units at
 * least, so that both cores have work even at T = 1. */
#define MAX_Q 8

static int64_t units_per_set(int64_t n) {
    const int64_t u = (n + MAX_Q - 1) / MAX_Q;
    return n >= 2 && u < 2 ? 2 : u;
}

/* Writes new token t's rotated keys and its values at kc/vc + dst + h * head_stride. */
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

/* Queries lo..hi-1 of kv head g's set, whose first new token is row t0 of qkv and out (query i: token
 * t0 + i / group, head g * group + i % group): rotated into q, with their visibility rows (token
 * i / group's is vis_rows + (i / group) * vis_len) and output rows. Returns their number. */
static int64_t unit_queries(const float *qkv, const float *cos, const float *sin, const int64_t *pos, int64_t t0,
                            int64_t lo, int64_t hi, int64_t g, int64_t group, int64_t Hq, int64_t Hkv, int64_t D,
                            const uint8_t *vis_rows, int64_t vis_len, float *out, float *q, const uint8_t **vis,
                            float **outs) {
    const int64_t row = (Hq + 2 * Hkv) * D;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t t = t0 + i / group, h = g * group + i % group;
        rope(qkv + t * row + h * D, cos + pos[t] * D, sin + pos[t] * D, q + (i - lo) * D, D);
        vis[i - lo] = vis_rows + (i / group) * vis_len;
        outs[i - lo] = out + t * Hq * D + h * D;
    }
    return hi - lo;
}

/* Scratch of one thread: scores [MAX_Q, padded], rotated queries [MAX_Q, D], sums [MAX_Q]. */
static float *scratch(int64_t padded, int64_t D) {
    return malloc(sizeof(float) * MAX_Q * (padded + D + 1));
}

/* One attention call's work: B rows (B = 1 and gather == NULL: the static cache, vis rows [T, L];
 * else the paged pool, mask [B, T, L]) x Hkv kv heads x `units` units of queries, split in a static
 * schedule over the threads; each unit's result is independent of who computes it. */
typedef struct {
    const float *qkv, *cos, *sin;
    const int64_t *pos;
    const float *kc, *vc;
    const int64_t *new_slot, *gather;
    const uint8_t *vis; /* static: [T, L] visibility; paged: the [B, T, L] mask */
    float *out;
    int64_t B, T, L, Hq, Hkv, D, max_len, group, per_set, units, padded;
    float scale;
    _Atomic int failed;
} AttendJob;

static void attend_share(void *ctx, int64_t me, int64_t nth) {
    AttendJob *j = ctx;
    const int64_t total = j->B * j->Hkv * j->units, lo = total * me / nth, hi = total * (me + 1) / nth;
    if (lo >= hi) return;
    float *buf = scratch(j->padded, j->D);
    if (buf == NULL) {
        atomic_store(&j->failed, 1);
        return;
    }
    const int paged = j->gather != NULL;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / (j->Hkv * j->units), g = i / j->units % j->Hkv, u = i % j->units;
        const uint8_t *vis[MAX_Q];
        float *outs[MAX_Q], *q = buf + MAX_Q * j->padded;
        const int64_t nq = unit_queries(j->qkv, j->cos, j->sin, j->pos, b * j->T, u * j->per_set / j->units,
                                        (u + 1) * j->per_set / j->units, g, j->group, j->Hq, j->Hkv, j->D,
                                        j->vis + b * j->T * j->L, j->L, j->out, q, vis, outs);
        if (paged)
            attend(q, nq, vis, outs, j->kc + g * j->D, j->vc + g * j->D, j->gather + b * j->L, j->Hkv * j->D, j->L,
                   j->D, j->scale, buf, q + MAX_Q * j->D, j->padded);
        else
            attend(q, nq, vis, outs, j->kc + g * j->max_len * j->D, j->vc + g * j->max_len * j->D, NULL, j->D, j->L,
                   j->D, j->scale, buf, q + MAX_Q * j->D, j->padded);
    }
    free(buf);
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated. */
int specdec_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                          float *kc, float *vc, const uint8_t *mask, float *out,
                          int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past, int64_t max_len,
                          float scale) {
    const int64_t group = Hq / Hkv, n_keys = past + T, padded = (n_keys + 7) / 8 * 8;
    const int64_t per_set = T * group, units = units_per_set(per_set);
    /* 1. rotary on k, write k and v of the new tokens into the cache */
    for (int64_t t = 0; t < T; t++) write_kv(qkv, cos, sin, pos, kc, vc, t, Hq, Hkv, D, (past + t) * D, max_len * D);
    /* 2. which keys each new token sees: the whole prefix, then the new tokens its mask allows */
    uint8_t *vis_rows = malloc(T * n_keys);
    if (vis_rows == NULL) return -1;
    for (int64_t t = 0; t < T; t++) {
        memset(vis_rows + t * n_keys, 1, past);
        for (int64_t j = 0; j < T; j++) vis_rows[t * n_keys + past + j] = mask ? mask[t * T + j] : j <= t;
    }
    /* 3. softmax(q k^T * scale) v for every query, a unit of one kv head's queries at a time */
    AttendJob job = {qkv, cos, sin, pos, kc, vc, NULL, NULL, vis_rows, out, 1, T, n_keys, Hq, Hkv, D, max_len,
                     group, per_set, units, padded, scale, 0};
    specdec_parallel(attend_share, &job, Hq * T * n_keys * D > 200000 ? specdec_num_threads() : 1);
    free(vis_rows);
    return atomic_load(&job.failed) ? -1 : 0;
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
    const int64_t group = Hq / Hkv, padded = (L + 7) / 8 * 8, slot = Hkv * D;
    const int64_t per_set = T * group, units = units_per_set(per_set);
    for (int64_t bt = 0; bt < B * T; bt++)
        if (new_slot[bt] >= 0) write_kv(qkv, cos, sin, pos, kc, vc, bt, Hq, Hkv, D, new_slot[bt] * slot, D);
    AttendJob job = {qkv, cos, sin, pos, kc, vc, new_slot, gather, mask, out, B, T, L, Hq, Hkv, D, 0,
                     group, per_set, units, padded, scale, 0};
    specdec_parallel(attend_share, &job, B * Hq * T * L * D > 200000 ? specdec_num_threads() : 1);
    return atomic_load(&job.failed) ? -1 : 0;
}
