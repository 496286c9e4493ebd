/* y = x @ w^T (+ bias) in bfloat16 for any number of rows, with w repacked once, at load, into
 * panels of 16 output columns; torch reference: kernels/linear/panels.py (panel_linear_ref: the
 * panels unpacked, then F.linear).
 *
 * Layout (panels.pack builds it in torch): panel j holds the output columns 16 j .. 16 j + 15 (zero
 * past N), K even. One 64-byte vector of a panel holds, for one pair of inputs (2p, 2p + 1), the
 * 16 columns' two weights side by side: the operand of an AVX-512 BF16 dot product (vdpbf16ps),
 * whose other operand is the pair x[m, 2p..2p+1] broadcast to every lane. Each lane then
 * accumulates its own output column over K in float32, so no horizontal sums are needed at the end.
 * The panels come in blocks of WIDTH (the last block may have fewer, P), the blocks one after
 * another; inside a block the vectors go pair by pair, the block's P panels' vectors of pair p side
 * by side: w[16 j + c, 2 p + e] is element ((p P + q) 16 + c) 2 + e of block j / WIDTH, q = j % WIDTH.
 * A register block thus reads its weights as one stream, in address order, and a thread's
 * contiguous range of tasks as one longer stream: what the hardware prefetchers follow best. With
 * the panels one after another instead (three streams per task, each restarting at every task),
 * SmolLM2's decode forward on AMD Zen 4 took, against this layout's time, 1.02-1.03x at one
 * sequence when the host's bandwidth was high and 0.97-0.99x when it was low, 1.04-1.06x at eight
 * either way, 1.0x at four and 32 (bench/forward_ab.py; the same logits).
 *
 * Register block: ROWS (8) rows of x times WIDTH (3) panels, 24 float32 accumulators; per pair of
 * inputs, 3 panel vectors and 8 broadcasts feed 24 dot products. The block walks K once; the
 * panels of one block of columns (3 x K x 32 bytes) stay in L2 while every row block of x passes
 * over them. The block fits any AVX-512 core's 32 vector registers; its shape (8 x 3 against 6 x 4,
 * 4 x 6, 12 x 2, 8 x 2) was chosen by timing on AMD Zen 4 only, and whether a host uses this kernel
 * at all is measured on the host (kernels/native/tuning.py). Work is split over the threads in
 * tasks of (block of columns, up to TASK_ROWS rows), each thread a contiguous range of tasks, so
 * the columns a thread owns stream from memory once; a thread through with its range takes tasks
 * from the back of another's (work_share.h).
 *
 * Prefetch: a task's first row block streams its panels from memory and waits on it; the later
 * full row blocks find them in L2 and compute. Meanwhile they prefetch the next column block's
 * panels into L2 (prefetcht1), each later block an equal share spread over its pairs, one to three
 * cache lines per pair, so that the next task's first row block finds its panels in L2 as well
 * and memory and arithmetic overlap. The shares follow from the block's geometry, not from a
 * timing; at 16 to 32 rows this ran SmolLM2's projections 6-11 % faster on AMD Zen 4 (the only CPU
 * it was timed on).
 * A task's first row block, which reads its panels from memory, may also prefetch each panel's
 * stream a distance ahead of its loads into L2: panel_linear_prefetch(R) bytes for a block of R
 * rows, 0 meaning the hardware prefetchers alone. The distances are measured per host at 1, 2, 4 and
 * 8 rows (kernels/native/tuning.py; on AMD Zen 4, with a block's panels stored one after another,
 * 1.5 KiB made one row's pass over SmolLM2's weights about 8 % faster and 2-3 KiB eight rows' about
 * 12 %; with them interleaved, one stream, its tuning kept none, and 0.5-3 KiB made the one-sequence
 * forward 0.95-0.99x as fast). A prefetch changes no result.
 *
 * Sums: float32 products of bfloat16 values added in another order than oneDNN's (the results
 * differ from F.linear in the last bits of some values); the bias (bfloat16) is added in float32
 * and the sum rounded to bfloat16 once, to nearest even, NaN kept, as torch rounds. The dot product
 * instruction counts denormal inputs as zero and flushes denormal products, as in linear_rows.c and
 * oneDNN's AVX-512 BF16 kernels. */
