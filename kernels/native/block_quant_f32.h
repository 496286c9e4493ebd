/* The float32 paths' drivers of the GGUF block kernel, shared by block_quant_rows.c (AVX-512) and
 * block_quant_rows_avx2.c (AVX2), which include this after their own lane-width functions: row_chunk
 * and min_terms (1 to ROW_CHUNK activation rows against the codes), decode_row_f32 and dot_rows_f32
 * (weight rows decoded to float32 in L1, from DECODE_MIN_ROWS rows on), and GROUP, ROW_CHUNK,
 * DECODE_MIN_ROWS and DECODE_ROWS. Each output value is computed whole by one thread; the weight's
 * rows are shared out as work_share.h shares them (each thread its static range first, then what
 * is left of the others'), so which thread computes a value changes no result. */
#ifndef PAGEDSERVE_BLOCK_QUANT_F32_H
#define PAGEDSERVE_BLOCK_QUANT_F32_H

#include <stdlib.h>

#include "work_share.h"

static inline __attribute__((always_inline)) void one_row(const int bits, const float *x, const uint8_t *qs,
                                                           const uint16_t *d, const uint16_t *m,
                                                           const float *group_sums, float *y, int64_t n, int64_t M,
                                                           int64_t N, int64_t K) {
    const int64_t num_groups = K / GROUP;
    const uint8_t *row = qs + n * (bits == 4 ? K / 2 : K);
    const uint16_t *dn = d + n * num_groups;
    float sums[ROW_CHUNK];
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        switch (M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK) {
        case 1: row_chunk(1, bits, x, row, dn, r0, K, sums); break;
        case 2: row_chunk(2, bits, x, row, dn, r0, K, sums); break;
        case 3: row_chunk(3, bits, x, row, dn, r0, K, sums); break;
        default: row_chunk(4, bits, x, row, dn, r0, K, sums); break;
        }
        for (int64_t r = r0; r < M && r < r0 + ROW_CHUNK; r++) {
            float sum = sums[r - r0];
            if (m) sum += min_terms(m + n * num_groups, group_sums + r * num_groups, num_groups);
            y[r * N + n] = sum;
        }
    }
}

static void decoded_rows_f32(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                             int64_t M, int64_t N, int64_t K, int32_t bits) {
    const int64_t num_groups = K / GROUP, row_bytes = bits == 4 ? K / 2 : K;
    const int64_t num_blocks = (N + DECODE_ROWS - 1) / DECODE_ROWS;
    const int64_t chunk = work_chunk(DECODE_ROWS * row_bytes);
    struct work_share share;
    work_share_init(&share, num_blocks);
#pragma omp parallel if (N * K >= PARALLEL_MIN_ELEMENTS)
    {
        float *decoded = (float *)aligned_alloc(64, sizeof(float) * DECODE_ROWS * K);
        struct work_cursor cursor = work_cursor_start();
        int64_t first, count;
        while (decoded && (count = work_next(&share, &cursor, chunk, &first)) > 0) {
            for (int64_t b = first; b < first + count; b++) {
                int64_t n0 = b * DECODE_ROWS, nr = N - n0 < DECODE_ROWS ? N - n0 : DECODE_ROWS;
                for (int64_t c = 0; c < nr; c++)
                    decode_row_f32(bits, qs + (n0 + c) * row_bytes, d + (n0 + c) * num_groups,
                                   m ? m + (n0 + c) * num_groups : NULL, decoded + c * K, K);
                for (int64_t m0 = 0; m0 < M; m0 += DECODE_ROWS) {
                    switch (M - m0 < DECODE_ROWS ? M - m0 : DECODE_ROWS) {
                    case 1: dot_rows_f32(1, x, decoded, y, m0, n0, nr, N, K); break;
                    case 2: dot_rows_f32(2, x, decoded, y, m0, n0, nr, N, K); break;
                    case 3: dot_rows_f32(3, x, decoded, y, m0, n0, nr, N, K); break;
                    default: dot_rows_f32(4, x, decoded, y, m0, n0, nr, N, K); break;
                    }
                }
            }
        }
        free(decoded);
    }
}

/* x float32 [M, K]; qs, d [N, K / 32] float16 bits, m [N, K / 32] float16 bits or NULL (8 bits);
 * y float32 [M, N]; bits 4 or 8; K a multiple of 32; 1 <= M <= BLOCK_QUANT_MAX_ROWS */
void block_quant_rows(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y, int64_t M,
                      int64_t N, int64_t K, int32_t bits) {
    if (M >= DECODE_MIN_ROWS) {
        decoded_rows_f32(x, qs, d, m, y, M, N, K, bits);
        return;
    }
    const int64_t num_groups = K / GROUP;
    float *sums = NULL; /* the activations' group sums, for the minimums */
    if (m) {
        sums = (float *)malloc(sizeof(float) * M * num_groups);
        if (!sums) return;
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < num_groups; g++) {
                float s = 0.0f;
                for (int j = 0; j < GROUP; j++) s += x[r * K + g * GROUP + j];
                sums[r * num_groups + g] = s;
            }
    }
    /* the weight rows over the threads (work_share.h), in chunks of about WORK_CHUNK_BYTES of codes:
     * a thread slowed by another process leaves the rest of its range to the other threads */
    const int64_t chunk = work_chunk(bits == 4 ? K / 2 : K);
    if (bits == 4) {
        FOR_EACH_SHARED_ITEM(n, N, chunk, N * K >= PARALLEL_MIN_ELEMENTS, one_row(4, x, qs, d, m, sums, y, n, M, N, K);)
    } else {
        FOR_EACH_SHARED_ITEM(n, N, chunk, N * K >= PARALLEL_MIN_ELEMENTS, one_row(8, x, qs, d, m, sums, y, n, M, N, K);)
    }
    free(sums);
}

int32_t block_quant_rows_available(void) { return 1; }

#endif
