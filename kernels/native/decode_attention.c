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
 * A context is attended in runs of CHUNK positions (from `first`, the window's start): one task
 * per (sequence, kv head, run), so one long sequence spreads over every thread as a batch of many
 * does. Every K and V row is read once for all the query heads of its group. Two passes per run:
 * the scores of its positions (kept in a per-thread scratch row per head), then one exp per score
 * and the weighted sum of V. A context of one run is normalised and written at once; a longer one
 * leaves each run's (maximum, sum of exps, unnormalised V sum) per head, and a second loop merges
 * them in position order (each run's sums rescaled by exp(its maximum - the overall maximum)).
 * The runs are fixed by positions alone, so a sequence's result is the same whatever else is in
 * the batch and however many threads run it; for that reason CHUNK is a constant of the code, not
 * a per-host tuning (128 keeps every context of up to 128 positions computed as before the split).
 * The call goes parallel from 4 * CHUNK positions x KV heads, a fixed guess at where a parallel
 * region's start pays, not measured per host. exp is a polynomial (common.h exp_poly) that gcc
 * vectorises. Head sizes that are multiples of 16 take AVX-512 loops (K and V rows widened 16 at
 * a time), on a CPU with AVX2 but not AVX-512 multiples of 8 take the same loops 8 lanes wide (on
 * an AMD EPYC Zen 3 the scalar loops, a copy of each K and V row first, were a fifth of a Q4_1
 * SmolLM2 layer's time); others the scalar ones. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "pagedserve_cpu.h"
#include "layer_team.h"

#define MAX_GROUP_WIDTH 8192 /* query heads per kv head x head size held on the stack */
#define MAX_GROUP 64          /* kernels/attention/native.py MAX_GROUP */
#define MAX_HEAD_SIZE 512     /* and MAX_HEAD_SIZE */
#define PREFETCH_POSITIONS 8  /* context positions ahead */
#define CHUNK 128             /* context positions per task */

#if defined(__AVX512F__)
/* 16 elements of a float32 or bfloat16 row, widened */
static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_BF16)
        return bf16x16_to_f32((const uint16_t *)base + offset);
    return _mm512_loadu_ps((const float *)base + offset);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* 8 elements of a float32 or bfloat16 row, widened */
static inline __m256 load8(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_BF16) return bf16x8_to_f32((const uint16_t *)base + offset);
    return _mm256_loadu_ps((const float *)base + offset);
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

/* scores [G, n] -> exp(score - row max) in place; maxes[j], denom[j] = the row's max and sum */
static inline void softmax_rows(float *scores, int64_t G, int64_t n, float *maxes, float *denom) {
    for (int64_t j = 0; j < G; j++) {
        float *row_scores = scores + j * n, max_score = -INFINITY, sum = 0.0f;
        int64_t i = 0;
#if defined(__AVX512F__)
        /* 16 lanes of maxima, then one across them: the same maximum (NaN scores are skipped as the
         * scalar loop skips them: vmaxps returns its second operand, the running maximum, on NaN) */
        __m512 lanes = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= n; i += 16) lanes = _mm512_max_ps(_mm512_loadu_ps(row_scores + i), lanes);
        max_score = _mm512_reduce_max_ps(lanes);
#endif
        for (; i < n; i++) max_score = row_scores[i] > max_score ? row_scores[i] : max_score;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            row_scores[i] = exp_poly(row_scores[i] - max_score);
            sum += row_scores[i];
        }
        maxes[j] = max_score;
        denom[j] = sum;
    }
}

/* A run's result for G query heads of hs values: with `partial`, the unnormalised sums acc [G, hs]
 * then the G maxima and G sums of exps (a longer context's run, merged later); else each head's
 * acc * v_scale / denom rounded into out (the whole context in one run). */
