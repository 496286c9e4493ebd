/* One pre-norm decoder layer of the Llama family for a decode step of a few rows, in one call:
 * the chain of the per-op native kernels (rms_norm.c, linear_rows.c, rotary_write_kv.c,
 * decode_attention.c, silu_mul.c) that the model otherwise calls one by one from Python, so its results are
 * those of that chain bit for bit. Activations and weights all bfloat16 or all float32 (dtype).
 *
 *   has_residual: residual += x, normed = norm1(residual)   else: normed = norm1(x), residual = x
 *   qkv = normed @ w_qkv^T (+ b_qkv); RoPE on q and k in place; K/V written to their slots
 *   attn = attention of each row's query over its sequence's cached context
 *   residual += attn @ w_o^T (+ b_o); normed = norm2(residual)
 *   out = silu_mul(normed @ w_gate_up^T (+ b)) @ w_down^T (+ b)
 *
 * `x` may be `residual` itself only when has_residual is 0 (the first layer: the residual stream
 * starts as the embeddings). scratch holds M * (H + qkv width + nh * hs + H + 2 inner + inner)
 * values of the dtype. */
#include "common.h"

struct layer_weights {
    const void *norm1, *norm2;           /* [H] */
    const void *w_qkv, *b_qkv;           /* [(nh + 2 kvh) hs, H], bias or NULL */
    const void *w_o, *b_o;               /* [H, nh hs] */
    const void *w_gate_up, *b_gate_up;   /* [2 inner, H] */
    const void *w_down, *b_down;         /* [H, inner] */
    void *key_cache, *value_cache;       /* [num_blocks, block_size, kvh, hs] */
    int64_t hidden, num_heads, num_kv_heads, head_size, inner, num_slots, block_size;
    float eps, scale;
    int32_t cache_dtype, sliding_window; /* sliding_window 0: none */
    int32_t dtype;                       /* of the activations and weights */
};

struct step_rows {
    const void *cos_sin;                 /* [P, 2 hs] */
    const int64_t *positions, *slot_mapping; /* [M] */
    const int32_t *block_tables;         /* [M, max_blocks]: row i is sequence i's table */
    const int32_t *seq_lens;             /* [M] */
    const int32_t *query_start_loc;      /* [M + 1]: 0, 1, ..., M */
    const int64_t *seqs;                 /* [M]: 0, 1, ..., M - 1 */
    int64_t num_rows, max_blocks;
};

void add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H, float eps,
                  int32_t dtype, int32_t has_residual);
void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K);
void rotary_write_kv(void *qkv, const void *cos_sin, const int64_t *positions, const int64_t *slot_mapping,
                     void *key_cache, void *value_cache, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_size, int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype);
void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K);
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t inner, int64_t stride, int32_t dtype);
void paged_decode_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int32_t sliding_window, float v_scale, int32_t dtype,
                            int32_t cache_dtype);

static void linear(int32_t dtype, const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                   int64_t K) {
    if (dtype == DTYPE_BF16)
        linear_rows_bf16(x, w, bias, y, M, N, K);
    else
        linear_rows_f32(x, w, bias, y, M, N, K);
}

void decode_layer(const struct layer_weights *lw, const struct step_rows *st, void *x, void *residual,
                  int32_t has_residual, void *out, void *scratch) {
    int64_t M = st->num_rows, H = lw->hidden, hs = lw->head_size, size = lw->dtype == DTYPE_BF16 ? 2 : 4;
    int64_t q_width = lw->num_heads * hs, qkv_width = (lw->num_heads + 2 * lw->num_kv_heads) * hs;
    char *normed = scratch, *qkv = normed + M * H * size, *attn = qkv + M * qkv_width * size;
    char *o = attn + M * q_width * size, *gate_up = o + M * H * size, *act = gate_up + M * 2 * lw->inner * size;
    int32_t dtype = lw->dtype;
    if (!has_residual) residual = x;
    add_rms_norm(x, has_residual ? residual : NULL, lw->norm1, normed, M, H, lw->eps, dtype, has_residual);
    linear(dtype, normed, lw->w_qkv, lw->b_qkv, qkv, M, qkv_width, H);
    rotary_write_kv(qkv, st->cos_sin, st->positions, st->slot_mapping, lw->key_cache, lw->value_cache, M,
                    lw->num_heads, lw->num_kv_heads, hs, qkv_width, lw->num_slots, dtype, lw->cache_dtype);
    paged_decode_attention(qkv, qkv_width, attn, q_width, lw->key_cache, lw->value_cache, st->block_tables,
                           st->max_blocks, st->seq_lens, st->query_start_loc, st->seqs, M, lw->num_heads,
                           lw->num_kv_heads, hs, lw->block_size, lw->scale, lw->sliding_window, 1.0f, dtype,
                           lw->cache_dtype);
    linear(dtype, attn, lw->w_o, lw->b_o, o, M, H, q_width);
    add_rms_norm(o, residual, lw->norm2, normed, M, H, lw->eps, dtype, 1);
    linear(dtype, normed, lw->w_gate_up, lw->b_gate_up, gate_up, M, 2 * lw->inner, H);
    silu_mul(gate_up, act, M, lw->inner, 2 * lw->inner, dtype);
    linear(dtype, act, lw->w_down, lw->b_down, out, M, H, lw->inner);
}
