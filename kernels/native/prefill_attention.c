/* Prefill attention straight from the paged KV cache, by AVX-512 BF16 dot products: each listed
 * sequence's query rows (its last q_len positions) attend causally over its context
 * [0, seq_lens[s]) read through its block table; torch reference: paged_attention_ref
 * (kernels/attention/native.py wraps it; without AVX-512 BF16 the SDPA path runs).
 *
 * query [*, nh, hs] bfloat16 with row stride q_stride (elements), out bfloat16 with row stride
 * out_stride; sequence s's rows start at query_start_loc[s]. key_cache / value_cache bfloat16
 * [num_blocks, block_size, kvh, hs]; query head h reads kv head h / (nh / kvh); hs a multiple of
 * 32, at most MAX_HEAD_SIZE. Row r of a sequence of q_len rows sits at position
 * seq_len - q_len + r and sees the positions p <= it (and p > it - window with a sliding window).
 * scale multiplies the scores (k_scale folded in by the caller), v_scale the output.
 *
 * Two loops in one parallel region:
 *   pack    each (sequence, kv head)'s K and V copied out of the blocks once, into the layouts
 *           the dot products read: K in groups of 16 positions as [hs / 2][16] pairs of dims (a
 *           vector holds one pair of dims of 16 positions), V in pairs of positions as [hs]
 *           (a vector holds 16 dims of two positions). Positions past the context are zero.
 *   attend  a task per (sequence, kv head, tile of QUERY_TILE positions), the later tiles (more
 *           positions to attend) first; a task's rows are its (position, query head of the
 *           group) pairs, ROWS at a time, over the context in blocks of KEY_BLOCK positions:
 *           the scores (ROWS x 4 vectors of float32 sums of bfloat16 products), an online
 *           softmax (each row's running maximum and sum of exps in float32; the block's weights
 *           rounded to bfloat16 for the V product, as torch's flash attention rounds them for its
 *           GEMM), then the V sums in float32.
 * A row's result is its V sums / its sum of exps * v_scale, rounded once to bfloat16. Blocks
 * past a row's position or before its window add nothing (their weights are exactly zero). The
 * order of every sum depends on the positions alone, so a sequence's result is the same however
 * many threads run it. The call goes parallel from PARALLEL_SCORES scores (query rows x heads x
 * positions), a fixed guess at where a parallel region's start pays, not measured per host. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "pagedserve_cpu.h"

#define KEY_BLOCK 64         /* context positions per block of scores: 4 vectors */
#define ROWS 4               /* query rows per pass over the context */
#define QUERY_TILE 16        /* query positions per task */
#define MAX_HEAD_SIZE 256    /* kernels/attention/native.py MAX_PREFILL_HEAD_SIZE */
#define PARALLEL_SCORES 32768

int32_t prefill_attention_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
struct prefill_call {
    const uint16_t *query, *key_cache, *value_cache;
    uint16_t *out;
    int64_t q_stride, out_stride, max_blocks, num_seqs, num_heads, num_kv_heads, hs, block_size;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    const int64_t *seqs;
    float scale, v_scale;
    int32_t window;
    uint32_t *pack;        /* per (sequence, kv head): K [padded / 16][hs / 2][16], then V [padded / 2][hs] */
    int64_t *pack_start;   /* [num_seqs + 1] in units of (kv head x padded positions x hs) dwords / hs */
    int64_t *task_start;   /* [num_seqs + 1] */
};

static inline int64_t padded(int64_t len) { return (len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK; }

/* the K and V of positions [from, from + KEY_BLOCK) of (sequence i, kv head g) into the pack */
static void pack_block(const struct prefill_call *a, int64_t i, int64_t g, int64_t from) {
    const int64_t s = a->seqs[i], len = a->seq_lens[s], hs = a->hs, pairs = hs / 2, size = padded(len);
    const int64_t kv_width = a->num_kv_heads * hs;
    const int32_t *table = a->block_tables + s * a->max_blocks;
    uint32_t *k_pack = a->pack + (a->pack_start[i] + g * size) * hs, *v_pack = k_pack + size * pairs;
    for (int64_t p = from; p < from + KEY_BLOCK; p++) {
        uint32_t *k_group = k_pack + (p / 16) * pairs * 16 + p % 16;
        uint16_t *v_pair = (uint16_t *)(v_pack + (p / 2) * hs) + p % 2;
        if (p >= len) {
            for (int64_t d = 0; d < pairs; d++) k_group[d * 16] = 0;
            for (int64_t d = 0; d < hs; d++) v_pair[2 * d] = 0;
            continue;
        }
        int64_t row = ((int64_t)table[p / a->block_size] * a->block_size + p % a->block_size) * kv_width + g * hs;
        const uint32_t *k = (const uint32_t *)(a->key_cache + row);
        const uint16_t *v = a->value_cache + row;
        for (int64_t d = 0; d < pairs; d++) k_group[d * 16] = k[d];
        for (int64_t d = 0; d < hs; d++) v_pair[2 * d] = v[d];
    }
}

/* o[k][v] += the weights of ROWS rows x the V of one block, for nv vectors of dims from c0 */
static inline __attribute__((always_inline)) void add_values(const int nv, float o[ROWS][MAX_HEAD_SIZE],
                                                             const float *corr, const uint32_t weights[ROWS][KEY_BLOCK / 2],
                                                             const uint32_t *v_block, int64_t hs, int64_t c0) {
    __m512 acc[ROWS][4];
    for (int k = 0; k < ROWS; k++) {
        __m512 c = _mm512_set1_ps(corr[k]);
        for (int v = 0; v < nv; v++) acc[k][v] = _mm512_mul_ps(_mm512_loadu_ps(o[k] + c0 + 16 * v), c);
    }
    for (int pair = 0; pair < KEY_BLOCK / 2; pair++) {
        const uint32_t *vp = v_block + pair * hs + c0;
        __m512bh vv[4];
        for (int v = 0; v < nv; v++) vv[v] = (__m512bh)_mm512_loadu_si512((const void *)(vp + 16 * v));
        for (int k = 0; k < ROWS; k++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)weights[k][pair]);
            for (int v = 0; v < nv; v++) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], w, vv[v]);
        }
    }
    for (int k = 0; k < ROWS; k++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(o[k] + c0 + 16 * v, acc[k][v]);
}

