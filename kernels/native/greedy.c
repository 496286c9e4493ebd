/* Greedy sampling of logits rows: per row the first index of the largest value and that token's
 * log probability, max - logsumexp(row) = -log(sum(exp(x - max))); torch reference:
 * kernels/sampling/greedy.py greedy_ref (torch's max over the row, then exp, sum, log).
 *
 * logits [rows, stride] float32 or bfloat16 (dtype), the first `vocab` values of each row read;
 * ids [rows] int64, logprobs [rows] float32. A row holding a NaN gives its first NaN's index and a
 * NaN log probability, as torch's max does (so does a row whose largest value is infinite). exp is
 * common.h's polynomial (within 2 units in the last place of expf; with AVX-512 the same steps with
 * fused multiply-adds) and the sum is taken in vectorised float32 lanes (without AVX-512: in one
 * double), so the log probability differs from torch's in the last bits; the index never does. With AVX-512 the largest value and
 * its first index come from one pass, the sum of exponentials from a second over the row, now in
 * L2, four vectors at a time. Rows are split over the threads. */
#include <math.h>

#include "common.h"
#include "pagedserve_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values from i on, widened to float32 */
static inline __m512 load16(const void *row, int64_t i, int32_t dtype) {
    if (dtype == DTYPE_BF16)
        return bf16x16_to_f32((const uint16_t *)row + i);
    return _mm512_loadu_ps((const float *)row + i);
}

/* The first `count` (1..16) values from i on, widened to float32; the others -inf */
static inline __m512 load_tail(const void *row, int64_t i, int64_t count, int32_t dtype) {
    const __mmask16 k = (__mmask16)((1u << count) - 1u);
    if (dtype == DTYPE_BF16)
        return _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + i)), 16)));
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, (const float *)row + i);
}

#define GREEDY_LANES 4 /* independent accumulators: one value's add or max waits for none of the others */

static void greedy_row(const void *row, int64_t vocab, int32_t dtype, int64_t *id, float *logprob) {
    const int64_t step = 16 * GREEDY_LANES;
    const int64_t blocks = vocab / step * step;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* pass 1: each accumulator lane's largest value and the first index holding it */
    __m512 m16[GREEDY_LANES];
    __m512i at16[GREEDY_LANES];
    __mmask16 nan = 0;
    for (int a = 0; a < GREEDY_LANES; a++) m16[a] = _mm512_set1_ps(-INFINITY), at16[a] = _mm512_set1_epi32(INT32_MAX);
    int64_t i = 0;
    for (; i < blocks; i += step)
        for (int a = 0; a < GREEDY_LANES; a++) {
            const __m512 v = load16(row, i + 16 * a, dtype);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 up = _mm512_cmp_ps_mask(v, m16[a], _CMP_GT_OQ);
            m16[a] = _mm512_mask_mov_ps(m16[a], up, v);
            at16[a] = _mm512_mask_mov_epi32(at16[a], up, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(i + 16 * a))));
        }
    for (; i < vocab; i += 16) { /* the rest, 16 at a time, the last part masked, into accumulator 0 */
        const int64_t count = vocab - i < 16 ? vocab - i : 16;
        const __m512 v = count == 16 ? load16(row, i, dtype) : load_tail(row, i, count, dtype);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 up = _mm512_cmp_ps_mask(v, m16[0], _CMP_GT_OQ);
        m16[0] = _mm512_mask_mov_ps(m16[0], up, v);
        at16[0] = _mm512_mask_mov_epi32(at16[0], up, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)i)));
    }
    if (nan) { /* the first NaN, and a NaN log probability, as torch's max and its x - max */
        int64_t j = 0;
        while (j < vocab && load_elem(row, j, dtype) == load_elem(row, j, dtype)) j++;
        *id = j;
        *logprob = NAN;
        return;
    }
    __m512 mx = m16[0];
    for (int a = 1; a < GREEDY_LANES; a++) mx = _mm512_max_ps(mx, m16[a]);
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 target = _mm512_set1_ps(m);
    __m512i first = _mm512_set1_epi32(INT32_MAX);
    for (int a = 0; a < GREEDY_LANES; a++) /* the lowest index holding the largest value */
        first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(m16[a], target, _CMP_EQ_OQ), first, at16[a]);
    const int32_t at = _mm512_reduce_min_epi32(first);
    *id = at == INT32_MAX ? 0 : at; /* every value -inf: index 0, as torch's max */
    if (isinf(m)) { /* every value -inf, or one +inf: torch's x - max has NaNs */
        *logprob = NAN;
        return;
    }
    /* pass 3: sum(exp(x - m)), the values from L2 now */
    __m512 s16[GREEDY_LANES];
    for (int a = 0; a < GREEDY_LANES; a++) s16[a] = _mm512_setzero_ps();
    for (i = 0; i < blocks; i += step)
        for (int a = 0; a < GREEDY_LANES; a++)
            s16[a] = _mm512_add_ps(s16[a], exp16(_mm512_sub_ps(load16(row, i + 16 * a, dtype), target)));
    for (; i < vocab; i += 16) {
        const int64_t count = vocab - i < 16 ? vocab - i : 16;
        const __mmask16 k = (__mmask16)((1u << count) - 1u);
        const __m512 v = count == 16 ? load16(row, i, dtype) : load_tail(row, i, count, dtype);
        s16[0] = _mm512_mask_add_ps(s16[0], k, s16[0], exp16(_mm512_sub_ps(v, target)));
    }
    for (int a = 1; a < GREEDY_LANES; a++) s16[0] = _mm512_add_ps(s16[0], s16[a]);
    *logprob = -logf(_mm512_reduce_add_ps(s16[0]));
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
    double s = 0.0; /* one float32 sum in this order would drift (5e-5 of the log probability at 49,152 values) */
    for (int64_t i = 0; i < vocab; i++) s += exp_poly(load_elem(row, i, dtype) - m);
    *logprob = (float)-log(s);
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
