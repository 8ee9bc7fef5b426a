/* EAGLE-2's dynamic draft tree from an EAGLE-3 head in one call: what proposers/eagle_tree.py's
 * dynamic_tree does for the offline decoder's request, with the same kernels for the head's passes
 * (rows.c, the Linear's kernel, topk.c, layer.c's head layer over a tree block):
 *
 *     depth 1:   the top K of log_softmax(lm_head(norm(g)))                 g: the last committed row's output
 *     depth d:   forward the frontier (the K best nodes of depth d - 1) with its ancestors as one tree block,
 *                each row seeing the committed rows and its root path; each frontier node's K best children by
 *                cumulative log-probability, val(node) + log_softmax(lm_head(norm(out)))
 *
 * Every node's token, parent and value come back; the host reranks them (eagle_tree.rerank). The
 * log-softmax is this file's (max, a sum of expf, logf) where the Python path uses torch's, so a value
 * may differ from it in the last bits and a near-tie may rank the other way: a draft's content moves
 * acceptance, never the output, which verification decides. What goes away is ~100 Python and torch
 * dispatches a tree (a 3 x 3 tree: 2.3 ms in Python on 2 vCPUs). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "layer.h"
#include "head.h"

#define TREE_TOPK_MAX 8 /* topk.c's TOPK_MAX */

/* lp [n, Vd] = base[i] + log_softmax(lm_head(norm(g_i))) for the n rows of g (base NULL: 0); 0, -1 out
 * of memory, -3 a row that is not finite (the caller drafts its own way) */
static int node_scores(const ChainHead *c, const float *g, int64_t n, int64_t H, float *normed, float *lp,
                       const float *base) {
    const int64_t Vd = c->lm_head.N;
    const int rc = head_logits(c, g, n, H, normed, lp);
    if (rc != 0) return rc;
    for (int64_t i = 0; i < n; i++) {
        float *x = lp + i * Vd, mx = -INFINITY, sum = 0.f;
        for (int64_t v = 0; v < Vd; v++) mx = x[v] > mx ? x[v] : mx;
        if (!isfinite(mx)) return -3;
        for (int64_t v = 0; v < Vd; v++) sum += expf(x[v] - mx);
        const float lse = logf(sum), b = base ? base[i] : 0.f;
        for (int64_t v = 0; v < Vd; v++) x[v] = b + ((x[v] - mx) - lse);
    }
    return 0;
}

/* The tree block of one depth as a verify pass's (spec/tree.py's tree_mask, then root_path_columns):
 * rows 0..m-1 are the nodes block[], parents first; row r sees columns 0..depth_r of its root path, laid out
 * by depth (mask [m, m]), read at tail_path [m, m] (past + the column of its ancestor at that depth, or of
 * the column itself past its own depth). Returns 0 when every path is the identity (a chain: the caller
 * passes no mask), else 1. */
static int tree_block(const int64_t *block, int64_t m, const int64_t *par, const int64_t *row_of, const int64_t *dep,
                      int64_t past, uint8_t *mask, int64_t *tail_start, int64_t *tail_path) {
    int tree = 0;
    for (int64_t r = 0; r < m; r++) {
        const int64_t n = block[r], depth = dep[n] - 1; /* the block holds every ancestor down to depth 1 */
        tail_start[r] = past;
        for (int64_t col = 0; col < m; col++) {
            mask[r * m + col] = col <= depth;
            tail_path[r * m + col] = past + col;
        }
        for (int64_t a = n, col = depth; a != -1; a = par[a], col--) tail_path[r * m + col] = past + row_of[a];
        for (int64_t col = 0; col <= depth; col++) tree |= tail_path[r * m + col] != past + col;
    }
    return tree;
}

/* g [H]: the head's output at the last committed row; s0: one sequence (s0->seqs[0]: its cache, past = the
 * committed rows, which every node sees); pos0: the position of a depth-1 node's forward; K <= 8 children a
 * node; depths >= 1. Out, N = K + (depths - 1) K^2 nodes in dynamic_tree's order: tok [N] target ids, par [N]
 * (-1: the root), val [N] cumulative log-probabilities. The cache's rows after `past` are scratch. Returns
 * 0; -1 out of memory; -2 a shape this does not take; -3 logits that are not finite. */
