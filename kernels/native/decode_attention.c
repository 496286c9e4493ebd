/* Decode attention straight from the paged KV cache: each listed sequence's one query row attends
 * over its context [0, seq_lens[s]) read through its block table, with no gathered copy; torch
 * reference: paged_attention_ref (kernels/attention/native.py wraps it).
 *
 * query [*, nh, hs] with row stride q_stride (elements; the query heads of a fused QKV output),
 * out with row stride out_stride; sequence s's query and output row is query_start_loc[s].
 * key_cache / value_cache [num_blocks, block_size, kvh, hs]; query head h reads kv head
 * h / (nh / kvh). scale multiplies the scores (k_scale folded in by the caller), v_scale the
 * output. sliding_window > 0 keeps positions p > L - 1 - window. Query and output in dtype,
 * caches in cache_dtype (float32 or bfloat16); scores, softmax and sums in float32, the output
 * rounded once.
 *
 * One (sequence, kv head) pair per task: every K and V row is read once for all the query heads
 * of its group. Two passes: the scores of all positions (kept in a scratch row per head), then
 * one exp per score and the weighted sum of V. exp is a polynomial (common.h exp_poly) that
 * gcc vectorises. Head sizes that are multiples of 16 take AVX-512 loops (K and V rows widened
 * 16 at a time); others the scalar ones. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "pagedserve_cpu.h"

#define MAX_GROUP_WIDTH 8192
#define PREFETCH_POSITIONS 8 /* context positions ahead */ /* query heads per kv head x head size held on the stack */

#if defined(__AVX512F__)
/* 16 elements of a float32 or bfloat16 row, widened */
static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset))), 16));
    return _mm512_loadu_ps((const float *)base + offset);
}
#endif

static inline void load_row(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* scores [G, n] -> exp(score - row max) in place; denom[j] = the row's sum */
static inline void softmax_rows(float *scores, int64_t G, int64_t n, float *denom) {
    for (int64_t j = 0; j < G; j++) {
        float *row_scores = scores + j * n, max_score = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) max_score = row_scores[i] > max_score ? row_scores[i] : max_score;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            row_scores[i] = exp_poly(row_scores[i] - max_score);
            sum += row_scores[i];
        }
        denom[j] = sum;
    }
}

#if defined(__AVX512BF16__)
/* The common case, specialised: bfloat16 query and cache, head size 64, G <= 4 query heads per KV
 * head. Scores by AVX-512 BF16 dot products on the raw bfloat16 rows (the query is bfloat16
 * already; float32 sums), the V sums in G x 4 registers. */
static inline __attribute__((always_inline)) void attend_bf16_64(
    const int G, const uint16_t *query, int64_t q_row, uint16_t *out, int64_t out_row, const uint16_t *key_cache,
    const uint16_t *value_cache, const int32_t *table, int64_t first, int64_t len, int64_t block_size,
    int64_t kv_width, int64_t kv_head, float scale, float v_scale, float *scores) {
    int64_t n = len - first;
    __m512bh q[4][2];
    for (int j = 0; j < G; j++) {
        const uint16_t *qj = query + q_row + (kv_head * G + j) * 64;
        q[j][0] = (__m512bh)_mm512_loadu_si512((const void *)qj);
        q[j][1] = (__m512bh)_mm512_loadu_si512((const void *)(qj + 32));
    }
    for (int64_t p = first; p < len; p++) {
        const uint16_t *k = key_cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * kv_width
                            + kv_head * 64;
        if (p + PREFETCH_POSITIONS < len) { /* the cache is read from memory: fetch K and V rows ahead */
            int64_t ahead = ((int64_t)table[(p + PREFETCH_POSITIONS) / block_size] * block_size
                             + (p + PREFETCH_POSITIONS) % block_size) * kv_width + kv_head * 64;
            _mm_prefetch((const char *)(key_cache + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(key_cache + ahead + 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(value_cache + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(value_cache + ahead + 32), _MM_HINT_T1);
        }
        __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)k), k1 = (__m512bh)_mm512_loadu_si512((const void *)(k + 32));
        for (int j = 0; j < G; j++) {
            __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q[j][0], k0), q[j][1], k1);
            scores[j * n + p - first] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
    float denom[4];
    softmax_rows(scores, G, n, denom);
    __m512 acc[4][4];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t p = first; p < len; p++) {
        const uint16_t *v = value_cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * kv_width
                            + kv_head * 64;
        __m512 vf[4];
        for (int c = 0; c < 4; c++)
            vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * c))), 16));
        for (int j = 0; j < G; j++) {
            __m512 w = _mm512_set1_ps(scores[j * n + p - first]);
            for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(w, vf[c], acc[j][c]);
        }
    }
    for (int j = 0; j < G; j++) {
        __m512 factor = _mm512_set1_ps(v_scale / denom[j]);
        uint16_t *o = out + out_row + (kv_head * G + j) * 64;
        for (int c = 0; c < 4; c++) {
            __m512 r = _mm512_mul_ps(acc[j][c], factor);
            for (int i = 0; i < 16; i++) o[16 * c + i] = f32_to_bf16(r[i]);
        }
    }
}
#endif

