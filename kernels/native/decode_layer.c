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
 * Layers in one parallel region. Between its projections a layer runs RMSNorm, rotary and attention,
 * SiLU-mul: at a few rows each runs on one thread, and with the projections each in its own parallel
 * region the other threads wait while the weights' stream stops (on AMD Zen 4, 2 vCPUs, at one row
 * of SmolLM2 in bfloat16: 19 us of a layer's 157, the projections reading 43-55 GB/s of 63). When
 * every such op of a step would run on the calling thread anyway and every projection is in panels,
 * decode_layers runs all the layers in one parallel region instead: thread 0 runs those ops while
 * each other thread reads the first bytes of its own share of the next projection's panels (its
 * first range of work_share.h, which it computes first), up to half its L2 cache, and stops when
 * thread 0 is done; then every thread takes its share of the projection (panel_linear.c's loop,
 * layer_team.h). No barrier closes a projection: each other thread counts its share done and goes on
 * to read ahead in the next projection, and thread 0 waits for that count before its ops read the
 * projection's output. The same kernels on the same data, each item of a projection computed whole
 * by one thread: the same bits as the chain. In-process at one sequence, the two paths alternated,
 * the layers ran 1.047x as fast in the host's wide bandwidth windows (72 -> 75.6 % of a plain
 * read's rate) and 1.03-1.04x in the narrow ones (docs/cpu-limits.md, "One stream: the layers in
 * one parallel region"); the count instead of two barriers per projection made the forward and LM
 * head at one sequence 1.013-1.048x as fast (docs/cpu-limits.md, "One stream: the ops between
 * projections, timed per thread"). decode_layers_overlapped() counts the calls that took this path.
 *
 * decode_step wraps decode_layers for a whole decode step from token ids to the final norm: each
 * row's embedding copied into `residual` (rows of a dense table of the layers' dtype, [vocab, H]),
 * the layers, then the final RMSNorm of residual + the last layer's output into `out` (residual
 * updated): what the model's forward does around the layers when every row of the step samples.
 * It returns 0, having done nothing, when a token id is outside the table. */
#define _GNU_SOURCE /* sysconf(_SC_LEVEL2_CACHE_SIZE) */
#include <omp.h>
#include <unistd.h>

#include "common.h"
#include "layer_team.h"
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

/* what a thread reads ahead while thread 0 runs a layer's one-thread ops: half this core's L2 cache,
 * so that the panel kernel's own working set stays beside it */
static int64_t read_ahead_limit(void) {
    static int64_t limit;
    int64_t value = __atomic_load_n(&limit, __ATOMIC_RELAXED);
    if (!value) {
        long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        value = l2 > 0 ? l2 / 2 : 256 * 1024;
        __atomic_store_n(&limit, value, __ATOMIC_RELAXED);
    }
    return value;
}

static int64_t overlapped_calls;

int64_t decode_layers_overlapped(void) { return __atomic_load_n(&overlapped_calls, __ATOMIC_RELAXED); }

/* 1 when decode_layers runs the layers in one region: bfloat16, every projection in panels (at up to
 * DENSE_MAX_ROWS rows only without the dense weight, as linear() chooses), at most 64 rows (one row
 * task per column block), several threads, and each one-thread op of every layer on one thread anyway */
static int in_one_region(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st) {
    const int64_t M = st->num_rows;
    if (M > 64 || omp_get_max_threads() < 2 || omp_in_parallel()) return 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct layer_weights *lw = layers[i];
        const int64_t qkv_width = (lw->num_heads + 2 * lw->num_kv_heads) * lw->head_size;
        if (lw->dtype != DTYPE_BF16 || !lw->qkv_panels || !lw->o_panels || !lw->gate_up_panels || !lw->down_panels)
            return 0;
        if (M <= DENSE_MAX_ROWS && (lw->w_qkv || lw->w_o || lw->w_gate_up || lw->w_down)) return 0;
        /* rms_norm.c, rotary_write_kv.c and silu_mul.c's parallel conditions */
        if (M * lw->hidden >= PARALLEL_MIN_ELEMENTS || M * qkv_width >= PARALLEL_MIN_ELEMENTS ||
            M * lw->inner >= PARALLEL_MIN_ELEMENTS)
            return 0;
    }
    return 1;
}

/* reads (one load per cache line) up to `bytes` from p, or until *done reaches phase */
static void read_ahead(const char *p, int64_t bytes, const int *done, int phase) {
    const int64_t limit = read_ahead_limit();
    uint64_t sink = 0;
    for (int64_t offset = 0; offset < (bytes < limit ? bytes : limit); offset += 64) {
        if (offset % 4096 == 0 && __atomic_load_n(done, __ATOMIC_ACQUIRE) >= phase) break;
        sink += *(volatile const uint64_t *)(p + offset);
    }
    __asm__ volatile("" : : "r"(sink));
}

/* thread 0, before it reads a projection's output: waits until each other thread has finished its
 * share of the team's `projections` projections so far */
static void wait_for_shares(const int64_t *finished, int64_t projections, int team) {
    while (__atomic_load_n(finished, __ATOMIC_ACQUIRE) < projections * (team - 1)) __builtin_ia32_pause();
}

/* inside the region: thread 0 waits for the other threads' shares of the projection before (their
 * count in `finished`), runs the ops (statements) and initialises `work` for the projection of N
 * columns over K inputs that follows; the others, done with their shares of the projection before,
 * read ahead in this one's panels and then wait for thread 0's ops; then the projection, shared out */
