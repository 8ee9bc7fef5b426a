/* One Llama decoder layer for decoding on CPUs, in one call: the same kernels as the per-op path
 * (gemv.c, qgemv.c, attention.c, linked into the same library), in the same order, so the result
 * is bitwise the same; what goes away is ~12 Python/torch dispatches per layer (about a fifth of
 * a decode step on the 135M default model, where a whole layer's matmuls take ~1 ms).
 *
 *     x += o_proj(attention(rotary(qkv(rms_norm(x)))))
 *     x += down(silu(gate) * up),  gate|up = gate_up(rms_norm(x))
 *
 * x: [T, H] fp32, updated in place; T <= 64 new tokens of one sequence in a static fp32 cache, or
 * (B > 0) the serving engine's B left-padded rows of T tokens over the paged pool, B * T <= 64 (packed:
 * num_real <= 64 real tokens, the grid up to the attention kernel's PAGED_ROWS), whose
 * attention is specdec_paged_attention_f32 (k_cache, v_cache: the pool's [num_slots, Hkv, D] layer).
 * Packed (num_real > 0): x holds only the batch's num_real real tokens, [num_real, H], real_index[i]
 * being token i's place b * T + t in the padded grid; every linear runs on those rows alone and only
 * attention sees the grid (q/k/v scattered into it, its output gathered back), so a row drafting 5
 * tokens beside rows drafting none costs 5 rows, not 5 x B of padding.
 * Each linear is described by a `Linear` (fp32 or bf16 matrix, see gemv.c and bf16dot.c, or a packed int8/int4
 * one, see qgemv.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "layer.h"

void specdec_linear_f32(const float *x, const float *W, const float *bias, float *y, int64_t T, int64_t K, int64_t N);
void specdec_linear_bf16(const float *x, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K, int64_t N);
int specdec_linear_bf16_dot(const float *x, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K, int64_t N);
int specdec_linear_bf16_tiles(const float *x, const uint16_t *Wp, const float *bias, float *y, int64_t T, int64_t K, int64_t N);
int specdec_qlinear_i8(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                        const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G);
int specdec_qlinear_i4(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                       const float *bias, float *y, int64_t T, int64_t K, int64_t N, int64_t G);
int specdec_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                          void *kc, void *vc, const uint8_t *mask, float *out, int64_t T, int64_t Hq,
                          int64_t Hkv, int64_t D, int64_t past, int64_t max_len, float scale,
                          const int64_t *tail_start, const int64_t *tail_path, int64_t tail_width, int64_t kv_bf16);
int specdec_paged_attention_f32(const float *qkv, const float *cos, const float *sin, const int64_t *pos,
                                void *kc, void *vc, const int64_t *new_slot, const int64_t *gather,
                                const uint8_t *mask, float *out, int64_t B, int64_t T, int64_t L, int64_t Hq,
                                int64_t Hkv, int64_t D, float scale, const int64_t *tail_start,
                                const int64_t *tail_path, int64_t tail_width, int64_t kv_bf16);
void specdec_silu_mul_f32(const float *gu, float *y, int64_t T, int64_t I);

/* 0, or -1 when a packed kind cannot allocate its quantized activations */
static int apply(const Linear *l, const float *x, float *y, int64_t T) {
    if (l->kind == LIN_F32) {
        specdec_linear_f32(x, (const float *)l->weight, l->bias, y, T, l->K, l->N);
        return 0;
    }
    if (l->kind == LIN_BF16) {
        specdec_linear_bf16(x, (const uint16_t *)l->weight, l->bias, y, T, l->K, l->N);
        return 0;
    }
    if (l->kind == LIN_BF16_DOT) return specdec_linear_bf16_dot(x, (const uint16_t *)l->weight, l->bias, y, T, l->K, l->N);
    if (l->kind == LIN_BF16_TILES) return specdec_linear_bf16_tiles(x, (const uint16_t *)l->weight, l->bias, y, T, l->K, l->N);
    if (l->kind == LIN_I8) return specdec_qlinear_i8(x, l->weight, l->scales, l->zeros, l->bias, y, T, l->K, l->N, l->G);
    return specdec_qlinear_i4(x, l->weight, l->scales, l->zeros, l->bias, y, T, l->K, l->N, l->G);
}

int specdec_layer_linear(const Linear *l, const float *x, float *y, int64_t T) { return apply(l, x, y, T); }

