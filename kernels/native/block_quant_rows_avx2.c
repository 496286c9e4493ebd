/* block_quant_rows.c's float32 paths for CPUs with AVX2, FMA and F16C but without AVX-512 (AMD Zen 3,
 * Intel before Skylake-SP): the same computation, 8 lanes at a time; torch reference: dequantize
 * exactly, then one float32 matmul (kernels/linear/block_quant.py).
 *
 * At 1-3 rows, per group of 32 inputs the products q * x are summed in float32 (four 8-lane FMAs
 * on the codes widened to float), scaled by d into 8 running lanes, and the minimums add
 * m * sum(x of the group) at the end; from DECODE_MIN_ROWS rows, weight rows are decoded exactly to
 * float32 (q * d + m, one rounding, as gguf computes it) in L1 and multiplied by FMAs. Either way
 * the result differs from the reference only in the order of float32 sums. bfloat16 activations
 * have no kernel here (`--dtype auto` is float32 on these CPUs): block_quant_rows_bf16_available()
 * is 0 and the callers dequantize. block_quant_dequantize writes float32 only. */
#include <immintrin.h>
#include <stdlib.h>

#include "common.h"
#include "pagedserve_cpu.h"

#if !(defined(__AVX512F__) && defined(__F16C__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GROUP 32
#define ROW_CHUNK 4
#define DECODE_MIN_ROWS 4
#define DECODE_ROWS 4

/* 8 bytes from p widened to 32-bit lanes (one vpmovzxbd / vpmovsxbd from memory) */
static inline __m256i bytes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static inline __m256i bytes_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* the 32 codes of group g as float32: v[0..3] hold values 0-7, 8-15, 16-23 and 24-31. A 4-bit
 * group's bytes 0-7 and 8-15 are each widened once, and their low and high nibbles taken with an
 * and and a shift in the 32-bit lanes: two shuffles a group instead of six (on AMD Zen 3 the loop
 * ran 2.3x as fast at one row) */
static inline __attribute__((always_inline)) void group_codes(const int bits, const uint8_t *row, int64_t g,
                                                               __m256 v[4]) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi32(0x0f);
        const __m256i b0 = bytes_u8(row + g * (GROUP / 2)), b1 = bytes_u8(row + g * (GROUP / 2) + 8);
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
        v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    } else {
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtepi32_ps(bytes_i8(row + g * GROUP + 8 * i));
    }
}

/* one weight row against activation rows r0 .. r0 + R - 1 */
static inline __attribute__((always_inline)) void row_chunk(const int R, const int bits, const float *x,
                                                             const uint8_t *row, const uint16_t *d, int64_t r0,
                                                             int64_t K, float *sums) {
    __m256 acc[ROW_CHUNK];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        group_codes(bits, row, g, v);
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[g]));
        for (int r = 0; r < R; r++) {
            const float *xg = x + (r0 + r) * K + g * GROUP;
            __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xg));
            t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xg + 8), t);
            t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xg + 16), t);
            t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xg + 24), t);
            acc[r] = _mm256_fmadd_ps(t, scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = sum8(acc[r]);
}

/* sum over groups of m[g] * group_sums[g] (the 4-bit minimums against the activations' group sums) */
static inline float min_terms(const uint16_t *m, const float *group_sums, int64_t num_groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= num_groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))),
                              _mm256_loadu_ps(group_sums + g), acc);
    float sum = sum8(acc);
    for (; g < num_groups; g++) sum += _cvtsh_ss(m[g]) * group_sums[g];
    return sum;
}

/* a weight row decoded exactly to float32: q * d + m (q * d is exact in float32: one rounding) */
static inline void decode_row_f32(const int bits, const uint8_t *row, const uint16_t *d, const uint16_t *m,
                                  float *out, int64_t K) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        group_codes(bits, row, g, v);
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[g]));
        const __m256 offset = _mm256_set1_ps(m ? _cvtsh_ss(m[g]) : 0.0f);
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(out + g * GROUP + 8 * i,
                             m ? _mm256_fmadd_ps(v[i], scale, offset) : _mm256_mul_ps(v[i], scale));
    }
}

static inline __attribute__((always_inline)) void dot_rows_f32(const int MX, const float *x, const float *w, float *y,
                                                                int64_t m0, int64_t n0, int64_t nr, int64_t N,
                                                                int64_t K) {
    __m256 acc[DECODE_ROWS][DECODE_ROWS];
    for (int r = 0; r < MX; r++)
        for (int c = 0; c < DECODE_ROWS; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[DECODE_ROWS];
        for (int r = 0; r < MX; r++) xv[r] = _mm256_loadu_ps(x + (m0 + r) * K + k);
        for (int64_t c = 0; c < nr; c++) {
            const __m256 wv = _mm256_loadu_ps(w + c * K + k);
            for (int r = 0; r < MX; r++) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
        }
    }
    for (int r = 0; r < MX; r++)
        for (int64_t c = 0; c < nr; c++) y[(m0 + r) * N + n0 + c] = sum8(acc[r][c]);
}

#include "block_quant_f32.h" /* one_row, decoded_rows_f32, block_quant_rows */

void block_quant_rows_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                           int64_t M, int64_t N, int64_t K, int32_t bits) {
    (void)x, (void)qs, (void)d, (void)m, (void)y, (void)M, (void)N, (void)K, (void)bits;
}

int32_t block_quant_rows_bf16_available(void) { return 0; }

/* the whole weight dequantized into out [N, K] float32 (dtype 0), the values
 * BlockQuantWeight.dequantize() gives; 0 for bfloat16 (the callers convert in torch) */
int32_t block_quant_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, void *out, int64_t N,
                               int64_t K, int32_t bits, int32_t dtype) {
    if (dtype != DTYPE_F32) return 0;
    const int64_t num_groups = K / GROUP, row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_ELEMENTS)
    for (int64_t n = 0; n < N; n++)
        decode_row_f32(bits, qs + n * row_bytes, d + n * num_groups, m ? m + n * num_groups : NULL,
                       (float *)out + n * K, K);
    return 1;
}
#endif