void paged_decode_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int32_t sliding_window, float v_scale, int32_t dtype,
                            int32_t cache_dtype) {
    int64_t group = num_heads / num_kv_heads, hs = head_size, kv_width = num_kv_heads * hs;
    int64_t tasks = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic) if (tasks >= 4)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t s = seqs[task / num_kv_heads], kv_head = task % num_kv_heads;
        int64_t len = seq_lens[s], row = query_start_loc[s];
        int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        int64_t n = len - first;
        const int32_t *table = block_tables + s * max_blocks;
        float *scores = malloc((size_t)(group * n) * sizeof(float));
#if defined(__AVX512BF16__)
        if (dtype == DTYPE_BF16 && cache_dtype == DTYPE_BF16 && hs == 64 && group <= 4) {
            const uint16_t *qb = query, *kb = key_cache, *vb = value_cache;
            uint16_t *ob = out;
            switch (group) {
            case 1: attend_bf16_64(1, qb, row * q_stride, ob, row * out_stride, kb, vb, table, first, len, block_size,
                                   kv_width, kv_head, scale, v_scale, scores); break;
            case 2: attend_bf16_64(2, qb, row * q_stride, ob, row * out_stride, kb, vb, table, first, len, block_size,
                                   kv_width, kv_head, scale, v_scale, scores); break;
            case 3: attend_bf16_64(3, qb, row * q_stride, ob, row * out_stride, kb, vb, table, first, len, block_size,
                                   kv_width, kv_head, scale, v_scale, scores); break;
            default: attend_bf16_64(4, qb, row * q_stride, ob, row * out_stride, kb, vb, table, first, len,
                                    block_size, kv_width, kv_head, scale, v_scale, scores); break;
            }
            free(scores);
            continue;
        }
#endif
        float q[MAX_GROUP_WIDTH], acc[MAX_GROUP_WIDTH], kv[512], denom[64];
        for (int64_t j = 0; j < group; j++) {
            load_row(query, row * q_stride + (kv_head * group + j) * hs, hs, dtype, q + j * hs);
            for (int64_t d = 0; d < hs; d++) q[j * hs + d] *= scale, acc[j * hs + d] = 0.0f;
        }
        for (int64_t p = first; p < len; p++) {
            int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
#if defined(__AVX512F__)
            if (hs % 16 == 0) {
                __m512 dots[64];
                for (int64_t j = 0; j < group; j++) dots[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < hs; d += 16) {
                    __m512 k = load16(key_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                    for (int64_t j = 0; j < group; j++)
                        dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * hs + d), k, dots[j]);
                }
                for (int64_t j = 0; j < group; j++) scores[j * n + p - first] = _mm512_reduce_add_ps(dots[j]);
                continue;
            }
#endif
            load_row(key_cache, slot * kv_width + kv_head * hs, hs, cache_dtype, kv);
            for (int64_t j = 0; j < group; j++) {
                float dot = 0.0f;
                const float *qj = q + j * hs;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < hs; d++) dot += qj[d] * kv[d];
                scores[j * n + p - first] = dot;
            }
        }
        softmax_rows(scores, group, n, denom);
        for (int64_t p = first; p < len; p++) {
            int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
#if defined(__AVX512F__)
            if (hs % 16 == 0) {
                for (int64_t d = 0; d < hs; d += 16) {
                    __m512 v = load16(value_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                    for (int64_t j = 0; j < group; j++) {
                        float *aj = acc + j * hs + d;
                        _mm512_storeu_ps(aj, _mm512_fmadd_ps(_mm512_set1_ps(scores[j * n + p - first]), v,
                                                             _mm512_loadu_ps(aj)));
                    }
                }
                continue;
            }
#endif
            load_row(value_cache, slot * kv_width + kv_head * hs, hs, cache_dtype, kv);
            for (int64_t j = 0; j < group; j++) {
                float weight = scores[j * n + p - first];
                float *aj = acc + j * hs;
#pragma omp simd
                for (int64_t d = 0; d < hs; d++) aj[d] += weight * kv[d];
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float factor = v_scale / denom[j];
            int64_t base = row * out_stride + (kv_head * group + j) * hs;
            for (int64_t d = 0; d < hs; d++) store_elem(out, base + d, acc[j * hs + d] * factor, dtype);
        }
        free(scores);
    }
}
