/* y = x @ w^T (+ bias) for a few rows of x, streaming the weight once at memory speed; torch
 * reference: F.linear (kernels/linear/native_rows.py).
 *
 * x [M, K], w [N, K] (row-major, the dense weight as the checkpoint has it), bias [N] or NULL,
 * y [M, N]; linear_rows_bf16: all bfloat16 (products and sums in float32 with AVX-512 BF16 dot
 * products, one rounding at the end); linear_rows_f32: all float32 (AVX-512 FMAs). 1 <= M <= LINEAR_ROWS_MAX. Decoding a small model reads every weight once
 * per step and does almost no arithmetic on it, so the limit is how fast the weights stream
 * in: output rows go to threads in blocks of ROWS_PER_BLOCK, each block's weight rows are read
 * side by side, and each is prefetched PREFETCH_AHEAD elements ahead (16 KiB: far enough to
 * cover memory latency across the next blocks). */
#include <immintrin.h>

#include "common.h"
#include "pagedserve_cpu.h"

#define LINEAR_ROWS_MAX 8
#define ROWS_PER_BLOCK 4
#define PREFETCH_AHEAD 8192

/* the blocks of ROWS_PER_BLOCK output rows over the threads, M specialised by a switch */
#define FOR_EACH_BLOCK(block)                                                                  \
    int64_t num_blocks = (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;                            \
    _Pragma("omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_ELEMENTS)")           \
    for (int64_t b = 0; b < num_blocks; b++) {                                                 \
        int64_t n0 = b * ROWS_PER_BLOCK, nr = N - n0 < ROWS_PER_BLOCK ? N - n0 : ROWS_PER_BLOCK; \
        switch (M) {                                                                           \
        case 1: block(1, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 2: block(2, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 3: block(3, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 4: block(4, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 5: block(5, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 6: block(6, x, w, bias, y, n0, nr, N, K); break;                                  \
        case 7: block(7, x, w, bias, y, n0, nr, N, K); break;                                  \
        default: block(8, x, w, bias, y, n0, nr, N, K); break;                                 \
        }                                                                                      \
    }

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void rows_bf16(const int M, const int R, const uint16_t *x,
                                                             const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                             int64_t n0, int64_t nr, int64_t N, int64_t K) {
    __m512 acc[LINEAR_ROWS_MAX][ROWS_PER_BLOCK];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh xv[LINEAR_ROWS_MAX];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * K + k);
        for (int64_t r = 0; r < nr; r++) {
            const uint16_t *row = w + (n0 + r) * K + k;
            _mm_prefetch((const char *)(row + PREFETCH_AHEAD), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row);
            for (int m = 0; m < M; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int64_t r = 0; r < nr; r++) {
            float sum = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) sum += bf16_to_f32(bias[n0 + r]);
            y[(int64_t)m * N + n0 + r] = f32_to_bf16(sum);
        }
}

/* one block of up to ROWS_PER_BLOCK weight rows; above 4 input rows, M x 4 accumulators would
 * spill out of the 32 vector registers, so the block runs as two halves of 2 weight rows */
static inline __attribute__((always_inline)) void block_bf16(const int M, const uint16_t *x, const uint16_t *w,
                                                              const uint16_t *bias, uint16_t *y, int64_t n0,
                                                              int64_t nr, int64_t N, int64_t K) {
    if (M <= 4) {
        rows_bf16(M, ROWS_PER_BLOCK, x, w, bias, y, n0, nr, N, K);
        return;
    }
    rows_bf16(M, 2, x, w, bias, y, n0, nr < 2 ? nr : 2, N, K);
    if (nr > 2) rows_bf16(M, 2, x, w, bias, y, n0 + 2, nr - 2, N, K);
}

void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    FOR_EACH_BLOCK(block_bf16)
}

int32_t linear_rows_available(void) { return 1; }

static inline __attribute__((always_inline)) void block_f32(const int M, const float *x, const float *w,
                                                             const float *bias, float *y, int64_t n0, int64_t nr,
                                                             int64_t N, int64_t K) {
    __m512 acc[LINEAR_ROWS_MAX][ROWS_PER_BLOCK];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < ROWS_PER_BLOCK; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[LINEAR_ROWS_MAX];
        for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_ps(mask, x + (int64_t)m * K + k);
        for (int64_t r = 0; r < nr; r++) {
            const float *row = w + (n0 + r) * K + k;
            _mm_prefetch((const char *)(row + PREFETCH_AHEAD / 2), _MM_HINT_T0);
            __m512 wv = _mm512_maskz_loadu_ps(mask, row);
            for (int m = 0; m < M; m++) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int64_t r = 0; r < nr; r++) {
            float sum = _mm512_reduce_add_ps(acc[m][r]);
            y[(int64_t)m * N + n0 + r] = bias ? sum + bias[n0 + r] : sum;
        }
}

void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    FOR_EACH_BLOCK(block_f32)
}
#else
void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
}

void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
}

int32_t linear_rows_available(void) { return 0; } /* no AVX-512 BF16: the callers keep oneDNN */
#endif
