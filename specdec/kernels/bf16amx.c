/* bf16 x bf16 matmul on Intel AMX tiles: y[T, N] = xb[T, K] @ W[N, K]^T (+ bias), fp32 sums, for inputs
 * bf16dot.c has rounded to bfloat16: the same products as its vdpbf16ps kernel, summed in another (fixed)
 * order.
 *
 * Why: vdpbf16ps does 32 multiply-adds per instruction; a tdpbf16ps does 16 x 16 x 32. With vdpbf16ps a
 * verify pass over 8 new tokens cost ~1.9 single-token passes on a 2-vCPU Xeon with AMX (SmolLM2-135M,
 * bf16); on the tiles the extra rows are nearly free and memory bounds both (about 1.2x).
 *
 * Layout (roles swapped, y^T = W @ xb^T, so that the weights are the A operand):
 *     A tile = 16 weight rows x 32 k: W packed once at load, [N / 16][K / 32][16][32], zero-padded (amx_tiles
 *              in specdec/kernels/__init__.py): a row group's tiles are one sequential 1 KB stream. Read in
 *              place from the row-major matrix (stride 2K, 64 rows in flight) the layers' linears took
 *              10-18% longer than on vdpbf16ps at one token; packed, 1-5% (a whole single-token forward
 *              5-10%: methods.md, session 31). Software prefetching only slowed the packed stream.
 *     B tile = 16 k-pairs x `width` inputs x 2 (width = T up to 16, else 16): the rounded inputs, repacked
 *              per call, a partial last chunk zero-padded; a single-token pass reads 64-byte B rows
 *     C tile = 16 weight rows x `width` inputs, fp32
 *     B tiles and C tiles of 16 weight rows are 16 x 16 transposes of 32-bit words in registers
 *              (transpose16; a partial chunk's masked to its width): a 900-token prompt's pass on the tiles
 *              took 0.61 s with element-by-element packing and scatter, now 0.46 s, as on oneDNN's bf16
 *              GEMM (2-vCPU Xeon, session 33). Verify passes of 2-15 tokens moved element by element too
 *              until session 37: a 9-token pass after 32 tokens cost 1.23x a single-token one, now 1.06x.
 * Each y[t, n] is one C element: tdpbf16ps over the k-pairs of each 32-wide block, the blocks in order.
 * That order depends on neither the number of input rows nor the thread split, so a verify pass over
 * T rows equals T single-row passes bit for bit (batch invariance), as in bf16dot.c.
 *
 * The tiles need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, Linux >= 5.16): asked once by
 * specdec_amx_enable when the library loads. Where it is refused, or the CPU has no AMX, no matrix is
 * packed and bf16dot.c's kernel runs.
 */
#include <stdint.h>
#include <string.h>
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ROWS 16      /* weight rows per A / C tile */
#define TILE_INPUTS 16    /* input rows per B / C tile */
#define BLOCK_K 32        /* k per tile step (16 bf16 pairs = 64 bytes a row) */
#define TILE_ELEMS 512    /* bf16 per tile (16 x 32: 1 KB) */
#define GROUP_TILES 4     /* C tiles summed over K together (tmm0-3; A in tmm4-5, B in tmm6) */
/* B tiles and C tiles of at least this many inputs are packed / scattered by 16 x 16 transposes in
 * registers (masked to the tile's width), narrower ones element by element */
#define MIN_MOVED_INPUTS 2

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_on = 0;

/* Ask the kernel for the tile state (once; the library's loader does, unless SPECDEC_AMX=0); 1 if granted. */
int specdec_amx_enable(void) {
    static int asked = 0;
    if (!asked) {
        asked = 1;
        amx_on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_on;
}

int specdec_amx_active(void) { return amx_on; }

/* C tiles tmm0-3 and B tmm6 `width` inputs wide (4 bytes each), A tiles tmm4-5 16 x 32 bf16. */
static void configure_tiles(int64_t width) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 7; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = (uint16_t)(i == 4 || i == 5 ? 64 : 4 * width);
    }
    _tile_loadconfig(&cfg);
}

