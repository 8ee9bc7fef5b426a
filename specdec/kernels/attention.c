/* Decode-shaped attention for one sequence in a static KV cache, fp32: rotary embedding, the KV
 * write and attention over the cached prefix plus T new tokens, in one call per layer. The cache holds
 * fp32 or, with kv_bf16, bfloat16 (--kv-cache-dtype bfloat16: half the bytes a pass reads from it); a
 * bf16 cache gets each new key and value rounded once, here, and is read back widened (attention_kv.h).
 *
 * For T <= 64 new tokens (MAX_ROWS) the work is small and a chain of ~25 torch ops per layer (split, views,
 * rotary, cache slices, SDPA, transposes) costs more in dispatch than in arithmetic; here it is
 * one loop nest. The queries that read the same kv head (its group of query heads, at every new
 * token) share each key and value load, two at a time, over key blocks that stay in L1. Keys go in
 * fixed splits of KEY_SPLIT columns whose partial softmaxes are folded in ascending order, so both
 * cores share a long context's keys (flash-decoding's split-K, with a fixed order). Every query row
 * is the same sequence of operations whatever shares its loads (each score one dot product with a
 * fixed reduction tree, a split's softmax sum over aligned 8-lane chunks, each output element one FMA
 * chain over the split's keys, ascending, the splits folded in order), so a verify pass over k+1
 * tokens gives bitwise the same rows as k+1 single-token passes (batch invariance, as gemv.c). A tree
 * row reads its keys by position (tail_path below), so it equals the single-token passes over its root path.
 * SmolLM2-135M, 30 layers of attention after 1024 cached tokens (2-vCPU AMD EPYC Zen 4, the kernels
 * before and after interleaved in one process, medians of 25): T = 1 / 5 / 8 / 16 new tokens
 * 3.42 / 6.49 / 9.61 / 15.18 ms unsplit, 2.66 / 5.06 / 7.17 / 12.43 ms split.
 *
 * qkv:   [T, (Hq + 2 Hkv) * D]  the fused projection (q heads, then k heads, then v heads)
 * cos, sin: [max_pos, D]        tables; sin has its first half negated (rotate_half layout)
 * pos:   [T]                     positions of the new tokens
 * kc, vc: [Hkv, max_len, D]      this layer's cache (fp32, or bf16 where kv_bf16); new k/v are written at
 *                                [past, past + T)
 * mask:  [T, T] uint8 or NULL    which new tokens each new token sees (NULL: causal)
 * out:   [T, Hq * D]             attention output, heads concatenated (o_proj's input layout)
 * tail_start, tail_path: NULL, or a tree pass's root paths (Remap in attention_split.h): new token t
 *        reads its virtual column c >= tail_start[t] at column tail_path[t, c - tail_start[t]] (c - start <
 *        tail_width), and mask row t is then its root path laid out by depth (columns of its ancestors).
 *        A tree row is then bitwise the single-token pass at its position (specdec.spec.tree.root_path_columns).
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

#include "attention_split.h"

/* attend_split_f32 and attend_split_bf16: attention_split.h's split over an fp32 or a bfloat16 cache */
#define KV float
#define KV_BF16 0
#define KVN(f) f##_f32
#include "attention_kv.h"
#undef KV
#undef KV_BF16
#undef KVN
#define KV uint16_t
#define KV_BF16 1
#define KVN(f) f##_bf16
#include "attention_kv.h"
#undef KV
#undef KV_BF16
#undef KVN

/* x rounded to bfloat16 (nearest, ties to even; a NaN stays a NaN), as torch's float -> bfloat16 */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The queries that share one kv head's keys (a "set": every new token's group of query heads, of one
 * sequence) are split into work units of at most MAX_Q consecutive queries; with one key split, into two
 * units at least, so that both cores have work even at T = 1 (with more, the splits give them work). */
#define MAX_Q 8

static int64_t units_per_set(int64_t n, int64_t nsplits) {
    const int64_t u = (n + MAX_Q - 1) / MAX_Q;
    return nsplits == 1 && n >= 2 && u < 2 ? 2 : u;
}