int specdec_head_tree_f32(const float *g, const ChainHead *c, const LayerWeights *w, const LayerShape *s0,
                          int64_t pos0, int64_t K, int64_t depths, int64_t *tok, int64_t *par, float *val) {
    const int64_t H = s0->H, Vd = c->lm_head.N, F = (depths - 1) * K; /* F: the forwarded nodes at most */
    if (K < 1 || K > TREE_TOPK_MAX || K > Vd || depths < 1 || F > MAX_CHAIN_ROWS || s0->num_seqs != 1 ||
        s0->B != 0 || c->lm_head.K != H || s0->seqs[0].past + F > s0->seqs[0].max_len)
        return -2;
    const int64_t N = K + (depths - 1) * K * K, rows = F > 1 ? F : 1;
    float *fbuf = malloc(sizeof(float) * (size_t)(K * H + K * Vd + (1 + F) * H + rows * 4 * H + K));
    int64_t *ibuf = malloc(sizeof(int64_t) * (size_t)(3 * N + rows * (3 + rows) + K * K + 2 * K));
    uint8_t *mask = malloc((size_t)(rows * rows));
    uint8_t *in_block = malloc((size_t)N);
    int rc = fbuf && ibuf && mask && in_block ? 0 : -1;
    if (rc != 0) goto done;
    float *normed = fbuf, *lp = normed + K * H, *outs = lp + K * Vd, *x = outs + (1 + F) * H, *emb = x + rows * H;
    float *attn_in = emb + rows * H, *front_val = attn_in + 2 * rows * H;
    int64_t *dep = ibuf, *out_of = dep + N, *row_of = out_of + N, *block = row_of + N, *pos = block + rows;
    int64_t *tail_start = pos + rows, *tail_path = tail_start + rows, *idx = tail_path + rows * rows;
    int64_t *frontier = idx + K * K, *next = frontier + K;

    memcpy(outs, g, sizeof(float) * H); /* outs row 0: the root's; out_of[node]: its row, once forwarded */
    if ((rc = node_scores(c, g, 1, H, normed, lp, NULL)) != 0) goto done;
    if (!specdec_topk_f32(lp, 1, Vd, K, idx)) { rc = -3; goto done; }
    for (int64_t i = 0; i < K; i++) {
        tok[i] = c->draft_ids[idx[i]], par[i] = -1, val[i] = lp[idx[i]], dep[i] = 1, out_of[i] = -1;
        frontier[i] = i;
    }
    int64_t count = K, filled = 1;
    for (int64_t depth = 2; depth <= depths; depth++) {
        /* 1. the block: the frontier and its ancestors; node ids ascend with depth, so id order is parents first */
        memset(in_block, 0, (size_t)count);
        for (int64_t i = 0; i < K; i++)
            for (int64_t a = frontier[i]; a != -1 && !in_block[a]; a = par[a]) in_block[a] = 1;
        int64_t m = 0;
        for (int64_t n = 0; n < count; n++)
            if (in_block[n]) row_of[n] = m, block[m++] = n;
        const int tree = tree_block(block, m, par, row_of, dep, s0->seqs[0].past, mask, tail_start, tail_path);
        /* 2. the block through the head's layer: embed(token) and the parent's output, at depth's position */
        for (int64_t r = 0; r < m; r++) {
            const int64_t n = block[r];
            if (tok[n] < 0 || tok[n] >= c->vocab) { rc = -2; goto done; }
            embed_row(c, tok[n], H, emb + r * H);
            memcpy(x + r * H, outs + (par[n] == -1 ? 0 : out_of[par[n]]) * H, sizeof(float) * H);
            pos[r] = pos0 + dep[n] - 1;
        }
        layer_inputs(c, emb, x, attn_in, m, H);
        SeqCache seq = s0->seqs[0];
        seq.count = m;
        LayerShape s = *s0;
        s.T = m, s.pos = pos, s.seqs = &seq;
        s.mask = tree ? mask : NULL, s.tail_start = tree ? tail_start : NULL, s.tail_path = tree ? tail_path : NULL;
        s.tail_width = tree ? m : 0;
        if ((rc = specdec_head_layer_f32(x, attn_in, w, &s)) != 0) goto done;
        /* 3. the frontier's outputs kept, in frontier order (outs rows first..first + K - 1); its children scored */
        const int64_t first = filled;
        for (int64_t i = 0; i < K; i++) {
            const int64_t n = frontier[i];
            memcpy(outs + filled * H, x + row_of[n] * H, sizeof(float) * H);
            front_val[i] = val[n];
            out_of[n] = filled++;
        }
        if ((rc = node_scores(c, outs + first * H, K, H, normed, lp, front_val)) != 0) goto done;
        if (!specdec_topk_f32(lp, K, Vd, K, idx)) { rc = -3; goto done; }
        /* 4. the K * K children, each frontier node's in its order; the next frontier: their K best, ties in
         * that order (a stable sort's) */
        int64_t kept = 0;
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j < K; j++) {
                const int64_t n = count++, d = idx[i * K + j];
                tok[n] = c->draft_ids[d], par[n] = frontier[i], val[n] = lp[i * Vd + d], dep[n] = depth;
                out_of[n] = -1;
                int64_t p;
                if (kept < K) p = kept++;
                else if (val[n] > val[next[K - 1]]) p = K - 1; /* the last kept drops out */
                else continue;
                while (p > 0 && val[n] > val[next[p - 1]]) next[p] = next[p - 1], p--;
                next[p] = n;
            }
        memcpy(frontier, next, sizeof(int64_t) * K);
    }
done:
    free(fbuf);
    free(ibuf);
    free(mask);
    free(in_block);
    return rc;
}