/* r[i] <- column i of the 16 x 16 matrix of 32-bit words whose rows are r[0..15] (four rounds of shuffles) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) {
            r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
            r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

/* One C tile's 16 weight rows x nt inputs (stored 16 floats a row), transposed into y with the bias
 * (a full tile: one 16 x 16 transpose in registers; the values are only moved, and the bias added). */
static void scatter(const float *c, const float *bias, float *y, int64_t n, int64_t rows, int64_t t0, int64_t nt,
                    int64_t N) {
    if (rows == TILE_ROWS && nt >= MIN_MOVED_INPUTS) { /* columns past nt hold stale values: not stored */
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + i * TILE_INPUTS);
        transpose16(r);
        const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int64_t t = 0; t < nt; t++)
            _mm512_storeu_ps(y + (t0 + t) * N + n, bias ? _mm512_add_ps(r[t], b) : r[t]);
        return;
    }
    for (int64_t t = 0; t < nt; t++) /* (no bias: the value itself, as above, not + 0.0f, which makes -0.0 +0.0) */
        for (int64_t r = 0; r < rows; r++)
            y[(t0 + t) * N + n + r] = bias ? c[r * TILE_INPUTS + t] + bias[n + r] : c[r * TILE_INPUTS + t];
}

/* n <= GROUP_TILES row groups (Wp: the first group's tiles, B tile steps each; n a literal, so each tile
 * index is one) against one chunk of packed inputs xp, `width` inputs wide: n sequential streams of 1 KB
 * tiles. Every C element sums its k-pairs in the same order whatever n is: the same bits. */