/* x[i] = x[i] + y[i]: the residual, as torch adds two fp32 tensors */
static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

/* The calling thread's scratch for one layer: 64-byte aligned, so the linears' input rows (whole
 * multiples of 16 floats on these models) never straddle cache lines (with malloc's 16-byte alignment
 * most vector loads of an input did, and a verify pass re-reads its inputs once per weight row); grown
 * as needed and kept, instead of a fresh block per layer (a verify pass's, T = 8: 184 KB, is above
 * glibc's mmap threshold: new zeroed pages every layer). NULL if it cannot grow. */
static float *layer_buffer(int64_t floats) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    return grow_buffer(&buf, &size, (int64_t)sizeof(float) * floats);
}

/* 0 on success, -1 when a buffer cannot be allocated (x is then unchanged or partly updated:
 * the caller raises, and the cache length is not advanced). */
static int attention(const float *qkv, const LayerWeights *w, const LayerShape *s, float *out) {
    if (s->B > 0)
        return specdec_paged_attention_f32(qkv, s->cos, s->sin, s->pos, w->k_cache, w->v_cache, s->new_slot,
                                           s->gather, s->mask, out, s->B, s->T, s->L, s->Hq, s->Hkv, s->D,
                                           s->scale, s->tail_start, s->tail_path, s->tail_width, s->kv_bf16);
    return specdec_attention_f32(qkv, s->cos, s->sin, s->pos, w->k_cache, w->v_cache, s->mask, out, s->T, s->Hq,
                                 s->Hkv, s->D, s->past, s->max_len, s->scale, s->tail_start, s->tail_path,
                                 s->tail_width, s->kv_bf16);
}

/* Packed rows: the [num_real, n] rows `real` into their places of the [grid, n] `padded`, whose padding
 * rows are zeroed (a padding query then attends to key 0 with finite scores; its output is dropped). */
static void scatter_rows(const float *real, float *padded, const int64_t *index, int64_t num_real, int64_t grid,
                         int64_t n) {
    int64_t next = 0; /* the first grid row not yet written */
    for (int64_t i = 0; i <= num_real; i++) {
        const int64_t at = i < num_real ? index[i] : grid;
        if (at > next) memset(padded + next * n, 0, sizeof(float) * (at - next) * n);
        if (i < num_real) memcpy(padded + at * n, real + i * n, sizeof(float) * n);
        next = at + 1;
    }
}

static void gather_rows(const float *padded, float *real, const int64_t *index, int64_t num_real, int64_t n) {
    for (int64_t i = 0; i < num_real; i++) memcpy(real + i * n, padded + index[i] * n, sizeof(float) * n);
}

/* Attention of each sequence's rows over its own cache (num_seqs > 0): a row's result is the one it
 * gets alone (attention.c computes every query the same whatever comes with it). One sequence may be a
 * token tree (s->mask set: an EAGLE-2 draft block), its rows reading their root paths as a verify pass's. */
static int attention_seqs(const float *qkv, const LayerWeights *w, const LayerShape *s, float *out) {
    const int64_t qkv_n = w->qkv.N, out_n = s->Hq * s->D;
    const int tree = s->num_seqs == 1 && s->mask != NULL;
    int64_t row = 0;
    for (int64_t i = 0; i < s->num_seqs; i++) {
        const SeqCache *c = &s->seqs[i];
        const int rc = specdec_attention_f32(qkv + row * qkv_n, s->cos, s->sin, s->pos + row, c->k_cache, c->v_cache,
                                             tree ? s->mask : NULL, out + row * out_n, c->count, s->Hq, s->Hkv, s->D,
                                             c->past, c->max_len, s->scale, tree ? s->tail_start : NULL,
                                             tree ? s->tail_path : NULL, tree ? s->tail_width : 0, s->kv_bf16);
        if (rc != 0) return rc;
        row += c->count;
    }
    return 0;
}

/* Attention over x's rows: through the grid when packed (q/k/v in, the output back out; `grid_buf`
 * holds [grid, qkv_n] then [grid, Hq D]), else directly. */