/* ROWS rows (rows[k]: query row in the sequence, heads[k]: query head) of sequence i over kv head g */
static void attend_rows(const struct prefill_call *a, int64_t i, int64_t g, const int64_t *rows, const int64_t *heads,
                        int64_t num_rows) {
    const int64_t s = a->seqs[i], len = a->seq_lens[s], hs = a->hs, pairs = hs / 2, size = padded(len);
    const int64_t q_start = a->query_start_loc[s], q_len = a->query_start_loc[s + 1] - q_start;
    const uint32_t *k_pack = a->pack + (a->pack_start[i] + g * size) * hs, *v_pack = k_pack + size * pairs;
    const uint32_t *q[ROWS];
    int64_t position[ROWS], lowest = len, highest = 0;
    for (int k = 0; k < ROWS; k++) {
        int64_t row = rows[k < num_rows ? k : num_rows - 1], head = heads[k < num_rows ? k : num_rows - 1];
        q[k] = (const uint32_t *)(a->query + (q_start + row) * a->q_stride + head * hs);
        position[k] = len - q_len + row;
        int64_t first = a->window > 0 && position[k] - a->window + 1 > 0 ? position[k] - a->window + 1 : 0;
        lowest = first < lowest ? first : lowest;
        highest = position[k] > highest ? position[k] : highest;
    }
    float o[ROWS][MAX_HEAD_SIZE], maxes[ROWS], sums[ROWS], corr[ROWS];
    uint32_t weights[ROWS][KEY_BLOCK / 2];
    for (int k = 0; k < ROWS; k++) {
        maxes[k] = -INFINITY, sums[k] = 0.0f;
        for (int64_t d = 0; d < hs; d++) o[k][d] = 0.0f;
    }
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale = _mm512_set1_ps(a->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t from = lowest / KEY_BLOCK * KEY_BLOCK; from <= highest; from += KEY_BLOCK) {
        const uint32_t *k_block = k_pack + (from / 16) * pairs * 16;
        __m512 acc[ROWS][4];
        for (int k = 0; k < ROWS; k++)
            for (int c = 0; c < 4; c++) acc[k][c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < pairs; d++) {
            __m512bh kv[4];
            for (int c = 0; c < 4; c++)
                kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(k_block + (c * pairs + d) * 16));
            for (int k = 0; k < ROWS; k++) {
                __m512bh qd = (__m512bh)_mm512_set1_epi32((int)q[k][d]);
                for (int c = 0; c < 4; c++) acc[k][c] = _mm512_dpbf16_ps(acc[k][c], qd, kv[c]);
            }
        }
        for (int k = 0; k < ROWS; k++) {
            const __m512i last = _mm512_set1_epi32((int)(position[k] - from));
            const __m512i first = _mm512_set1_epi32((int)(a->window > 0 ? position[k] - a->window + 1 - from : -1));
            __m512 p[4], top = minus_inf;
            __mmask16 seen[4];
            for (int c = 0; c < 4; c++) {
                __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * c));
                seen[c] = _mm512_cmple_epi32_mask(at, last) & _mm512_cmpge_epi32_mask(at, first);
                p[c] = _mm512_mask_mul_ps(minus_inf, seen[c], acc[k][c], scale);
                top = _mm512_max_ps(top, p[c]);
            }
            float block_max = _mm512_reduce_max_ps(top), highest_seen = block_max > maxes[k] ? block_max : maxes[k];
            if (highest_seen == -INFINITY) { /* nothing of this block for this row */
                corr[k] = 1.0f;
                memset(weights[k], 0, sizeof(weights[k]));
                continue;
            }
            corr[k] = expf(maxes[k] - highest_seen);
            maxes[k] = highest_seen;
            __m512 m = _mm512_set1_ps(highest_seen), total = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                p[c] = _mm512_maskz_mov_ps(seen[c], exp16(_mm512_sub_ps(p[c], m)));
                total = _mm512_add_ps(total, p[c]);
            }
            sums[k] = sums[k] * corr[k] + _mm512_reduce_add_ps(total);
            _mm512_storeu_si512((void *)weights[k], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
            _mm512_storeu_si512((void *)(weights[k] + 16), (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
        }
        const uint32_t *v_block = v_pack + (from / 2) * hs;
        int64_t c0 = 0;
        for (; c0 + 64 <= hs; c0 += 64) add_values(4, o, corr, weights, v_block, hs, c0);
        if (c0 < hs) add_values(2, o, corr, weights, v_block, hs, c0);
    }
    for (int64_t k = 0; k < num_rows; k++) {
        uint16_t *dst = a->out + (q_start + rows[k]) * a->out_stride + heads[k] * hs;
        __m512 factor = _mm512_set1_ps(a->v_scale / sums[k]);
        for (int64_t d = 0; d < hs; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), f32x16_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o[k] + d), factor)));
    }
}