/* Writes new token t's rotated keys and its values at kc/vc + dst + h * head_stride (elements: fp32, or
 * rounded to bfloat16 where kv_bf16). */
static void write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *pos, void *kc, void *vc,
                     int kv_bf16, int64_t t, int64_t Hq, int64_t Hkv, int64_t D, int64_t dst, int64_t head_stride) {
    const int64_t row = (Hq + 2 * Hkv) * D;
    const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
    float rotated[D];
    for (int64_t h = 0; h < Hkv; h++) {
        const float *k = qkv + t * row + (Hq + h) * D, *v = qkv + t * row + (Hq + Hkv + h) * D;
        const int64_t at = dst + h * head_stride;
        if (!kv_bf16) {
            rope(k, c, s, (float *)kc + at, D);
            memcpy((float *)vc + at, v, sizeof(float) * D);
            continue;
        }
        rope(k, c, s, rotated, D);
        for (int64_t i = 0; i < D; i++) {
            ((uint16_t *)kc)[at + i] = to_bf16(rotated[i]);
            ((uint16_t *)vc)[at + i] = to_bf16(v[i]);
        }
    }
}

/* Queries lo..hi-1 of kv head g's set, whose first new token is row t0 of qkv and out (query i: token
 * t0 + i / group, head g * group + i % group): rotated into q, with their visibility rows (token
 * i / group's is vis_rows + (i / group) * vis_len) and output rows. Returns their number. */
static int64_t unit_queries(const float *qkv, const float *cos, const float *sin, const int64_t *pos, int64_t t0,
                            int64_t lo, int64_t hi, int64_t g, int64_t group, int64_t Hq, int64_t Hkv, int64_t D,
                            const uint8_t *vis_rows, int64_t vis_len, float *out, float *q, const uint8_t **vis,
                            float **outs, int64_t *tokens) {
    const int64_t row = (Hq + 2 * Hkv) * D;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t t = t0 + i / group, h = g * group + i % group;
        rope(qkv + t * row + h * D, cos + pos[t] * D, sin + pos[t] * D, q + (i - lo) * D, D);
        vis[i - lo] = vis_rows + (i / group) * vis_len;
        outs[i - lo] = out + t * Hq * D + h * D;
        tokens[i - lo] = t;
    }
    return hi - lo;
}

/* The queries' remaps (NULL: none) from the tokens' tail_start / tail_path rows; L: no remap. */
static void unit_remaps(const int64_t *tail_start, const int64_t *tail_path, int64_t width, int64_t L,
                        const int64_t *tokens, int64_t nq, Remap *rms, const Remap **rm) {
    for (int64_t m = 0; m < nq; m++) {
        const int64_t t = tokens[m];
        rm[m] = NULL;
        if (tail_start != NULL && tail_start[t] < L) {
            rms[m] = (Remap){tail_start[t], width, tail_path + t * width};
            rm[m] = &rms[m];
        }
    }
}

/* One attention call's work: B rows (B = 1 and gather == NULL: the static cache, vis rows [T, L];
 * else the paged pool, mask [B, T, L]) x Hkv kv heads x nsplits key splits x `units` units of queries,
 * split in a static schedule over the threads (a unit's splits of one head next to each other, so the
 * units share the split's keys in cache). With several splits each item leaves its queries' partials in
 * `parts` ([B T Hq, nsplits, PART(D)]), and whoever finishes a unit's last split folds them (remaining:
 * per unit, the splits still to come); each query's result is independent of who computes what. */
typedef struct {
    const float *qkv, *cos, *sin;
    const int64_t *pos;
    const void *kc, *vc; /* fp32, or bfloat16 where kv_bf16 */
    const int64_t *new_slot, *gather;
    const int64_t *tail_start, *tail_path; /* [B T], [B T, tail_width] or NULL */
    const uint8_t *vis; /* static: [T, L] visibility; paged: the [B, T, L] mask */
    float *out, *parts;
    _Atomic int64_t *remaining;
    int64_t B, T, L, Hq, Hkv, D, max_len, group, per_set, units, nsplits, tail_width, kv_bf16;
    float scale;
    _Atomic int failed;
} AttendJob;