static inline void finish_run(int64_t G, int64_t hs, const float *acc, const float *maxes, const float *denom,
                              float *partial, void *out, int64_t out_base, float v_scale, int dtype) {
    if (partial) {
        memcpy(partial, acc, (size_t)(G * hs) * sizeof(float));
        memcpy(partial + G * hs, maxes, (size_t)G * sizeof(float));
        memcpy(partial + G * hs + G, denom, (size_t)G * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < G; j++) {
        float factor = v_scale / denom[j];
        for (int64_t d = 0; d < hs; d++) store_elem(out, out_base + j * hs + d, acc[j * hs + d] * factor, dtype);
    }
}

/* the runs' partials [runs][G * hs + 2 G] of one (sequence, kv head), in position order -> out */
static void merge_runs(const float *partials, int64_t runs, int64_t stride, int64_t G, int64_t hs, void *out,
                       int64_t out_base, float v_scale, int dtype) {
    for (int64_t j = 0; j < G; j++) {
        float overall = -INFINITY;
        for (int64_t c = 0; c < runs; c++) {
            float m = partials[c * stride + G * hs + j];
            overall = m > overall ? m : overall;
        }
        float acc[MAX_HEAD_SIZE], denom = 0.0f;
        for (int64_t d = 0; d < hs; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < runs; c++) {
            const float *run = partials + c * stride;
            float weight = exp_poly(run[G * hs + j] - overall);
            denom += run[G * hs + G + j] * weight;
            for (int64_t d = 0; d < hs; d++) acc[d] += run[j * hs + d] * weight;
        }
        float factor = v_scale / denom;
        for (int64_t d = 0; d < hs; d++) store_elem(out, out_base + j * hs + d, acc[d] * factor, dtype);
    }
}

#if defined(__AVX512BF16__)
/* The common case, specialised: bfloat16 query and cache, head size 64, G <= 4 query heads per KV
 * head. Scores by AVX-512 BF16 dot products on the raw bfloat16 rows (the query is bfloat16
 * already; float32 sums), the V sums in G x 4 registers. */
static inline __attribute__((always_inline)) void attend_bf16_64(
    const int G, const uint16_t *query, int64_t q_row, uint16_t *out, int64_t out_row, const uint16_t *key_cache,
    const uint16_t *value_cache, const int32_t *table, int64_t first, int64_t len, int64_t block_size,
    int64_t kv_width, int64_t kv_head, float scale, float v_scale, float *scores, float *partial) {
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
    float maxes[4], denom[4];
    softmax_rows(scores, G, n, maxes, denom);
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
    if (partial) {
        float sums[4 * 64];
        for (int j = 0; j < G; j++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(sums + j * 64 + 16 * c, acc[j][c]);
        finish_run(G, 64, sums, maxes, denom, partial, NULL, 0, v_scale, DTYPE_BF16);
        return;
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

/* the runs of CHUNK positions a context of n positions is attended in */
static inline int64_t num_runs(int64_t n) { return n > CHUNK ? (n + CHUNK - 1) / CHUNK : 1; }

/* one run [from, to) of one (sequence s, kv head): normalised into out when partial is NULL */
static void attend_run(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *key_cache,
                       const void *value_cache, const int32_t *table, int64_t row, int64_t from, int64_t to,
                       int64_t group, int64_t kv_head, int64_t hs, int64_t kv_width, int64_t block_size, float scale,
                       float v_scale, int32_t dtype, int32_t cache_dtype, float *scores, float *partial) {
    int64_t n = to - from;
#if defined(__AVX512BF16__)
    if (dtype == DTYPE_BF16 && cache_dtype == DTYPE_BF16 && hs == 64 && group <= 4) {
        const uint16_t *qb = query, *kb = key_cache, *vb = value_cache;
        uint16_t *ob = out;
        switch (group) {
        case 1: attend_bf16_64(1, qb, row * q_stride, ob, row * out_stride, kb, vb, table, from, to, block_size,
                               kv_width, kv_head, scale, v_scale, scores, partial); break;
        case 2: attend_bf16_64(2, qb, row * q_stride, ob, row * out_stride, kb, vb, table, from, to, block_size,
                               kv_width, kv_head, scale, v_scale, scores, partial); break;
        case 3: attend_bf16_64(3, qb, row * q_stride, ob, row * out_stride, kb, vb, table, from, to, block_size,
                               kv_width, kv_head, scale, v_scale, scores, partial); break;
        default: attend_bf16_64(4, qb, row * q_stride, ob, row * out_stride, kb, vb, table, from, to, block_size,
                                kv_width, kv_head, scale, v_scale, scores, partial); break;
        }
        return;
    }
#endif
    float q[MAX_GROUP_WIDTH], acc[MAX_GROUP_WIDTH], kv[MAX_HEAD_SIZE], maxes[MAX_GROUP], denom[MAX_GROUP];
    for (int64_t j = 0; j < group; j++) {
        load_row(query, row * q_stride + (kv_head * group + j) * hs, hs, dtype, q + j * hs);
        for (int64_t d = 0; d < hs; d++) q[j * hs + d] *= scale, acc[j * hs + d] = 0.0f;
    }
    for (int64_t p = from; p < to; p++) {
        int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
#if defined(__AVX512F__)
        if (hs % 16 == 0) {
            __m512 dots[MAX_GROUP];
            for (int64_t j = 0; j < group; j++) dots[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < hs; d += 16) {
                __m512 k = load16(key_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                for (int64_t j = 0; j < group; j++)
                    dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * hs + d), k, dots[j]);
            }
            for (int64_t j = 0; j < group; j++) scores[j * n + p - from] = _mm512_reduce_add_ps(dots[j]);
            continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (hs % 8 == 0) {
            __m256 dots[MAX_GROUP];
            for (int64_t j = 0; j < group; j++) dots[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < hs; d += 8) {
                __m256 k = load8(key_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                for (int64_t j = 0; j < group; j++)
                    dots[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * hs + d), k, dots[j]);
            }
            for (int64_t j = 0; j < group; j++) scores[j * n + p - from] = sum8(dots[j]);
            continue;
        }
#endif
        load_row(key_cache, slot * kv_width + kv_head * hs, hs, cache_dtype, kv);
        for (int64_t j = 0; j < group; j++) {
            float dot = 0.0f;
            const float *qj = q + j * hs;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < hs; d++) dot += qj[d] * kv[d];
            scores[j * n + p - from] = dot;
        }
    }
    softmax_rows(scores, group, n, maxes, denom);
    for (int64_t p = from; p < to; p++) {
        int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
#if defined(__AVX512F__)
        if (hs % 16 == 0) {
            for (int64_t d = 0; d < hs; d += 16) {
                __m512 v = load16(value_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                for (int64_t j = 0; j < group; j++) {
                    float *aj = acc + j * hs + d;
                    _mm512_storeu_ps(aj, _mm512_fmadd_ps(_mm512_set1_ps(scores[j * n + p - from]), v,
                                                         _mm512_loadu_ps(aj)));
                }
            }
            continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (hs % 8 == 0) {
            for (int64_t d = 0; d < hs; d += 8) {
                __m256 v = load8(value_cache, slot * kv_width + kv_head * hs + d, cache_dtype);
                for (int64_t j = 0; j < group; j++) {
                    float *aj = acc + j * hs + d;
                    _mm256_storeu_ps(aj, _mm256_fmadd_ps(_mm256_set1_ps(scores[j * n + p - from]), v,
                                                         _mm256_loadu_ps(aj)));
                }
            }
            continue;
        }
#endif
        load_row(value_cache, slot * kv_width + kv_head * hs, hs, cache_dtype, kv);
        for (int64_t j = 0; j < group; j++) {
            float weight = scores[j * n + p - from];
            float *aj = acc + j * hs;
#pragma omp simd
            for (int64_t d = 0; d < hs; d++) aj[d] += weight * kv[d];
        }
    }
    finish_run(group, hs, acc, maxes, denom, partial, out, row * out_stride + kv_head * group * hs, v_scale, dtype);
}

/* the tasks of a call (a->tasks, a->task_start, partials); 0 where an allocation failed (nothing to do) */
int attention_prepare(struct attention_call *a) {
    const int64_t num_seqs = a->num_seqs, num_kv_heads = a->num_kv_heads;
    const int64_t group = a->num_heads / num_kv_heads, stride = group * a->head_size + 2 * group;
    /* tasks: sequence i's are task_start[i] .. task_start[i + 1] - 1, run-major over its kv heads;
     * the partials of a context of several runs from partial_start[i] runs on, per kv head */
    a->task_start = malloc((size_t)(2 * num_seqs + 2) * sizeof(int64_t));
    a->partials = NULL;
    a->tasks = a->merges = a->positions = 0;
    if (!a->task_start) return 0;
    int64_t *task_start = a->task_start, *partial_start = task_start + num_seqs + 1;
    a->partial_start = partial_start;
    task_start[0] = partial_start[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        int64_t len = a->seq_lens[a->seqs[i]];
        int64_t first = a->sliding_window > 0 && len > a->sliding_window ? len - a->sliding_window : 0;
        int64_t runs = num_runs(len - first);
        task_start[i + 1] = task_start[i] + runs * num_kv_heads;
        partial_start[i + 1] = partial_start[i] + (runs > 1 ? runs * num_kv_heads : 0);
        a->positions += len - first;
    }
    a->tasks = task_start[num_seqs];
    if (partial_start[num_seqs]) {
        a->partials = malloc((size_t)(partial_start[num_seqs] * stride) * sizeof(float));
        if (!a->partials) {
            free(a->task_start);
            a->task_start = NULL, a->tasks = 0;
            return 0;
        }
        for (int64_t i = 0; i < num_seqs; i++) a->merges += partial_start[i + 1] > partial_start[i] ? num_kv_heads : 0;
    }
    return 1;
}

int attention_is_parallel(const struct attention_call *a) {
    return a->tasks >= 2 && a->positions * a->num_kv_heads >= 4 * CHUNK;
}

int paged_decode_attention_is_serial(const int32_t *seq_lens, const int64_t *seqs, int64_t num_seqs,
                                     int64_t num_kv_heads, int32_t sliding_window) {
    struct attention_call a = {.num_kv_heads = num_kv_heads};
    for (int64_t i = 0; i < num_seqs; i++) { /* attention_prepare's counts, without its tables */
        int64_t len = seq_lens[seqs[i]], first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        a.tasks += num_runs(len - first) * num_kv_heads;
        a.positions += len - first;
    }
    return !attention_is_parallel(&a);
}

/* the tasks, then the merges, shared by the threads of the current team (each must call it) */
void attention_team(const struct attention_call *a) {
    const int64_t num_seqs = a->num_seqs, num_kv_heads = a->num_kv_heads, hs = a->head_size;
    const int64_t group = a->num_heads / num_kv_heads, kv_width = num_kv_heads * hs, stride = group * hs + 2 * group;
    const int64_t *task_start = a->task_start, *partial_start = a->partial_start;
    const int32_t sliding_window = a->sliding_window;
    float *scores = malloc((size_t)(group * CHUNK) * sizeof(float));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < a->tasks; task++) {
        if (!scores) continue;
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence whose tasks hold this one */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (task_start[mid] <= task) lo = mid; else hi = mid - 1;
        }
        int64_t s = a->seqs[lo], local = task - task_start[lo];
        int64_t run = local / num_kv_heads, kv_head = local % num_kv_heads;
        int64_t len = a->seq_lens[s], first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        int64_t from = first + run * CHUNK, to = from + CHUNK < len ? from + CHUNK : len;
        float *partial = partial_start[lo + 1] > partial_start[lo]
                             ? a->partials + (partial_start[lo] + kv_head * num_runs(len - first) + run) * stride
                             : NULL;
        attend_run(a->query, a->q_stride, a->out, a->out_stride, a->key_cache, a->value_cache,
                   a->block_tables + s * a->max_blocks, a->query_start_loc[s], from, to, group, kv_head, hs, kv_width,
                   a->block_size, a->scale, a->v_scale, a->dtype, a->cache_dtype, scores, partial);
    }
    free(scores);
    if (a->merges) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_seqs; i++) {
            int64_t count = partial_start[i + 1] - partial_start[i];
            if (!count) continue;
            int64_t s = a->seqs[i], runs = count / num_kv_heads;
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++)
                merge_runs(a->partials + (partial_start[i] + kv_head * runs) * stride, runs, stride, group, hs, a->out,
                           a->query_start_loc[s] * a->out_stride + kv_head * group * hs, a->v_scale, a->dtype);
        }
    }
}

void attention_release(struct attention_call *a) {
    free(a->partials);
    free(a->task_start);
    a->partials = NULL, a->task_start = NULL;
}

void paged_decode_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int32_t sliding_window, float v_scale, int32_t dtype,
                            int32_t cache_dtype) {
    struct attention_call a = {query, q_stride, out, out_stride, key_cache, value_cache, block_tables, max_blocks,
                               seq_lens, query_start_loc, seqs, num_seqs, num_heads, num_kv_heads, head_size,
                               block_size, scale, sliding_window, v_scale, dtype, cache_dtype};
    if (!attention_prepare(&a)) return;
#pragma omp parallel if (attention_is_parallel(&a))
    attention_team(&a);
    attention_release(&a);
}
