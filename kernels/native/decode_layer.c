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
 * A bfloat16 projection with panels (its *_panels pointer) goes through panel_linear.c above
 * DENSE_MAX_ROWS rows, and at any number of rows when it has no dense weight (the host's tuning
 * chose panels for few rows too: kernels/native/tuning.py); the row kernel on the dense weight
 * otherwise: the choice ops.linear makes.
 * A projection with GGUF blocks (its *_blocks pointer) goes through block_quant_rows.c's kernels
 * (bfloat16 activations: block_quant_rows_bf16, float32: block_quant_rows) into float32, then the
 * bias is added and the sum rounded to the dtype: what ops.linear does for such a layer.
 *
 * `x` may be `residual` itself only when has_residual is 0 (the first layer: the residual stream
 * starts as the embeddings). decode_layers chains a model's layers in one call: x the embeddings,
 * which become the residual stream (updated in place), the layers' outputs alternating between
 * `spare` and `out`, the last one in `out`. scratch holds M * (H + qkv width + nh * hs + H +
 * 2 inner + inner) values of the dtype, then 64 bytes of alignment and M * 2 inner float32 values
 * (the block kernels' output).
 *
 * decode_step wraps decode_layers for a whole decode step from token ids to the final norm: each
 * row's embedding copied into `residual` (rows of a dense table of the layers' dtype, [vocab, H]),
 * the layers, then the final RMSNorm of residual + the last layer's output into `out` (residual
 * updated): what the model's forward does around the layers when every row of the step samples.
 * It returns 0, having done nothing, when a token id is outside the table. */
#include "common.h"
#include "pagedserve_cpu.h"

#define DENSE_MAX_ROWS 2 /* kernels/linear/native_rows.py MAX_ROWS: the row kernel's rows beside panels */

static void linear(int32_t dtype, const struct block_linear *blocks, const void *panels, float *f32, const void *x,
                   const void *w, const void *bias, void *y, int64_t M, int64_t N, int64_t K) {
    if (panels && dtype == DTYPE_BF16 && (M > DENSE_MAX_ROWS || !w)) {
        panel_linear_bf16(x, panels, bias, y, M, N, K);
        return;
    }
    if (blocks) {
        if (dtype == DTYPE_BF16)
            block_quant_rows_bf16(x, blocks->qs, blocks->scales, blocks->mins, f32, M, N, K, (int32_t)blocks->bits);
        else
            block_quant_rows(x, blocks->qs, blocks->scales, blocks->mins, f32, M, N, K, (int32_t)blocks->bits);
        for (int64_t i = 0; i < M * N; i++) {
            float v = f32[i];
            if (bias) v += load_elem(bias, i % N, dtype);
            store_elem(y, i, v, dtype);
        }
        return;
    }
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
    char *end = act + M * lw->inner * size;
    float *f32 = (float *)(end + (64 - (uintptr_t)end % 64) % 64);
    int32_t dtype = lw->dtype;
    if (!has_residual) residual = x;
    add_rms_norm(x, has_residual ? residual : NULL, lw->norm1, normed, M, H, lw->eps, dtype, has_residual);
    linear(dtype, lw->qkv_blocks, lw->qkv_panels, f32, normed, lw->w_qkv, lw->b_qkv, qkv, M, qkv_width, H);
    rotary_write_kv(qkv, st->cos_sin, st->positions, st->slot_mapping, lw->key_cache, lw->value_cache, M,
                    lw->num_heads, lw->num_kv_heads, hs, qkv_width, lw->num_slots, dtype, lw->cache_dtype);
    paged_decode_attention(qkv, qkv_width, attn, q_width, lw->key_cache, lw->value_cache, st->block_tables,
                           st->max_blocks, st->seq_lens, st->query_start_loc, st->seqs, M, lw->num_heads,
                           lw->num_kv_heads, hs, lw->block_size, lw->scale, lw->sliding_window, 1.0f, dtype,
                           lw->cache_dtype);
    linear(dtype, lw->o_blocks, lw->o_panels, f32, attn, lw->w_o, lw->b_o, o, M, H, q_width);
    add_rms_norm(o, residual, lw->norm2, normed, M, H, lw->eps, dtype, 1);
    linear(dtype, lw->gate_up_blocks, lw->gate_up_panels, f32, normed, lw->w_gate_up, lw->b_gate_up, gate_up, M, 2 * lw->inner, H);
    silu_mul(gate_up, act, M, lw->inner, 2 * lw->inner, dtype);
    linear(dtype, lw->down_blocks, lw->down_panels, f32, act, lw->w_down, lw->b_down, out, M, H, lw->inner);
}

void decode_layers(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st, void *x,
                   void *out, void *spare, void *scratch) {
    void *outputs[2] = {out, spare}; /* the last layer writes out: layer i writes outputs[(n - 1 - i) % 2] */
    void *input = x;
    for (int64_t i = 0; i < num_layers; i++) {
        void *output = outputs[(num_layers - 1 - i) & 1];
        decode_layer(layers[i], st, input, x, i > 0, output, scratch);
        input = output;
    }
}

int32_t decode_step(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st,
                    const int64_t *token_ids, const void *embedding, int64_t vocab, const void *final_norm,
                    float eps, void *residual, void *out, void *spare, void *scratch) {
    const int64_t M = st->num_rows, H = layers[0]->hidden;
    const int64_t row_bytes = H * (layers[0]->dtype == DTYPE_BF16 ? 2 : 4);
    for (int64_t i = 0; i < M; i++)
        if (token_ids[i] < 0 || token_ids[i] >= vocab) return 0;
    for (int64_t i = 0; i < M; i++)
        memcpy((char *)residual + i * row_bytes, (const char *)embedding + token_ids[i] * row_bytes,
               (size_t)row_bytes);
    decode_layers(layers, num_layers, st, residual, out, spare, scratch);
    /* out is also the norm's input: rms_norm.c reads x only while adding it to the residual */
    add_rms_norm(out, residual, final_norm, out, M, H, eps, layers[0]->dtype, 1);
    return 1;
}