#include <immintrin.h>

#include "common.h"
#include "pagedserve_cpu.h"
#include "work_share.h"
#include "layer_team.h"

#define PANEL 16
#define ROWS 8
#define WIDTH 3
#define TASK_ROWS 64

/* bytes ahead of each panel's loads that a task's first block of R rows prefetches ([R], 0: none) */
static int64_t prefetch_bytes[ROWS + 1];

void panel_linear_set_prefetch(int64_t rows, int64_t bytes) {
    if (rows >= 1 && rows <= ROWS) prefetch_bytes[rows] = bytes > 0 ? bytes : 0;
}

int64_t panel_linear_prefetch(int64_t rows) { return rows >= 1 && rows <= ROWS ? prefetch_bytes[rows] : 0; }

#if defined(__AVX512BF16__)
/* R rows of x from row m, P panels from panel j: y[m.., 16 j ..]; with PF > 0 it also prefetches
 * PF cache lines per pair of inputs from pf into L2, up to pf_end, and with ahead > 0 each panel's
 * own stream that many bytes ahead (the module comment) */
static inline __attribute__((always_inline)) void block(const int R, const int P, const uint16_t *x, int64_t m,
                                                         const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                                                         int64_t j, int64_t N, int64_t K, const int PF,
                                                         const char *pf, const char *pf_end, int64_t ahead) {
    const int64_t pairs = K / 2, stride = pairs * 2 * PANEL;
    const uint16_t *w = panels + j * stride;
    __m512 acc[ROWS][WIDTH];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) acc[r][q] = _mm512_setzero_ps();
    const int32_t *xr[ROWS];
    for (int r = 0; r < R; r++) xr[r] = (const int32_t *)(x + (m + r) * K);
    for (int64_t p = 0; p < pairs; p++) {
        if (PF && pf < pf_end) {
            for (int l = 0; l < PF; l++) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
            pf += 64 * PF;
        }
        if (ahead)
            for (int q = 0; q < P; q++) _mm_prefetch((const char *)(w + (p * P + q) * 2 * PANEL) + ahead, _MM_HINT_T1);
        __m512bh wv[WIDTH];
        for (int q = 0; q < P; q++) wv[q] = (__m512bh)_mm512_loadu_si512(w + (p * P + q) * 2 * PANEL);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[r][p]);
            for (int q = 0; q < P; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xv, wv[q]);
        }
    }
    for (int q = 0; q < P; q++) {
        int64_t n0 = (j + q) * PANEL;
        __mmask16 mask = N - n0 >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1u);
        __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16))
                        : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm256_mask_storeu_epi16(y + (m + r) * N + n0, mask, f32x16_to_bf16(_mm512_add_ps(acc[r][q], b)));
    }
}

#define PREFETCHING_CASES(P)                                                                                      \
    switch (lines) {                                                                                              \
    case 1: block(ROWS, P, x, m, panels, bias, y, j, N, K, 1, pf, pf_end, 0); break;                              \
    case 2: block(ROWS, P, x, m, panels, bias, y, j, N, K, 2, pf, pf_end, 0); break;                              \
    default: block(ROWS, P, x, m, panels, bias, y, j, N, K, 3, pf, pf_end, 0); break;                             \
    }

