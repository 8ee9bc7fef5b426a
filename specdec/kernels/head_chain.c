/* An EAGLE-3 head's greedy chains for several rows in one call: what proposers/eagle.py's _greedy_chains
 * does in Python (the serving engine's rows together, the offline decoder's one row), per depth
 *
 *     token = draft_ids[argmax(lm_head(norm(g)))]                      every row still drafting
 *     g     = layer([input_norm(embed(token)); hidden_norm(g)], g)     the rows drafting another token
 *
 * through the same kernels in the same order (rows.c, the Linear's kernel, topk.c, layer.c's head layer),
 * so the tokens, and the keys and values the rows leave in their caches, are bitwise the loop's. What goes
 * away is the loop's ~40 Python and torch dispatches a depth: 4 rows drafting 3 tokens each took 1.77 ms in
 * the loop, 1.05 here (bf16 on AMX tiles, 2 vCPUs). The digest of the rows accepted since the last draft
 * (specdec_head_digest_f32), which a step runs before its chains, likewise. */
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "layer.h"
#include "head.h"

/* The rows the target accepted since each sequence last drafted, through the head (eagle.py's _commit):
 *     x = layer([input_norm(embed(token)); hidden_norm(h)], h),  h = fc(features)
 * feats [N, F] and tokens [N] the sequences' rows back to back (s->seqs[i].count of sequence i, after its
 * cache's past rows; s->pos [N] their positions); x [N, H] out. Same return as specdec_head_layer_f32. */
int specdec_head_digest_f32(const float *feats, const int64_t *tokens, const Linear *fc, const ChainHead *c,
                            const LayerWeights *w, const LayerShape *s, float *x) {
    const int64_t N = s->T, H = s->H;
    if (N <= 0 || N > MAX_CHAIN_ROWS || fc->N != H || s->B != 0) return -2;
    for (int64_t i = 0; i < N; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab) return -2;
    float *buf = malloc(sizeof(float) * (size_t)(N * H + 2 * N * H));
    if (buf == NULL) return -1;
    float *emb = buf, *attn_in = emb + N * H;
    int rc = specdec_layer_linear(fc, feats, x, N); /* h: the residual */
    if (rc == 0) {
        for (int64_t i = 0; i < N; i++) embed_row(c, tokens[i], H, emb + i * H);
        layer_inputs(c, emb, x, attn_in, N, H);
        rc = specdec_head_layer_f32(x, attn_in, w, s);
    }
    free(buf);
    return rc;
}

/* g [B, H]: row b's head output after its committed rows, the start of its chain (overwritten). s: the head
 * layer's shape, s->num_seqs = B and s->seqs[b] row b's cache (past: its committed rows; count unused);
 * pos0[b]: the position of row b's first forward (its committed rows' offset + count); ks[b] >= 1 tokens to
 * draft, kmax = max ks; tokens [B, kmax] out (row b's first ks[b]). Returns 0; -1 out of memory; -2 a shape
 * this does not take; -3 logits topk.c does not answer (a NaN): the caller drafts its own way. */
int specdec_head_chains_f32(float *g, const ChainHead *c, const LayerWeights *w, const LayerShape *s0,
                            const int64_t *pos0, const int64_t *ks, int64_t kmax, int64_t *tokens) {
    const int64_t B = s0->num_seqs, H = s0->H, Vd = c->lm_head.N;
    if (B <= 0 || B > MAX_CHAIN_ROWS || c->lm_head.K != H || s0->B != 0) return -2;
    float *buf = malloc(sizeof(float) * (size_t)(B * H + B * Vd + 2 * B * H + B * H));
    if (buf == NULL) return -1;
    float *normed = buf, *logits = normed + B * H, *attn_in = logits + B * Vd, *emb = attn_in + 2 * B * H;
    int64_t live[MAX_CHAIN_ROWS], best[MAX_CHAIN_ROWS], pos[MAX_CHAIN_ROWS];
    SeqCache seqs[MAX_CHAIN_ROWS];
    int64_t n = B;
    int rc = 0;
    for (int64_t b = 0; b < B; b++) live[b] = b;
    for (int64_t d = 1; d <= kmax && rc == 0; d++) {
        rc = head_logits(c, g, n, H, normed, logits); /* g's rows: the live rows, in order */
        if (rc != 0) break;
        if (!specdec_topk_f32(logits, n, Vd, 1, best)) {
            rc = -3;
            break;
        }
        int64_t m = 0; /* the rows drafting another token move up, in order */
        for (int64_t j = 0; j < n; j++) {
            const int64_t b = live[j], token = c->draft_ids[best[j]];
            tokens[b * kmax + d - 1] = token;
            if (d >= ks[b]) continue;
            if (token < 0 || token >= c->vocab) {
                rc = -2;
                break;
            }
            if (m != j) memmove(g + m * H, g + j * H, sizeof(float) * H);
            embed_row(c, token, H, emb + m * H);
            live[m++] = b;
        }
        n = m;
        if (rc != 0 || n == 0) break;
        layer_inputs(c, emb, g, attn_in, n, H);
        for (int64_t j = 0; j < n; j++) {
            const int64_t b = live[j];
            seqs[j] = s0->seqs[b];
            seqs[j].past += d - 1; /* the chain's earlier rows are in the cache */
            seqs[j].count = 1;
            pos[j] = pos0[b] + d - 1;
        }
        LayerShape s = *s0;
        s.T = n, s.pos = pos, s.num_seqs = n, s.seqs = seqs;
        rc = specdec_head_layer_f32(g, attn_in, w, &s); /* g: the residual, updated in place */
    }
    free(buf);
    return rc;
}
