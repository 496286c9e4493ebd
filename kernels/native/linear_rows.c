/* y = x @ w^T (+ bias) for a few rows of x, streaming the weight once at memory speed; torch
 * reference: F.linear (kernels/linear/native_rows.py).
 *
 * x [M, K], w [N, K] (row-major, the dense weight as the checkpoint has it), bias [N] or NULL,
 * y [M, N]; linear_rows_bf16: all bfloat16 (products and sums in float32 with AVX-512 BF16 dot
 * products, one rounding at the end); linear_rows_f32: all float32 (AVX-512 FMAs, or without AVX-512
 * BF16 the AVX2 twin below: linear_rows_f32_available).
 * 1 <= M <= LINEAR_ROWS_MAX.
 *
 * Decoding a small model reads every weight once per step and does almost no arithmetic on it, so
 * the limit is how fast the weights stream in. Each thread takes one contiguous range of output
 * rows and walks its weight rows in memory order: a single sequential stream per thread, which the
 * hardware prefetchers of both AMD Zen 4 and Intel cores follow at full bandwidth (four rows read
 * side by side, four streams per thread, reached 70 % of it on Zen 4); a thread through with its
 * range takes chunks from the back of another's (work_share.h). Each weight vector is
 * loaded once and multiplied into all M rows of x (two accumulators per row of x, even and odd
 * 32-element chunks of K, summed at the end). A software prefetch `linear_rows_prefetch` bytes
 * ahead of the stream is issued when that distance is not 0: pagedserve.kernels.linear.row_tuning
 * measures the candidates on the host once and sets it (cached per host and build). */
#include <immintrin.h>

#include "common.h"
#include "pagedserve_cpu.h"
#include "work_share.h"

#define LINEAR_ROWS_MAX 8

static int64_t prefetch_bytes = 0; /* 0: the hardware prefetchers alone */

void linear_rows_set_prefetch(int64_t bytes) { prefetch_bytes = bytes > 0 ? bytes : 0; }

int64_t linear_rows_prefetch(void) { return prefetch_bytes; }

/* the output rows over the threads (work_share.h: each its contiguous range first, in chunks of
 * WORK_CHUNK_BYTES of weight, then what is left of the others'), M specialised */
#define FOR_EACH_ROW(row_fn, elem_bytes)                                                                           \
    int64_t distance = prefetch_bytes;                                                                             \
    FOR_EACH_SHARED_ITEM(n, N, work_chunk(K * (elem_bytes)), N * K >= PARALLEL_MIN_ELEMENTS, switch (M) {          \
        case 1: row_fn(1, x, w, bias, y, n, N, K, distance); break;                                                \
        case 2: row_fn(2, x, w, bias, y, n, N, K, distance); break;                                                \
        case 3: row_fn(3, x, w, bias, y, n, N, K, distance); break;                                                \
        case 4: row_fn(4, x, w, bias, y, n, N, K, distance); break;                                                \
        case 5: row_fn(5, x, w, bias, y, n, N, K, distance); break;                                                \
        case 6: row_fn(6, x, w, bias, y, n, N, K, distance); break;                                                \
        case 7: row_fn(7, x, w, bias, y, n, N, K, distance); break;                                                \
        default: row_fn(8, x, w, bias, y, n, N, K, distance); break;                                               \
    })

#if defined(__AVX512BF16__)
/* output column n for the M rows of x: weight row n read once, front to back */
static inline __attribute__((always_inline)) void row_bf16(const int M, const uint16_t *x, const uint16_t *w,
                                                            const uint16_t *bias, uint16_t *y, int64_t n,
                                                            int64_t N, int64_t K, int64_t distance) {
    const uint16_t *row = w + n * K;
    __m512 even[LINEAR_ROWS_MAX], odd[LINEAR_ROWS_MAX];
    for (int m = 0; m < M; m++) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (distance) _mm_prefetch((const char *)(row + k) + distance, _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_epi16(row + k), w1 = (__m512bh)_mm512_loadu_epi16(row + k + 32);
        for (int m = 0; m < M; m++) {
            even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_loadu_epi16(x + (int64_t)m * K + k));
            odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_loadu_epi16(x + (int64_t)m * K + k + 32));
        }
    }
    for (; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
        for (int m = 0; m < M; m++)
            even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * K + k));
    }
    for (int m = 0; m < M; m++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
        if (bias) sum += bf16_to_f32(bias[n]);
        y[(int64_t)m * N + n] = f32_to_bf16(sum);
    }
}

