/* What the kernel files share (they are compiled into one library, specdec/kernels/__init__.py):
 * the parallel dispatch of pool.c, and the AVX2 helpers more than one of them uses. */
#ifndef SPECDEC_COMMON_H
#define SPECDEC_COMMON_H
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* pool.c: run fn(ctx, me, nth) for me = 0..nth-1 (me = 0 on the caller); the thread count to ask for */
typedef void (*pool_fn)(void *ctx, int64_t me, int64_t nth);
void specdec_parallel(pool_fn fn, void *ctx, int64_t nth);
int64_t specdec_num_threads(void);

/* A caller's per-thread scratch (*buf, *size bytes: its own `static __thread` pair) grown to at least
 * `bytes`, 64-byte aligned, and kept between calls; NULL if it cannot grow. */
static inline void *grow_buffer(void **buf, int64_t *size, int64_t bytes) {
    if (bytes > *size) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, (size_t)bytes) != 0) return NULL;
        free(*buf);
        *buf = grown;
        *size = bytes;
    }
    return *buf;
}

#ifdef __AVX2__
static inline float hsum256(__m256 s) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* exp(x) in 8 lanes for x in [-87, 88] (Cephes-style: 2^n * poly(r), ~2 ulp); callers clamp */
static inline __m256 exp8_in_range(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#endif
