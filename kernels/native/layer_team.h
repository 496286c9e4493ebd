/* What decode_layer.c's layers in one parallel region (decode_layers) take from the other kernels:
 * a kernel's work for a team that is already running, and the conditions under which a kernel runs
 * on the calling thread alone. Internal to the library (hidden, not in pagedserve_cpu.h). */
#ifndef PAGEDSERVE_LAYER_TEAM_H
#define PAGEDSERVE_LAYER_TEAM_H

#include <stdint.h>

#include "work_share.h"

#define LAYER_TEAM_INTERNAL __attribute__((visibility("hidden")))

/* panel_linear.c: the tasks of y = x @ w^T over M rows and N columns, shared out by work_share.h */
LAYER_TEAM_INTERNAL int64_t panel_linear_tasks(int64_t M, int64_t N);
/* panel_linear_bf16's loop, run by every thread of the current team over `work` (initialised for
 * panel_linear_tasks(M, N) items and the team's size) */
LAYER_TEAM_INTERNAL void panel_linear_team(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                                           int64_t M, int64_t N, int64_t K, struct work_share *work);
/* the bytes of the panels that thread `part` of `parts` reads first, as one stream (its own range of
 * column blocks, M <= 64 rows): *offset from the panels' start, *bytes (0 above 64 rows) */
LAYER_TEAM_INTERNAL void panel_linear_first_bytes(int64_t M, int64_t N, int64_t K, int part, int parts,
                                                  int64_t *offset, int64_t *bytes);

/* decode_attention.c: one call of paged_decode_attention, its arguments (as pagedserve_cpu.h names
 * them) and then its tasks. attention_prepare fills the tasks (0: an allocation failed, nothing to
 * do); attention_team runs them, called by every thread of the current team (one thread outside a
 * region); attention_release frees them. paged_decode_attention is these three, in a region of
 * several threads where attention_is_parallel. */
struct attention_call {
    const void *query;
    int64_t q_stride;
    void *out;
    int64_t out_stride;
    const void *key_cache, *value_cache;
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *seq_lens, *query_start_loc;
    const int64_t *seqs;
    int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size;
    float scale;
    int32_t sliding_window;
    float v_scale;
    int32_t dtype, cache_dtype;
    /* attention_prepare's */
    int64_t *task_start, *partial_start;
    float *partials;
    int64_t tasks, merges, positions;
};

LAYER_TEAM_INTERNAL int attention_prepare(struct attention_call *a);
LAYER_TEAM_INTERNAL int attention_is_parallel(const struct attention_call *a);
LAYER_TEAM_INTERNAL void attention_team(const struct attention_call *a);
LAYER_TEAM_INTERNAL void attention_release(struct attention_call *a);
/* 1 when paged_decode_attention over these sequences runs on the calling thread */
LAYER_TEAM_INTERNAL int paged_decode_attention_is_serial(const int32_t *seq_lens, const int64_t *seqs,
                                                         int64_t num_seqs, int64_t num_kv_heads,
                                                         int32_t sliding_window);

#endif