static int attention_rows(const float *qkv, const LayerWeights *w, const LayerShape *s, float *out, float *grid_buf) {
    if (s->num_seqs > 0) return attention_seqs(qkv, w, s, out);
    if (s->num_real <= 0) return attention(qkv, w, s, out);
    const int64_t grid = s->B * s->T, qkv_n = w->qkv.N, out_n = s->Hq * s->D;
    float *grid_qkv = grid_buf, *grid_out = grid_buf + grid * qkv_n;
    scatter_rows(qkv, grid_qkv, s->real_index, s->num_real, grid, qkv_n);
    const int rc = attention(grid_qkv, w, s, grid_out);
    if (rc == 0) gather_rows(grid_out, out, s->real_index, s->num_real, out_n);
    return rc;
}

/* The layer with attn_in [T, qkv K] as the projections' input: rms_norm(x) (attn_in NULL), or the
 * caller's (an EAGLE-3 head's [norm(embedding); norm(hidden)], 2H wide, x being the hidden state). */
static int layer_body(float *x, const float *attn_in, const LayerWeights *w, const LayerShape *s) {
    const int64_t grid = s->B > 0 ? s->B * s->T : s->T;
    const int64_t T = s->num_real > 0 ? s->num_real : grid, H = s->H, I = w->down.K; /* T: rows of x */
    const int64_t widest = w->qkv.N > w->gate_up.N ? w->qkv.N : w->gate_up.N;
    /* normed x [T, H] | projection out [T, widest] | attention or silu out [T, max(Hq D, I)] | [T, H]
     * | packed: the grid's q/k/v [grid, qkv N] and attention output [grid, Hq D] */
    const int64_t mid = s->Hq * s->D > I ? s->Hq * s->D : I;
    const int64_t grid_floats = s->num_real > 0 ? grid * (w->qkv.N + s->Hq * s->D) : 0;
    float *buf = layer_buffer(T * (H + widest + mid + H) + grid_floats);
    if (buf == NULL) return -1;
    float *normed = buf, *proj = normed + T * H, *act = proj + T * widest, *delta = act + T * mid;

    int rc = 0;
    if (attn_in == NULL) {
        specdec_rmsnorm_f32(x, w->input_norm, normed, T, H, s->eps);
        attn_in = normed;
    }
    rc = apply(&w->qkv, attn_in, proj, T);
    if (rc == 0) rc = attention_rows(proj, w, s, act, delta + T * H);
    if (rc == 0) rc = apply(&w->o_proj, act, delta, T);
    if (rc == 0) {
        add_into(x, delta, T * H);
        specdec_rmsnorm_f32(x, w->post_norm, normed, T, H, s->eps);
        rc = apply(&w->gate_up, normed, proj, T);
    }
    if (rc == 0) {
        specdec_silu_mul_f32(proj, act, T, I);
        rc = apply(&w->down, act, delta, T);
    }
    if (rc == 0) add_into(x, delta, T * H);
    return rc;
}

int specdec_decoder_layer_f32(float *x, const LayerWeights *w, const LayerShape *s) {
    return layer_body(x, NULL, w, s);
}

/* A draft head's layer (proposers/heads.py): x [T, H] the residual, attn_in [T, qkv K] the attention's
 * input, the rows of s->num_seqs sequences, each in its own static cache. Same return as
 * specdec_decoder_layer_f32; -2 for a shape it does not take. */
int specdec_head_layer_f32(float *x, const float *attn_in, const LayerWeights *w, const LayerShape *s) {
    return s->B > 0 || s->num_seqs <= 0 ? -2 : layer_body(x, attn_in, w, s);
}

/* Layers one after another in one call (the Python loop around specdec_decoder_layer_f32 cost ~0.1 ms
 * a layer on the 135M model, a tenth of a decode step): 0, or the first layer's nonzero return.
 * saves: NULL, or n pointers (NULL: not kept) where x [T, H] is copied after that layer (the hidden
 * states an EAGLE head reads: kept in the same call, not by cutting the stack into several). */
int specdec_decoder_layers_f32(float *x, LayerWeights *const *layers, int64_t n, const LayerShape *s,
                               float *const *saves) {
    const int64_t rows = s->num_real > 0 ? s->num_real : s->B > 0 ? s->B * s->T : s->T;
    for (int64_t i = 0; i < n; i++) {
        const int rc = specdec_decoder_layer_f32(x, layers[i], s);
        if (rc != 0) return rc;
        if (saves != NULL && saves[i] != NULL) memcpy(saves[i], x, sizeof(float) * rows * s->H);
    }
    return 0;
}

int specdec_layer_abi(void) { return 9; }