static void attend_share(void *ctx, int64_t me, int64_t nth) {
    AttendJob *j = ctx;
    const int64_t per_head = j->nsplits * j->units, total = j->B * j->Hkv * per_head;
    const int64_t lo = total * me / nth, hi = total * (me + 1) / nth, D = j->D;
    if (lo >= hi) return;
    /* scratch: scores [MAX_Q, KEY_SPLIT], rotated queries [MAX_Q, D], one split's partials [MAX_Q, PART(D)] */
    float *buf = malloc(sizeof(float) * MAX_Q * (KEY_SPLIT + D + PART(D)));
    if (buf == NULL) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *q = buf + MAX_Q * KEY_SPLIT, *local = q + MAX_Q * D;
    const int paged = j->gather != NULL;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / (j->Hkv * per_head), g = i / per_head % j->Hkv, s = i / j->units % j->nsplits;
        const int64_t u = i % j->units, unit = (b * j->Hkv + g) * j->units + u;
        const uint8_t *vis[MAX_Q];
        float *outs[MAX_Q], *part[MAX_Q];
        int64_t tokens[MAX_Q];
        Remap rms[MAX_Q];
        const Remap *rm[MAX_Q];
        const int64_t nq = unit_queries(j->qkv, j->cos, j->sin, j->pos, b * j->T, u * j->per_set / j->units,
                                        (u + 1) * j->per_set / j->units, g, j->group, j->Hq, j->Hkv, D,
                                        j->vis + b * j->T * j->L, j->L, j->out, q, vis, outs, tokens);
        unit_remaps(j->tail_start, j->tail_path, j->tail_width, j->L, tokens, nq, rms, rm);
        for (int64_t m = 0; m < nq; m++) /* query row r = (outs[m] - out) / D: its partials */
            part[m] = j->nsplits == 1 ? local + m * PART(D) : j->parts + ((outs[m] - j->out) / D * j->nsplits + s) * PART(D);
        const int64_t j0 = s * KEY_SPLIT, j1 = j0 + KEY_SPLIT < j->L ? j0 + KEY_SPLIT : j->L;
        /* kv head g's keys: the pool's slots hold every head ([slot, Hkv, D]), the static cache one head's rows */
        const int64_t head = paged ? g * D : g * j->max_len * D, stride = paged ? j->Hkv * D : D;
        const int64_t *gather = paged ? j->gather + b * j->L : NULL;
        if (j->kv_bf16)
            attend_split_bf16(q, nq, vis, part, (const uint16_t *)j->kc + head, (const uint16_t *)j->vc + head, gather,
                              rm, stride, j0, j1, D, j->scale, buf);
        else
            attend_split_f32(q, nq, vis, part, (const float *)j->kc + head, (const float *)j->vc + head, gather, rm,
                             stride, j0, j1, D, j->scale, buf);
        if (j->nsplits > 1 && atomic_fetch_sub_explicit(&j->remaining[unit], 1, memory_order_acq_rel) != 1)
            continue; /* another split of this unit is still to come: its finisher folds */
        for (int64_t m = 0; m < nq; m++)
            fold(j->nsplits == 1 ? part[m] : part[m] - s * PART(D), j->nsplits, D, outs[m]);
    }
    free(buf);
}

/* Runs the job over the threads; with several key splits, with the partials' and counters' memory.
 * Returns 0, or -1 when memory cannot be allocated. */