#define ONE_THREAD_THEN_PROJECTION(statements, panels, bias, input, output, N, K, work)                          \
    do {                                                                                                         \
        phase++;                                                                                                 \
        if (t == 0) {                                                                                            \
            wait_for_shares(&finished, phase - 1, team);                                                         \
            statements;                                                                                          \
            work_share_init_parts(work, panel_linear_tasks(M, N), team);                                        \
            __atomic_store_n(&done, phase, __ATOMIC_RELEASE);                                                    \
        } else {                                                                                                 \
            int64_t offset, bytes;                                                                               \
            panel_linear_first_bytes(M, N, K, t, team, &offset, &bytes);                                         \
            read_ahead((const char *)(panels) + offset, bytes, &done, phase);                                    \
            while (__atomic_load_n(&done, __ATOMIC_ACQUIRE) < phase) __builtin_ia32_pause();                     \
        }                                                                                                        \
        panel_linear_team((const uint16_t *)(input), panels, bias, (uint16_t *)(output), M, N, K, work);         \
        if (t != 0) __atomic_add_fetch(&finished, 1, __ATOMIC_RELEASE);                                          \
    } while (0)

static void layers_in_one_region(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st,
                                 void *x, void *out, void *spare, void *scratch) {
    void *outputs[2] = {out, spare}; /* as decode_layers: layer i writes outputs[(n - 1 - i) % 2] */
    const int64_t M = st->num_rows;
    struct work_share work;
    struct attention_call attention;
    int done = 0;         /* the phases whose one-thread ops thread 0 has run */
    int64_t finished = 0; /* the projection shares the other threads have finished */
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        int phase = 0;
        void *input = x;
        for (int64_t i = 0; i < num_layers; i++) {
            const struct layer_weights *lw = layers[i];
            void *output = outputs[(num_layers - 1 - i) & 1];
            const int has_residual = i > 0;
            const int64_t H = lw->hidden, hs = lw->head_size, inner = lw->inner, q_width = lw->num_heads * hs;
            const int64_t qkv_width = (lw->num_heads + 2 * lw->num_kv_heads) * hs;
            char *normed = scratch, *qkv = normed + M * H * 2, *attn = qkv + M * qkv_width * 2;
            char *o = attn + M * q_width * 2, *gate_up = o + M * H * 2, *act = gate_up + M * 2 * inner * 2;
            ONE_THREAD_THEN_PROJECTION(add_rms_norm(input, has_residual ? x : NULL, lw->norm1, normed, M, H, lw->eps,
                                                    DTYPE_BF16, has_residual),
                                       lw->qkv_panels, lw->b_qkv, normed, qkv, qkv_width, H, &work);
            if (paged_decode_attention_is_serial(st->seq_lens, st->seqs, M, lw->num_kv_heads, lw->sliding_window)) {
                ONE_THREAD_THEN_PROJECTION(
                    rotary_write_kv(qkv, st->cos_sin, st->positions, st->slot_mapping, lw->key_cache, lw->value_cache,
                                    M, lw->num_heads, lw->num_kv_heads, hs, qkv_width, lw->num_slots, DTYPE_BF16,
                                    lw->cache_dtype);
                    paged_decode_attention(qkv, qkv_width, attn, q_width, lw->key_cache, lw->value_cache,
                                           st->block_tables, st->max_blocks, st->seq_lens, st->query_start_loc,
                                           st->seqs, M, lw->num_heads, lw->num_kv_heads, hs, lw->block_size,
                                           lw->scale, lw->sliding_window, 1.0f, DTYPE_BF16, lw->cache_dtype),
                    lw->o_panels, lw->b_o, attn, o, H, q_width, &work);
            } else { /* a context long enough for attention to share its tasks: every thread takes some */
                if (t == 0) {
                    wait_for_shares(&finished, phase, team);
                    rotary_write_kv(qkv, st->cos_sin, st->positions, st->slot_mapping, lw->key_cache, lw->value_cache,
                                    M, lw->num_heads, lw->num_kv_heads, hs, qkv_width, lw->num_slots, DTYPE_BF16,
                                    lw->cache_dtype);
                    attention = (struct attention_call){qkv, qkv_width, attn, q_width, lw->key_cache, lw->value_cache,
                                                        st->block_tables, st->max_blocks, st->seq_lens,
                                                        st->query_start_loc, st->seqs, M, lw->num_heads,
                                                        lw->num_kv_heads, hs, lw->block_size, lw->scale,
                                                        lw->sliding_window, 1.0f, DTYPE_BF16, lw->cache_dtype};
                    attention_prepare(&attention);
                }
#pragma omp barrier
                attention_team(&attention);
                ONE_THREAD_THEN_PROJECTION(attention_release(&attention), lw->o_panels, lw->b_o, attn, o, H, q_width,
                                           &work);
            }
            ONE_THREAD_THEN_PROJECTION(add_rms_norm(o, x, lw->norm2, normed, M, H, lw->eps, DTYPE_BF16, 1),
                                       lw->gate_up_panels, lw->b_gate_up, normed, gate_up, 2 * inner, H, &work);
            ONE_THREAD_THEN_PROJECTION(silu_mul(gate_up, act, M, inner, 2 * inner, DTYPE_BF16), lw->down_panels,
                                       lw->b_down, act, output, H, inner, &work);
            input = output;
        }
    }
}

void decode_layers(const struct layer_weights **layers, int64_t num_layers, const struct step_rows *st, void *x,
                   void *out, void *spare, void *scratch) {
    if (in_one_region(layers, num_layers, st)) {
        __atomic_add_fetch(&overlapped_calls, 1, __ATOMIC_RELAXED);
        layers_in_one_region(layers, num_layers, st, x, out, spare, scratch);
        return;
    }
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
