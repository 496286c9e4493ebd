/* The interface of the native kernel library (libpagedserve_cpu.so, built by library.py): every
 * exported function and every structure passed across it. Each .c file includes this header, so
 * the compiler checks the definitions against it; the Python side (library.SIGNATURES and
 * RESTYPES, the ctypes structures and DTYPE_CODES in abi.py) is checked against it by
 * tests/kernels/test_native_header.py, which parses this file.
 *
 * The test's parser reads a restricted C: block comments, preprocessor lines, one enum of
 * `NAME = value` constants, structs whose members are `type name;` or `type *a, *b;`, and
 * prototypes `return_type name(type name, ...);` (or `(void)`), with the types void, float,
 * int32_t, int64_t, uint16_t, pointers to them and pointers to the structs here, `const` allowed.
 * Keep to that when adding a function. */
#ifndef PAGEDSERVE_CPU_H
#define PAGEDSERVE_CPU_H

#include <stdint.h>

/* The `dtype` and `cache_dtype` arguments and fields (abi.DTYPE_CODES). */
enum pagedserve_dtype { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* A linear layer's GGUF blocks as the file has them (block_quant_rows.c): codes, float16 scales,
 * float16 minimums (4 bits) or NULL (8 bits). */
struct block_linear {
    const void *qs, *scales, *mins;
    int64_t bits;
};

/* One decoder layer's weights and KV cache (decode_layer). A projection whose blocks pointer is
 * not NULL is multiplied by its GGUF blocks (its dense w_ pointer is then NULL). */
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
    const struct block_linear *qkv_blocks, *o_blocks, *gate_up_blocks, *down_blocks; /* or NULL: dense */
    const void *qkv_panels, *o_panels, *gate_up_panels, *down_panels; /* bfloat16 panels (panel_linear.c) or NULL */
};

/* One decode step's rows, shared by every layer of the step (decode_layer). */
struct step_rows {
    const void *cos_sin;                     /* [P, 2 hs] */
    const int64_t *positions, *slot_mapping; /* [M] */
    const int32_t *block_tables;             /* [M, max_blocks]: row i is sequence i's table */
    const int32_t *seq_lens;                 /* [M] */
    const int32_t *query_start_loc;          /* [M + 1]: 0, 1, ..., M */
    const int64_t *seqs;                     /* [M]: 0, 1, ..., M - 1 */
    int64_t num_rows, max_blocks;
};

/* rms_norm.c */
void add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H, float eps,
                  int32_t dtype, int32_t has_residual);

/* rotary_write_kv.c */
void rotary_write_kv(void *qkv, const void *cos_sin, const int64_t *positions, const int64_t *slot_mapping,
                     void *key_cache, void *value_cache, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_size, int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype);

/* greedy.c: per logits row the first index of its largest value and that token's log probability */
void greedy_rows(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int32_t dtype, int64_t *ids,
                 float *logprobs);

/* silu_mul.c */
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t inner, int64_t stride, int32_t dtype);

/* linear_rows.c */
void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K);
int32_t linear_rows_available(void);
void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K);
int32_t linear_rows_f32_available(void);
void linear_rows_set_prefetch(int64_t bytes);
int64_t linear_rows_prefetch(void);

/* panel_linear.c: bfloat16 x @ w^T with w in 16-column panels of input pairs (kernels/linear/panels.py) */
void panel_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K);
int32_t panel_linear_available(void);
void panel_linear_set_prefetch(int64_t rows, int64_t bytes);
int64_t panel_linear_prefetch(int64_t rows);

/* block_quant_rows.c: GGUF Q4_0/Q4_1/Q8_0 blocks (codes, float16 scales and minimums) at 1-32 rows */
void block_quant_rows(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y, int64_t M,
                      int64_t N, int64_t K, int32_t bits);
int32_t block_quant_rows_available(void);
void block_quant_rows_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                           int64_t M, int64_t N, int64_t K, int32_t bits);
int32_t block_quant_rows_bf16_available(void);
int32_t block_quant_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, void *out, int64_t N,
                               int64_t K, int32_t bits, int32_t dtype);
void block_quant_set_prefetch(int64_t bytes);
int64_t block_quant_prefetch(void);

/* decode_layer.c */
void decode_layer(const struct layer_weights *lw, const struct step_rows *st, void *x, void *residual,
                  int32_t has_residual, void *out, void *scratch);
void decode_layers(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st, void *x,
                   void *out, void *spare, void *scratch);
int64_t decode_layers_overlapped(void); /* the calls of decode_layers that ran its layers in one region */
int32_t decode_step(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st,
                    const int64_t *token_ids, const void *embedding, int64_t vocab, const void *final_norm,
                    float eps, void *residual, void *out, void *spare, void *scratch);

/* decode_run.c: a decode run's later steps in one call (worker/decode_run.py runs them one by one:
 * its reference). head_kind 0: panel_linear_bf16 (head_weight the panels), 1: linear_rows_bf16,
 * 2: block_quant_rows_bf16 (head_weight the codes, head_scales, head_mins) into head_out32, then
 * rounded into the bfloat16 logits [M, logits_stride]. poll: a function int (void *items, int count,
 * long timeout) called as poll(poll_item, 1, 0) before each step (non-zero ends the run), or NULL. */
struct decode_run {
    const struct layer_weights **layers;
    const struct step_rows *rows;
    int64_t *token_ids;
    const void *embedding, *final_norm;
    void *residual, *hidden, *spare, *scratch;
    const int64_t *table_lens;
    const void *head_weight, *head_bias, *head_scales, *head_mins;
    float *head_out32;
    void *logits;
    int64_t *ids;
    float *logprobs;
    const int64_t *end_tokens;
    const void *poll;
    void *poll_item;
    int64_t num_layers, vocab, head_kind, head_out, head_in, head_bits, logits_vocab, logits_stride, logits_dtype;
    int64_t num_end_tokens, block_size, limit;
    float eps;
};
/* the steps computed (up to num_steps), feeding `fed` [M] to the first: ids and logprobs
 * [steps, M], nanoseconds [steps] of each step's forward and head */
int64_t decode_run_steps(const struct decode_run *run, const int64_t *fed, int64_t num_steps, int64_t *ids,
                         float *logprobs, int64_t *nanoseconds);

/* decode_attention.c */
void paged_decode_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *key_cache,
                            const void *value_cache, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, float scale, int32_t sliding_window, float v_scale, int32_t dtype,
                            int32_t cache_dtype);

/* prefill_attention.c: 1 when done, 0 when not (no AVX-512 BF16, an unsupported shape, no memory) */
int32_t prefill_attention_available(void);
int32_t paged_prefill_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride,
                                const void *key_cache, const void *value_cache, const int32_t *block_tables,
                                int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start_loc,
                                const int64_t *seqs, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_size, int64_t block_size, float scale, int32_t sliding_window,
                                float v_scale);

#endif