#define ROW_CASES(P)                                                                                              \
    if (lines) {                                                                                                  \
        PREFETCHING_CASES(P)                                                                                      \
    } else switch (R) {                                                                                           \
    case 1: block(1, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 2: block(2, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 3: block(3, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 4: block(4, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 5: block(5, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 6: block(6, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    case 7: block(7, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                             \
    default: block(8, P, x, m, panels, bias, y, j, N, K, 0, NULL, NULL, ahead); break;                            \
    }

int64_t panel_linear_tasks(int64_t M, int64_t N) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, column_blocks = (num_panels + WIDTH - 1) / WIDTH;
    return column_blocks * ((M + TASK_ROWS - 1) / TASK_ROWS);
}

void panel_linear_team(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, struct work_share *work) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t row_tasks = (M + TASK_ROWS - 1) / TASK_ROWS;
    struct work_cursor cursor = work_cursor_start();
    int64_t task;
    while (work_next(work, &cursor, 1, &task)) {
        const int64_t j = task / row_tasks * WIDTH, P = num_panels - j < WIDTH ? num_panels - j : WIDTH;
        const int64_t first = task % row_tasks * TASK_ROWS, last = first + TASK_ROWS < M ? first + TASK_ROWS : M;
        /* the next column block's panels, prefetched by the last row task of this one: the block after
         * this one, or before it where the thread takes another's range from the back */
        const int64_t next_j = cursor.backwards ? j - WIDTH : j + WIDTH;
        const int64_t next_P = num_panels - next_j < WIDTH ? num_panels - next_j : WIDTH;
        const int64_t last_row_task = cursor.backwards ? 0 : row_tasks - 1;
        const int64_t next_bytes = next_j >= 0 && next_j < num_panels && task % row_tasks == last_row_task
                                       ? next_P * K * PANEL * (int64_t)sizeof(uint16_t) : 0;
        const char *next = next_bytes ? (const char *)(panels + next_j * K * PANEL) : NULL;
        const int64_t later = (last - first) / ROWS - 1; /* full row blocks after the first */
        const int64_t share = later > 0 ? (next_bytes + later - 1) / later : 0;
        for (int64_t m = first; m < last; m += ROWS) {
            const int64_t R = last - m < ROWS ? last - m : ROWS, b = (m - first) / ROWS;
            const char *pf = NULL, *pf_end = NULL;
            const int64_t ahead = b == 0 ? prefetch_bytes[R] : 0; /* the first block reads from memory */
            int64_t lines = 0; /* per pair: 1-3 (share <= 3 panels' bytes, spread over K / 2 pairs) */
            if (b > 0 && R == ROWS && share > 0) {
                const int64_t from = (b - 1) * share, to = from + share < next_bytes ? from + share : next_bytes;
                if (to > from) {
                    pf = next + from, pf_end = next + to;
                    lines = ((to - from + 63) / 64 + K / 2 - 1) / (K / 2);
                }
            }
            if (P == 3) {
                ROW_CASES(3)
            } else if (P == 2) {
                ROW_CASES(2)
            } else {
                ROW_CASES(1)
            }
        }
    }
}

void panel_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K) {
    const int64_t tasks = panel_linear_tasks(M, N);
    struct work_share work;
    work_share_init(&work, tasks);
#pragma omp parallel if (tasks > 1 && M * N * K >= 16 * PARALLEL_MIN_ELEMENTS)
    panel_linear_team(x, panels, bias, y, M, N, K, &work);
}

int32_t panel_linear_available(void) { return 1; }

void panel_linear_first_bytes(int64_t M, int64_t N, int64_t K, int part, int parts, int64_t *offset, int64_t *bytes) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    int64_t begin, end;
    work_share_part(panel_linear_tasks(M, N), part, parts, &begin, &end);
    *offset = *bytes = 0;
    if (M > TASK_ROWS || end <= begin) return; /* one row task per column block: task j is block j */
    const int64_t last_panel = end * WIDTH < num_panels ? end * WIDTH : num_panels;
    *offset = begin * WIDTH * K * PANEL * (int64_t)sizeof(uint16_t);
    *bytes = (last_panel - begin * WIDTH) * K * PANEL * (int64_t)sizeof(uint16_t);
}
#else
void panel_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K) {
    (void)x, (void)panels, (void)bias, (void)y, (void)M, (void)N, (void)K;
}

int32_t panel_linear_available(void) { return 0; } /* no AVX-512 BF16: the callers keep oneDNN */

/* never called without panels, which this host cannot have */
int64_t panel_linear_tasks(int64_t M, int64_t N) { return (void)M, (void)N, 0; }

void panel_linear_team(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, struct work_share *work) {
    (void)x, (void)panels, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)work;
}

void panel_linear_first_bytes(int64_t M, int64_t N, int64_t K, int part, int parts, int64_t *offset, int64_t *bytes) {
    (void)M, (void)N, (void)K, (void)part, (void)parts;
    *offset = *bytes = 0;
}
#endif