/* task t of sequence i: kv head and query tile, the later tiles first */
static void attend_task(const struct prefill_call *a, int64_t i, int64_t t) {
    const int64_t s = a->seqs[i], q_len = a->query_start_loc[s + 1] - a->query_start_loc[s];
    const int64_t tiles = (q_len + QUERY_TILE - 1) / QUERY_TILE, group = a->num_heads / a->num_kv_heads;
    const int64_t g = t % a->num_kv_heads, tile = tiles - 1 - t / a->num_kv_heads;
    const int64_t begin = tile * QUERY_TILE, end = begin + QUERY_TILE < q_len ? begin + QUERY_TILE : q_len;
    int64_t rows[ROWS], heads[ROWS], n = 0;
    for (int64_t row = begin; row < end; row++)
        for (int64_t j = 0; j < group; j++) {
            rows[n] = row, heads[n] = g * group + j;
            if (++n == ROWS) {
                attend_rows(a, i, g, rows, heads, n);
                n = 0;
            }
        }
    if (n) attend_rows(a, i, g, rows, heads, n);
}

static int64_t find_sequence(const int64_t *start, int64_t num_seqs, int64_t index) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= index) lo = mid; else hi = mid - 1;
    }
    return lo;
}
#endif

int32_t paged_prefill_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride,
                                const void *key_cache, const void *value_cache, const int32_t *block_tables,
                                int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start_loc,
                                const int64_t *seqs, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_size, int64_t block_size, float scale, int32_t sliding_window,
                                float v_scale) {
#if defined(__AVX512BF16__)
    if (num_seqs <= 0) return 1;
    if (head_size % 32 || head_size > MAX_HEAD_SIZE || num_heads % num_kv_heads) return 0;
    struct prefill_call a = {query, key_cache, value_cache, out, q_stride, out_stride, max_blocks, num_seqs, num_heads,
                             num_kv_heads, head_size, block_size, block_tables, seq_lens, query_start_loc, seqs,
                             scale, v_scale, sliding_window, NULL, NULL, NULL};
    int64_t *starts = malloc((size_t)(3 * num_seqs + 3) * sizeof(int64_t));
    if (!starts) return 0;
    int64_t *pack_start = starts, *task_start = starts + num_seqs + 1, *block_start = task_start + num_seqs + 1;
    int64_t scores = 0;
    pack_start[0] = task_start[0] = block_start[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        int64_t s = seqs[i], len = seq_lens[s], q_len = query_start_loc[s + 1] - query_start_loc[s];
        pack_start[i + 1] = pack_start[i] + num_kv_heads * padded(len);
        task_start[i + 1] = task_start[i] + num_kv_heads * ((q_len + QUERY_TILE - 1) / QUERY_TILE);
        block_start[i + 1] = block_start[i] + num_kv_heads * (padded(len) / KEY_BLOCK);
        scores += q_len * len * num_heads;
    }
    a.pack = aligned_alloc(64, (size_t)(pack_start[num_seqs] * head_size) * sizeof(uint32_t));
    if (!a.pack) {
        free(starts);
        return 0;
    }
    a.pack_start = pack_start, a.task_start = task_start;
#pragma omp parallel if (scores >= PARALLEL_SCORES)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < block_start[num_seqs]; b++) {
            int64_t i = find_sequence(block_start, num_seqs, b), local = b - block_start[i];
            int64_t blocks = padded(seq_lens[seqs[i]]) / KEY_BLOCK;
            pack_block(&a, i, local / blocks, local % blocks * KEY_BLOCK);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < task_start[num_seqs]; t++) {
            int64_t i = find_sequence(task_start, num_seqs, t);
            attend_task(&a, i, t - task_start[i]);
        }
    }
    free(a.pack);
    free(starts);
    return 1;
#else
    (void)query, (void)q_stride, (void)out, (void)out_stride, (void)key_cache, (void)value_cache, (void)block_tables;
    (void)max_blocks, (void)seq_lens, (void)query_start_loc, (void)seqs, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_size, (void)block_size, (void)scale, (void)sliding_window, (void)v_scale;
    return 0;
#endif
}