static int run_job(AttendJob *job, int64_t work) {
    const int64_t units = job->B * job->Hkv * job->units;
    /* the caller's buffers, kept between calls (a fresh malloc this size is an mmap: page faults every layer) */
    static __thread void *parts = NULL, *remaining = NULL;
    static __thread int64_t parts_size = 0, remaining_size = 0;
    if (job->nsplits > 1) {
        job->parts = grow_buffer(&parts, &parts_size, sizeof(float) * job->B * job->T * job->Hq * job->nsplits * PART(job->D));
        job->remaining = grow_buffer(&remaining, &remaining_size, sizeof(*job->remaining) * units);
        if (job->parts == NULL || job->remaining == NULL) return -1;
        for (int64_t i = 0; i < units; i++) atomic_init(&job->remaining[i], job->nsplits);
    }
    specdec_parallel(attend_share, job, work > 200000 ? specdec_num_threads() : 1);
    return atomic_load(&job->failed) ? -1 : 0;
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated. */
int specdec_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                          void *kc, void *vc, const uint8_t *mask, float *out,
                          int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past, int64_t max_len,
                          float scale, const int64_t *tail_start, const int64_t *tail_path, int64_t tail_width,
                          int64_t kv_bf16) {
    const int64_t group = Hq / Hkv, n_keys = past + T, nsplits = (n_keys + KEY_SPLIT - 1) / KEY_SPLIT;
    const int64_t per_set = T * group, units = units_per_set(per_set, nsplits);
    /* 1. rotary on k, write k and v of the new tokens into the cache */
    for (int64_t t = 0; t < T; t++) write_kv(qkv, cos, sin, pos, kc, vc, kv_bf16, t, Hq, Hkv, D, (past + t) * D, max_len * D);
    /* 2. which keys each new token sees: the whole prefix, then the new tokens its mask allows */
    uint8_t *vis_rows = malloc(T * n_keys);
    if (vis_rows == NULL) return -1;
    for (int64_t t = 0; t < T; t++) {
        memset(vis_rows + t * n_keys, 1, past);
        for (int64_t j = 0; j < T; j++) vis_rows[t * n_keys + past + j] = mask ? mask[t * T + j] : j <= t;
    }
    /* 3. softmax(q k^T * scale) v for every query, a unit of one kv head's queries at a time */
    AttendJob job = {qkv, cos, sin, pos, kc, vc, NULL, NULL, tail_start, tail_path, vis_rows, out, NULL, NULL, 1, T,
                     n_keys, Hq, Hkv, D, max_len, group, per_set, units, nsplits, tail_width, kv_bf16, scale, 0};
    const int rc = run_job(&job, Hq * T * n_keys * D);
    free(vis_rows);
    return rc;
}

/* The same attention for a batch of sequences in the paged pool (the serving engine's BatchKV):
 * B rows left-padded to T new tokens, L key columns per row.
 *
 * kc, vc:   [num_slots, Hkv, D]  this layer's pool (fp32, or bf16 where kv_bf16); the key column j of row b
 *                                lives at slot gather[b, j]
 * new_slot: [B, T]               where column t's new k/v is written (-1: a padding column)
 * pos:      [B, T]               positions of the new tokens (rotary)
 * mask:     [B, T, L] uint8      which key columns each query column sees (chain, tree or padding)
 * out:      [B, T, Hq * D]
 * tail_start, tail_path: NULL or [B, T], [B, T, tail_width]: trees' root paths, as above (absolute columns)
 * A row's value depends only on its own keys, visited in column order with the same dot products
 * and aligned-8 exponentials as above, so it does not depend on B, T, L or the other rows. */
int specdec_paged_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                                void *kc, void *vc, const int64_t *new_slot, const int64_t *gather,
                                const uint8_t *mask, float *out, int64_t B, int64_t T, int64_t L, int64_t Hq,
                                int64_t Hkv, int64_t D, float scale, const int64_t *tail_start,
                                const int64_t *tail_path, int64_t tail_width, int64_t kv_bf16) {
    const int64_t group = Hq / Hkv, nsplits = (L + KEY_SPLIT - 1) / KEY_SPLIT, slot = Hkv * D;
    const int64_t per_set = T * group, units = units_per_set(per_set, nsplits);
    for (int64_t bt = 0; bt < B * T; bt++)
        if (new_slot[bt] >= 0) write_kv(qkv, cos, sin, pos, kc, vc, kv_bf16, bt, Hq, Hkv, D, new_slot[bt] * slot, D);
    AttendJob job = {qkv, cos, sin, pos, kc, vc, new_slot, gather, tail_start, tail_path, mask, out, NULL, NULL, B, T,
                     L, Hq, Hkv, D, 0, group, per_set, units, nsplits, tail_width, kv_bf16, scale, 0};
    return run_job(&job, B * Hq * T * L * D);
}
