/* The descriptions layer.c, head_chain.c and head_tree.c share: a linear (Linear), a decoder layer's weights
 * (LayerWeights), a sequence's static cache (SeqCache) and a pass's shape (LayerShape); layer.c says what
 * each field means for its calls. Mirrored by ctypes structures in specdec/kernels/layer.py. */
#ifndef SPECDEC_LAYER_H
#define SPECDEC_LAYER_H
#include <stdint.h>

enum { LIN_F32 = 0, LIN_I8 = 1, LIN_I4 = 2, LIN_BF16 = 3, LIN_BF16_DOT = 4, LIN_BF16_TILES = 5 };

typedef struct {
    int64_t kind;                  /* LIN_F32, LIN_I8, LIN_I4, LIN_BF16, LIN_BF16_DOT (inputs rounded to bf16) or
                                      LIN_BF16_TILES (the same on AMX) */
    const void *weight;            /* fp32 or bf16 [N, K], bf16 packed as AMX tiles, or the packed integers */
    const uint16_t *scales, *zeros; /* fp16 [N, K / G] (packed kinds; zeros may be NULL for int8) */
    const float *bias;             /* [N] or NULL */
    int64_t N, K, G;
} Linear;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    Linear qkv, o_proj, gate_up, down;
    void *k_cache, *v_cache;             /* [Hkv, max_len, D] (paged: the pool's [num_slots, Hkv, D] layer),
                                            fp32 or bfloat16 (LayerShape.kv_bf16) */
} LayerWeights;

typedef struct {
    void *k_cache, *v_cache; /* a sequence's static cache, [Hkv, max_len, D], of LayerShape.kv_bf16's type */
    int64_t past, count, max_len; /* keys already there; its rows of x (their keys go after them) */
} SeqCache;

typedef struct {
    const float *cos, *sin; /* [max_pos, D] */
    const int64_t *pos;     /* [T], paged: [B, T] */
    const uint8_t *mask;    /* [T, T] or NULL (causal), paged: [B, T, L] */
    int64_t T, H, Hq, Hkv, D, past, max_len;
    float eps, scale;
    int64_t B, L;                     /* paged rows and gathered keys per row; B = 0: static cache */
    const int64_t *new_slot, *gather; /* paged: [B, T] pool slot of each new token (-1: padding), [B, L] */
    int64_t num_real;                 /* paged, packed: rows of x (0: x is the whole grid) */
    const int64_t *real_index;        /* [num_real] ascending places in the [B * T] grid */
    const int64_t *tail_start, *tail_path; /* a tree's root paths (attention.c) or NULL */
    int64_t tail_width;
    int64_t num_seqs;       /* > 0: x's T rows are these sequences' rows back to back, each over its own */
    const SeqCache *seqs;   /* static cache, causal among its rows (a draft head's rows), or, one sequence
                               with mask and tails set, a tree; B = 0 */
    int64_t kv_bf16;        /* the caches hold bfloat16 (--kv-cache-dtype bfloat16), else fp32 */
} LayerShape;

/* y [T, N] = x [T, K] @ W^T (+ bias) through the kernel the Linear names (layer.c): 0, or -1 when a packed
 * kind cannot allocate its quantized activations */
int specdec_layer_linear(const Linear *l, const float *x, float *y, int64_t T);
/* A draft head's layer over the rows of s->num_seqs sequences (layer.c) */
int specdec_head_layer_f32(float *x, const float *attn_in, const LayerWeights *w, const LayerShape *s);
void specdec_rmsnorm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps);
int specdec_topk_f32(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *idx);
#endif
