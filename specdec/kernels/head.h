/* What head_chain.c and head_tree.c share: an EAGLE-3 head's drafting weights (ChainHead, mirrored by
 * _ChainHead in specdec/kernels/layer.py), an embedding row widened to fp32, and the head layer's input. */
#ifndef SPECDEC_HEAD_H
#define SPECDEC_HEAD_H
#include <stdint.h>
#include <string.h>
#include "layer.h"

typedef struct {
    const float *norm;                      /* the head's final norm [H] */
    Linear lm_head;                         /* [Vd, H] */
    const int64_t *draft_ids;               /* [Vd] the target id of each draft id */
    const void *embed;                      /* the target's embedding [vocab, H]: fp32, or bf16 (embed_bf16) */
    int64_t embed_bf16, vocab;
    const float *input_norm, *hidden_norm;  /* the layer's norms of the embedding and of g [H] */
    float eps;                              /* the three norms' */
} ChainHead;

#define MAX_CHAIN_ROWS 64

/* Row `token` of the embedding, widened to fp32 (exact, as the table's rows() does) */
static inline void embed_row(const ChainHead *c, int64_t token, int64_t H, float *out) {
    if (!c->embed_bf16) {
        memcpy(out, (const float *)c->embed + token * H, sizeof(float) * H);
        return;
    }
    const uint16_t *row = (const uint16_t *)c->embed + token * H;
    for (int64_t i = 0; i < H; i++) {
        union { uint32_t u; float f; } v = {.u = (uint32_t)row[i] << 16};
        out[i] = v.f;
    }
}

/* attn_in [n, 2H] = [input_norm(emb); hidden_norm(h)] row by row: the head layer's projections' input */
static inline void layer_inputs(const ChainHead *c, const float *emb, const float *h, float *attn_in, int64_t n, int64_t H) {
    for (int64_t i = 0; i < n; i++) {
        specdec_rmsnorm_f32(emb + i * H, c->input_norm, attn_in + i * 2 * H, 1, H, c->eps);
        specdec_rmsnorm_f32(h + i * H, c->hidden_norm, attn_in + i * 2 * H + H, 1, H, c->eps);
    }
}

/* logits [n, Vd] = lm_head(norm(g)) for the n rows of g [n, H] (normed [n, H]: scratch): the head's drafting
 * distribution, before its argmax or log-softmax. 0, or -1 (layer.c's linear) */
static inline int head_logits(const ChainHead *c, const float *g, int64_t n, int64_t H, float *normed, float *logits) {
    specdec_rmsnorm_f32(g, c->norm, normed, n, H, c->eps);
    return specdec_layer_linear(&c->lm_head, normed, logits, n);
}

#endif