static inline __attribute__((always_inline)) void group_tiles(const uint16_t *Wp, const uint16_t *xp, float *c,
                                                              int64_t B, int64_t width, const int n) {
    const int64_t g = B * TILE_ELEMS;
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *w = Wp + b * TILE_ELEMS;
        _tile_loadd(6, xp + b * 32 * width, 4 * width);
        _tile_loadd(4, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (n > 1) {
            _tile_loadd(5, w + g, 64);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (n > 2) {
            _tile_loadd(4, w + 2 * g, 64);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (n > 3) {
            _tile_loadd(5, w + 3 * g, 64);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
    _tile_stored(0, c, 64);
    if (n > 1) _tile_stored(1, c + 256, 64);
    if (n > 2) _tile_stored(2, c + 512, 64);
    if (n > 3) _tile_stored(3, c + 768, 64);
}

#define GROUP(n) \
    static __attribute__((noinline)) void group##n(const uint16_t *Wp, const uint16_t *xp, float *c, int64_t B, \
                                                   int64_t width) { group_tiles(Wp, xp, c, B, width, n); }
GROUP(1) GROUP(2) GROUP(3) GROUP(4)
typedef void (*group_fn)(const uint16_t *, const uint16_t *, float *, int64_t, int64_t);
static const group_fn groups_of[GROUP_TILES] = {group1, group2, group3, group4};

typedef struct {
    const uint16_t *Wp, *xp; /* packed weights [N / 16][B][16][32]; packed inputs [chunks][B][16 pairs][width][2] */
    const float *bias;
    float *y;
    int64_t T, B, N, width; /* width: inputs per B tile, T up to 16, else 16 */
} AmxJob;

/* Thread `me` of nth: a contiguous share of the 16-row groups, four at a time (the rest together). */
static void amx_share(void *ctx, int64_t me, int64_t nth) {
    const AmxJob *j = ctx;
    const int64_t T = j->T, B = j->B, groups = (j->N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t lo = groups * me / nth, hi = groups * (me + 1) / nth;
    float c[GROUP_TILES * TILE_ROWS * TILE_INPUTS] __attribute__((aligned(64)));
    if (lo >= hi) return;
    configure_tiles(j->width);
    for (int64_t g = lo; g < hi;) {
        const int64_t tiles = hi - g >= GROUP_TILES ? GROUP_TILES : hi - g;
        for (int64_t t0 = 0; t0 < T; t0 += TILE_INPUTS) {
            const int64_t nt = T - t0 < TILE_INPUTS ? T - t0 : TILE_INPUTS;
            const uint16_t *xp = j->xp + t0 / TILE_INPUTS * B * 32 * j->width;
            groups_of[tiles - 1](j->Wp + g * B * TILE_ELEMS, xp, c, B, j->width);
            for (int64_t i = 0; i < tiles; i++) {
                const int64_t n = (g + i) * TILE_ROWS, rows = j->N - n < TILE_ROWS ? j->N - n : TILE_ROWS;
                scatter(c + i * TILE_ROWS * TILE_INPUTS, j->bias, j->y, n, rows, t0, nt, j->N);
            }
        }
        g += tiles;
    }
    _tile_release();
}

/* The rounded inputs [T, K] as B tiles `width` inputs wide: per chunk of `width` inputs and 32-wide k block
 * (K zero-padded to B blocks), 16 rows of (input, pair); a last, partial chunk zero-padded. */
static void pack_inputs(const uint16_t *xb, uint16_t *xp, int64_t T, int64_t K, int64_t B, int64_t width) {
    const int64_t chunk = B * 32 * width, chunks = (T + width - 1) / width;
    if (width >= MIN_MOVED_INPUTS && K % BLOCK_K == 0) { /* a (k-pair) word per input and pair: 16 x 16 transposes */
        const __mmask16 keep = (__mmask16)((1u << width) - 1); /* a B tile row holds `width` words */
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int64_t b = 0; b < B; b++) {
                __m512 r[16];
                for (int64_t i = 0; i < 16; i++) {
                    const int64_t t = ch * width + i;
                    r[i] = i < width && t < T ? _mm512_castsi512_ps(_mm512_loadu_si512(xb + t * K + b * BLOCK_K))
                                              : _mm512_setzero_ps();
                }
                transpose16(r);
                uint16_t *tile = xp + ch * chunk + b * 32 * width;
                for (int i = 0; i < 16; i++) _mm512_mask_storeu_ps((float *)(tile + i * 2 * width), keep, r[i]);
            }
        return;
    }
    if (T % width || K % BLOCK_K) memset(xp, 0, sizeof(uint16_t) * chunks * chunk);
    for (int64_t t = 0; t < T; t++) {
        uint16_t *col = xp + t / width * chunk + t % width * 2;
        for (int64_t k = 0; k < K; k++) col[k / BLOCK_K * 32 * width + k % BLOCK_K / 2 * 2 * width + k % 2] = xb[t * K + k];
    }
}

/* y[T, N] = xb[T, K] @ W^T (+ bias) from Wp, W [N, K] packed as tiles (specdec/kernels/__init__.py:
 * amx_tiles). 0, or -1 if the kernel refused the tiles (no matrix is packed then) or the packed inputs
 * cannot be allocated. */
int specdec_amx_linear(const uint16_t *xb, const uint16_t *Wp, const float *bias, float *y, int64_t T, int64_t K,
                       int64_t N) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    if (!amx_on) return -1;
    const int64_t B = (K + BLOCK_K - 1) / BLOCK_K;
    const int64_t width = T < TILE_INPUTS ? T : TILE_INPUTS;
    uint16_t *xp = grow_buffer(&buf, &size, (int64_t)sizeof(uint16_t) * (T + width - 1) / width * B * 32 * width);
    if (xp == NULL) return -1;
    pack_inputs(xb, xp, T, K, B, width);
    AmxJob job = {Wp, xp, bias, y, T, B, N, width};
    specdec_parallel(amx_share, &job, specdec_num_threads());
    return 0;
}
#else
int specdec_amx_enable(void) { return 0; }

int specdec_amx_active(void) { return 0; }

int specdec_amx_linear(const uint16_t *xb, const uint16_t *W, const float *bias, float *y, int64_t T, int64_t K,
                       int64_t N) {
    (void)xb, (void)W, (void)bias, (void)y, (void)T, (void)K, (void)N;
    return -1;
}
#endif
