/* topk.c: the k largest values of each row of a logits matrix (k <= TOPK_MAX), largest first.
 *
 * Greedy verification takes the argmax of every row of a pass (k = 1) and Token Recycling keeps each
 * row's top 4 (proposers/recycle.py). torch's argmax and topk over a few rows of a 49k vocabulary take
 * 0.1-0.6 ms, 1-2% of a decode step of the 135M model; one pass over the row at memory speed takes
 * ~15 us. Blocks of 32 values are skipped with one compare against the current k-th value; the rare
 * block holding a larger one is inserted value by value.
 *
 * Ties keep the lower index first, as torch.argmax does. A row holding a NaN, or fewer than k values
 * above -inf, reports 0 and the caller falls back to torch (whose answer for those is its own). */
#include <math.h>
#include <stdint.h>

#include "common.h"

#define TOPK_MAX 8

/* v > val[k-1]: insert (v, j) into the descending list, after any equal values (lower indices first) */
static inline void insert(float v, int64_t j, float *val, int64_t *idx, int64_t k) {
    int64_t p = k - 1;
    while (p > 0 && v > val[p - 1]) {
        val[p] = val[p - 1];
        idx[p] = idx[p - 1];
        p--;
    }
    val[p] = v;
    idx[p] = j;
}

/* scalar pass over x[j0:j1]; 0 on a NaN */
static inline int scan(const float *x, int64_t j0, int64_t j1, float *val, int64_t *idx, int64_t k) {
    for (int64_t j = j0; j < j1; j++) {
        if (x[j] != x[j])
            return 0;
        if (x[j] > val[k - 1])
            insert(x[j], j, val, idx, k);
    }
    return 1;
}

static int top_row(const float *x, int64_t n, int64_t k, int64_t *idx) {
    float val[TOPK_MAX];
    for (int64_t i = 0; i < k; i++) {
        val[i] = -INFINITY;
        idx[i] = -1;
    }
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 32 <= n; j += 32) {
        /* not (x <= t), unordered: true for a larger value and for a NaN (max_ps would drop NaNs) */
        const __m256 t = _mm256_set1_ps(val[k - 1]);
        __m256 hit = _mm256_cmp_ps(_mm256_loadu_ps(x + j), t, _CMP_NLE_UQ);
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_loadu_ps(x + j + 8), t, _CMP_NLE_UQ));
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_loadu_ps(x + j + 16), t, _CMP_NLE_UQ));
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_loadu_ps(x + j + 24), t, _CMP_NLE_UQ));
        if (_mm256_movemask_ps(hit) && !scan(x, j, j + 32, val, idx, k))
            return 0;
    }
#endif
    if (!scan(x, j, n, val, idx, k))
        return 0;
    return idx[k - 1] >= 0;
}

/* x [rows, n] fp32 -> idx [rows, k] int64; 1 when every row was answered, 0: use torch instead */
int specdec_topk_f32(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *idx) {
    if (k < 1 || k > TOPK_MAX || n < k)
        return 0;
    for (int64_t r = 0; r < rows; r++)
        if (!top_row(x + r * n, n, k, idx + r * k))
            return 0;
    return 1;
}
