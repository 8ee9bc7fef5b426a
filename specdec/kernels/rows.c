/* The row-wise kernels between a layer's matmuls: RMSNorm and SwiGLU (silu(gate) * up), fp32. Each row
 * is computed alone, by the same instructions whatever the row count or thread split, so a row's values
 * never depend on the rows beside it (the batch invariance of gemv.c and attention.c). */
#include <stdint.h>
#include <math.h>
#include "common.h"

/* The rows split over the threads from this many on: a prompt's pass (150 tokens, bf16: 10 of 60 ms in
 * the two, on one core). A decode pass's few rows stay on the caller's thread, where a dispatch would cost
 * about what it saves. A row's values never depend on the split. */
#define ROWS_PARALLEL 32

typedef struct {
    const float *x, *w;
    float *y;
    int64_t T, H;
    float eps;
} RowsJob;

static void rmsnorm_rows(const float *x, const float *w, float *y, int64_t t0, int64_t t1, int64_t H, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * H;
        float *yt = y + t * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xt[i] * xt[i];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) yt[i] = xt[i] * inv * w[i];
    }
}

static void rmsnorm_share(void *ctx, int64_t me, int64_t nth) {
    const RowsJob *j = ctx;
    rmsnorm_rows(j->x, j->w, j->y, j->T * me / nth, j->T * (me + 1) / nth, j->H, j->eps);
}

/* RMSNorm over the last dim: y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. x, y: [T, H]. */
void specdec_rmsnorm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps) {
    if (T < ROWS_PARALLEL) {
        rmsnorm_rows(x, w, y, 0, T, H, eps);
        return;
    }
    RowsJob job = {x, w, y, T, H, eps};
    specdec_parallel(rmsnorm_share, &job, specdec_num_threads());
}

#ifdef __AVX2__
/* exp(x) in 8 lanes (Cephes-style: 2^n * poly(r), ~2 ulp), x clamped to [-87, 88]. */
static inline __m256 exp8_clamped(__m256 x) {
    return exp8_in_range(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}
#endif

/* SwiGLU: gu [T, 2I] holds gate then up; y [T, I] = silu(gate) * up. Element-wise, so a value never
 * depends on T: 8 lanes at a time (a vector exp: the scalar expf loop was ~8 us a layer, 0.25 ms of a
 * 15 ms bf16 decode step), the last I % 8 elements of a row with expf. */
static void silu_mul_rows(const float *gu, float *y, int64_t t0, int64_t t1, int64_t I) {
    for (int64_t t = t0; t < t1; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *yt = y + t * I;
        int64_t i = 0;
#ifdef __AVX2__
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void silu_mul_share(void *ctx, int64_t me, int64_t nth) {
    const RowsJob *j = ctx;
    silu_mul_rows(j->x, j->y, j->T * me / nth, j->T * (me + 1) / nth, j->H);
}

void specdec_silu_mul_f32(const float *gu, float *y, int64_t T, int64_t I) {
    if (T < ROWS_PARALLEL) {
        silu_mul_rows(gu, y, 0, T, I);
        return;
    }
    RowsJob job = {gu, NULL, y, T, I, 0.f};
    specdec_parallel(silu_mul_share, &job, specdec_num_threads());
}
