/* Greedy sampling of logits rows: per row the first index of the largest value and that token's
 * log probability, max - logsumexp(row) = -log(sum(exp(x - max))); torch reference:
 * kernels/sampling/greedy.py greedy_ref (torch's max over the row, then exp, sum, log).
 *
 * logits [rows, stride] float32 or bfloat16 (dtype), the first `vocab` values of each row read;
 * ids [rows] int64, logprobs [rows] float32. A row holding a NaN gives its first NaN's index and a
 * NaN log probability, as torch's max does (so does a row whose largest value is infinite). exp is
 * common.h's polynomial (within 2 units in the last place of expf) and the sum is taken in
 * vectorised float32 lanes, so the log probability differs from torch's in the last bits; the
 * index never does. Rows are split over the threads. */
#include <math.h>

#include "common.h"
#include "pagedserve_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values from i on, widened to float32 */
static inline __m512 load16(const void *row, int64_t i, int32_t dtype) {
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))), 16));
    return _mm512_loadu_ps((const float *)row + i);
}

static void greedy_row(const void *row, int64_t vocab, int32_t dtype, int64_t *id, float *logprob) {
    const int64_t full = vocab / 16 * 16;
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < full; i += 16) {
        __m512 v = load16(row, i, dtype);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m16 = _mm512_max_ps(m16, v);
    }
    float m = _mm512_reduce_max_ps(m16);
    for (int64_t i = full; i < vocab; i++) {
        float v = load_elem(row, i, dtype);
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan) { /* the first NaN, and a NaN log probability, as torch's max and its x - max */
        int64_t i = 0;
        while (i < vocab && load_elem(row, i, dtype) == load_elem(row, i, dtype)) i++;
        *id = i;
        *logprob = NAN;
        return;
    }
    int64_t at = vocab;
    const __m512 target = _mm512_set1_ps(m);
    for (int64_t i = 0; i < full && at == vocab; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(load16(row, i, dtype), target, _CMP_EQ_OQ);
        if (hit) at = i + __builtin_ctz(hit);
    }
    for (int64_t i = full; i < vocab && at == vocab; i++)
        if (load_elem(row, i, dtype) == m) at = i;
    *id = at == vocab ? 0 : at;
    if (isinf(m)) { /* every value -inf, or one +inf: torch's x - max has NaNs */
        *logprob = NAN;
        return;
    }
    float s = 0.0f;
    if (dtype == DTYPE_BF16) {
        const uint16_t *x = row;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < vocab; i++) s += exp_poly(bf16_to_f32(x[i]) - m);
    } else {
        const float *x = row;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < vocab; i++) s += exp_poly(x[i] - m);
    }
    *logprob = -logf(s);
}
#else
static void greedy_row(const void *row, int64_t vocab, int32_t dtype, int64_t *id, float *logprob) {
    float m = -INFINITY;
    int64_t at = 0;
    for (int64_t i = 0; i < vocab; i++) {
        float v = load_elem(row, i, dtype);
        if (v != v) { /* the first NaN, as torch's max */
            *id = i;
            *logprob = NAN;
            return;
        }
        if (v > m || i == 0) m = v, at = i;
    }
    *id = at;
    if (isinf(m)) {
        *logprob = NAN;
        return;
    }
    float s = 0.0f;
    for (int64_t i = 0; i < vocab; i++) s += exp_poly(load_elem(row, i, dtype) - m);
    *logprob = -logf(s);
}
#endif

void greedy_rows(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int32_t dtype, int64_t *ids,
                 float *logprobs) {
    const int64_t size = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows > 1 && rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        greedy_row((const char *)logits + r * stride * size, vocab, dtype, ids + r, logprobs + r);
    }
}
