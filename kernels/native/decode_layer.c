/* One pre-norm decoder layer of the Llama family for a decode step of a few rows, in one call:
 * the chain of the per-op native kernels (rms_norm.c, linear_rows.c, rotary_write_kv.c, the decode
 * attention, silu_mul.c) that the model otherwise calls one by one from Python, so its results are
 * those of that chain bit for bit. bfloat16 activations and weights.
 *
 *   has_residual: residual += x, normed = norm1(residual)   else: normed = norm1(x), residual = x
 *   qkv = normed @ w_qkv^T (+ b_qkv); RoPE on q and k in place; K/V written to their slots
 *   attn = attention of each row's query over its sequence's cached context
 *   residual += attn @ w_o^T (+ b_o); normed = norm2(residual)
 *   out = silu_mul(normed @ w_gate_up^T (+ b)) @ w_down^T (+ b)
 *
 * `x` may be `residual` itself only when has_residual is 0 (the first layer: the residual stream
 * starts as the embeddings). scratch holds M * (H + qkv width + nh * hs + H + 2 inner + inner)
 * bfloat16 values. */
#include <math.h>

#include "common.h"

struct layer_weights {
    const uint16_t *norm1, *norm2;       /* [H] */
    const uint16_t *w_qkv, *b_qkv;       /* [(nh + 2 kvh) hs, H], bias or NULL */
    const uint16_t *w_o, *b_o;           /* [H, nh hs] */
    const uint16_t *w_gate_up, *b_gate_up; /* [2 inner, H] */
    const uint16_t *w_down, *b_down;     /* [H, inner] */
    void *key_cache, *value_cache;       /* [num_blocks, block_size, kvh, hs] */
    int64_t hidden, num_heads, num_kv_heads, head_size, inner, num_slots, block_size;
    float eps, scale;
    int32_t cache_dtype, sliding_window; /* sliding_window 0: none */
};

struct step_rows {
    const uint16_t *cos_sin;             /* [P, 2 hs] */
    const int64_t *positions, *slot_mapping; /* [M] */
    const int32_t *block_tables;         /* [M, max_blocks]: row i is sequence i's table */
    const int32_t *seq_lens;             /* [M] */
    const int32_t *query_start_loc;      /* [M + 1]: 0, 1, ..., M */
    int64_t num_rows, max_blocks;
};

void add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H, float eps,
                  int32_t dtype, int32_t has_residual);
void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K);
void rotary_write_kv(void *qkv, const void *cos_sin, const int64_t *positions, const int64_t *slot_mapping,
                     void *key_cache, void *value_cache, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_size, int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype);
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t inner, int64_t stride, int32_t dtype);
void decode_layer_attention(const uint16_t *qkv, int64_t qkv_stride, uint16_t *out, const struct layer_weights *lw,
                            const struct step_rows *st);

void decode_layer_bf16(const struct layer_weights *lw, const struct step_rows *st, uint16_t *x, uint16_t *residual,
                       int32_t has_residual, uint16_t *out, uint16_t *scratch) {
    int64_t M = st->num_rows, H = lw->hidden, hs = lw->head_size;
    int64_t q_width = lw->num_heads * hs, qkv_width = (lw->num_heads + 2 * lw->num_kv_heads) * hs;
    uint16_t *normed = scratch, *qkv = normed + M * H, *attn = qkv + M * qkv_width, *o = attn + M * q_width;
    uint16_t *gate_up = o + M * H, *act = gate_up + M * 2 * lw->inner;
    if (!has_residual) residual = x;
    add_rms_norm(x, has_residual ? residual : NULL, lw->norm1, normed, M, H, lw->eps, DTYPE_BF16, has_residual);
    linear_rows_bf16(normed, lw->w_qkv, lw->b_qkv, qkv, M, qkv_width, H);
    rotary_write_kv(qkv, st->cos_sin, st->positions, st->slot_mapping, lw->key_cache, lw->value_cache, M,
                    lw->num_heads, lw->num_kv_heads, hs, qkv_width, lw->num_slots, DTYPE_BF16, lw->cache_dtype);
    decode_layer_attention(qkv, qkv_width, attn, lw, st);
    linear_rows_bf16(attn, lw->w_o, lw->b_o, o, M, H, q_width);
    add_rms_norm(o, residual, lw->norm2, normed, M, H, lw->eps, DTYPE_BF16, 1);
    linear_rows_bf16(normed, lw->w_gate_up, lw->b_gate_up, gate_up, M, 2 * lw->inner, H);
    silu_mul(gate_up, act, M, lw->inner, 2 * lw->inner, DTYPE_BF16);
    linear_rows_bf16(act, lw->w_down, lw->b_down, out, M, H, lw->inner);
}

/* Each row's query (in qkv, row stride qkv_stride) over positions [0, seq_lens[i]) of its own
 * sequence (block table row i), float32 scores and sums, the output rounded once to bfloat16.
 * Parallel over (row, kv head). */
void decode_layer_attention(const uint16_t *qkv, int64_t qkv_stride, uint16_t *out, const struct layer_weights *lw,
                            const struct step_rows *st) {
    int64_t hs = lw->head_size, kvh = lw->num_kv_heads, group = lw->num_heads / kvh;
    int64_t bs = lw->block_size, kv_width = kvh * hs;
    int64_t pairs = st->num_rows * kvh;
#pragma omp parallel for schedule(dynamic)
    for (int64_t pair = 0; pair < pairs; pair++) {
        int64_t row = pair / kvh, kv_head = pair % kvh;
        int64_t len = st->seq_lens[row];
        int64_t first = lw->sliding_window > 0 && len > lw->sliding_window ? len - lw->sliding_window : 0;
        const int32_t *table = st->block_tables + row * st->max_blocks;
        for (int64_t g = 0; g < group; g++) {
            int64_t head = kv_head * group + g;
            const uint16_t *query = qkv + row * qkv_stride + head * hs;
            float qf[512], acc[512], max_score = -INFINITY, denom = 0.0f;
            for (int64_t d = 0; d < hs; d++) qf[d] = bf16_to_f32(query[d]) * lw->scale, acc[d] = 0.0f;
            for (int64_t p = first; p < len; p++) {
                int64_t slot = (int64_t)table[p / bs] * bs + p % bs;
                int64_t base = slot * kv_width + kv_head * hs;
                float score = 0.0f;
#pragma omp simd reduction(+ : score)
                for (int64_t d = 0; d < hs; d++) score += qf[d] * load_elem(lw->key_cache, base + d, lw->cache_dtype);
                float new_max = score > max_score ? score : max_score;
                float correction = expf(max_score - new_max), weight = expf(score - new_max);
                denom = denom * correction + weight;
                for (int64_t d = 0; d < hs; d++)
                    acc[d] = acc[d] * correction + weight * load_elem(lw->value_cache, base + d, lw->cache_dtype);
                max_score = new_max;
            }
            for (int64_t d = 0; d < hs; d++) out[row * lw->num_heads * hs + head * hs + d] = f32_to_bf16(acc[d] / denom);
        }
    }
}
