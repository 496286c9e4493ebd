/* A decode run's later steps in one call: what the worker's Python does between the steps of a
 * run (worker/decode_run.py DecodeRun, NativeDecodeRun.set_rows and step, the bound greedy
 * kernel), without returning to Python after each step. Its reference is that Python loop, which
 * calls the same three kernels on the same buffers: tests/worker/test_decode_run.py compares the two
 * bit for bit.
 *
 * Per step, in the Python loop's order:
 *   - the message check (run->poll, the worker's `zmq_poll` on its plan socket, or NULL): a waiting
 *     message (a request arrived or left, EndRun) or a failed check ends the run before the step;
 *   - a fed token in run->end_tokens (EOS, stop tokens) ends it: that sequence may have ended;
 *   - each row's next position must lie in its blocks and the rotary table, or the run ends with
 *     nothing written;
 *   - each row's token, position, slot and length are written into the arrays the step's rows
 *     point to, as set_rows writes them;
 *   - decode_step (the embedding, the layers, the final norm: 0 for a token outside the table,
 *     which ends the run), the LM head (bfloat16: panels, rows or GGUF blocks, whose float32 output
 *     is rounded into the bfloat16 logits as torch's copy rounds it; float32: GGUF blocks straight
 *     into the float32 logits), then greedy_rows over the logits.
 * The forward's time (decode_step and the head, as the Python loop times them) is kept per step.
 * A message check is a plain function call here, so the run ends after the same step as the
 * Python loop would for a message that is already waiting. */
#define _POSIX_C_SOURCE 200809L
#include <time.h>

#include "common.h"
#include "pagedserve_cpu.h"

typedef int (*poll_fn)(void *items, int count, long timeout);

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int is_end_token(const struct decode_run *run, const int64_t *tokens, int64_t M) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t e = 0; e < run->num_end_tokens; e++)
            if (tokens[r] == run->end_tokens[e]) return 1;
    return 0;
}

/* float32 rows [M, N] rounded into bfloat16 [M, N] (f32_to_bf16's rounding: torch's for every
 * value but a NaN's payload, which greedy_rows reads as any NaN) */
static void round_rows(const float *src, uint16_t *dst, int64_t count) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), f32x16_to_bf16(_mm512_loadu_ps(src + i)));
#endif
    for (; i < count; i++) dst[i] = f32_to_bf16(src[i]);
}

static void lm_head(const struct decode_run *run, int64_t M) {
    switch (run->head_kind) {
    case 0:
        panel_linear_bf16(run->hidden, run->head_weight, run->head_bias, run->logits, M, run->head_out, run->head_in);
        break;
    case 1:
        linear_rows_bf16(run->hidden, run->head_weight, run->head_bias, run->logits, M, run->head_out, run->head_in);
        break;
    case 2:
        block_quant_rows_bf16(run->hidden, run->head_weight, run->head_scales, run->head_mins, run->head_out32, M,
                              run->head_out, run->head_in, (int32_t)run->head_bits);
        round_rows(run->head_out32, run->logits, M * run->head_out);
        break;
    default: /* float32 hidden states and logits */
        block_quant_rows(run->hidden, run->head_weight, run->head_scales, run->head_mins, run->logits, M,
                         run->head_out, run->head_in, (int32_t)run->head_bits);
    }
}

int64_t decode_run_steps(const struct decode_run *run, const int64_t *fed, int64_t num_steps, int64_t *ids,
                         float *logprobs, int64_t *nanoseconds) {
    const struct step_rows *st = run->rows;
    const int64_t M = st->num_rows, size = run->block_size;
    /* the arrays the step's rows point to, written between steps as set_rows writes them */
    int64_t *positions = (int64_t *)st->positions, *slots = (int64_t *)st->slot_mapping;
    int32_t *seq_lens = (int32_t *)st->seq_lens;
    poll_fn poll = NULL;
    if (run->poll != NULL) memcpy(&poll, &run->poll, sizeof poll);
    const int64_t *tokens = fed;
    int64_t step = 0;
    for (; step < num_steps; step++) {
        if (poll != NULL && poll(run->poll_item, 1, 0) != 0) break;
        if (is_end_token(run, tokens, M)) break;
        int inside = 1;
        for (int64_t r = 0; r < M; r++) {
            const int64_t p = positions[r] + 1;
            inside &= p >= 0 && p < run->limit && p < run->table_lens[r] * size;
        }
        if (!inside) break;
        for (int64_t r = 0; r < M; r++) {
            const int64_t p = positions[r] + 1;
            run->token_ids[r] = tokens[r];
            positions[r] = p;
            slots[r] = (int64_t)st->block_tables[r * st->max_blocks + p / size] * size + p % size;
            seq_lens[r] = (int32_t)(p + 1);
        }
        const int64_t started = now_ns();
        if (!decode_step(run->layers, run->num_layers, st, run->token_ids, run->embedding, run->vocab,
                         run->final_norm, run->eps, run->residual, run->hidden, run->spare, run->scratch))
            break;
        lm_head(run, M);
        nanoseconds[step] = now_ns() - started;
        greedy_rows(run->logits, M, run->logits_vocab, run->logits_stride, (int32_t)run->logits_dtype, run->ids,
                    run->logprobs);
        memcpy(ids + step * M, run->ids, (size_t)M * sizeof *ids);
        memcpy(logprobs + step * M, run->logprobs, (size_t)M * sizeof *logprobs);
        tokens = ids + step * M;
    }
    return step;
}