void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    FOR_EACH_ROW(row_bf16, 2)
}

int32_t linear_rows_available(void) { return 1; }

static inline __attribute__((always_inline)) void row_f32(const int M, const float *x, const float *w,
                                                           const float *bias, float *y, int64_t n, int64_t N,
                                                           int64_t K, int64_t distance) {
    const float *row = w + n * K;
    __m512 even[LINEAR_ROWS_MAX], odd[LINEAR_ROWS_MAX];
    for (int m = 0; m < M; m++) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (distance) _mm_prefetch((const char *)(row + k) + distance, _MM_HINT_T0);
        __m512 w0 = _mm512_loadu_ps(row + k), w1 = _mm512_loadu_ps(row + k + 16);
        for (int m = 0; m < M; m++) {
            even[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (int64_t)m * K + k), even[m]);
            odd[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + (int64_t)m * K + k + 16), odd[m]);
        }
    }
    for (; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (K - k)) - 1u);
        __m512 w0 = _mm512_maskz_loadu_ps(mask, row + k);
        for (int m = 0; m < M; m++)
            even[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask, x + (int64_t)m * K + k), even[m]);
    }
    for (int m = 0; m < M; m++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
        y[(int64_t)m * N + n] = bias ? sum + bias[n] : sum;
    }
}

void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    FOR_EACH_ROW(row_f32, 4)
}

int32_t linear_rows_f32_available(void) { return 1; }
#else
void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
}

int32_t linear_rows_available(void) { return 0; } /* no AVX-512 BF16: the callers keep oneDNN */

#if defined(__AVX2__) && defined(__FMA__)
/* linear_rows_f32 without AVX-512 (AMD Zen 3): the same walk, 8 lanes at a time, two accumulators per
 * row of x (even and odd 8-element chunks of K), the last K % 8 products in a scalar sum. On such a
 * CPU MKL's one-row product read a 49,152 x 576 float32 weight from memory at about 10.6 GB/s. This
 * walk leaves the prefetching to the hardware: the tuned distance is measured on the bfloat16
 * kernel, which such a CPU lacks. */
static inline __attribute__((always_inline)) void row_f32(const int M, const float *x, const float *w,
                                                           const float *bias, float *y, int64_t n, int64_t N,
                                                           int64_t K, int64_t distance) {
    (void)distance;
    const float *row = w + n * K;
    __m256 even[LINEAR_ROWS_MAX], odd[LINEAR_ROWS_MAX];
    float tail[LINEAR_ROWS_MAX];
    for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps(), tail[m] = 0.0f;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_loadu_ps(row + k), w1 = _mm256_loadu_ps(row + k + 8);
        for (int m = 0; m < M; m++) {
            even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (int64_t)m * K + k), even[m]);
            odd[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (int64_t)m * K + k + 8), odd[m]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(row + k);
        for (int m = 0; m < M; m++) even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (int64_t)m * K + k), even[m]);
    }
    for (; k < K; k++)
        for (int m = 0; m < M; m++) tail[m] += row[k] * x[(int64_t)m * K + k];
    for (int m = 0; m < M; m++) {
        float sum = sum8(_mm256_add_ps(even[m], odd[m])) + tail[m];
        y[(int64_t)m * N + n] = bias ? sum + bias[n] : sum;
    }
}

void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    FOR_EACH_ROW(row_f32, 4)
}

int32_t linear_rows_f32_available(void) { return 1; }
#else
void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
}

int32_t linear_rows_f32_available(void) { return 0; }
#endif
#endif
