/* y = x @ W^T for GGUF's block-quantized weights kept as the file has them (Q4_0, Q4_1, Q8_0), at
 * 1 to BLOCK_QUANT_MAX_ROWS rows of x; torch reference: dequantize exactly, then one float32
 * matmul (kernels/linear/block_quant.py).
 *
 * Every group of 32 consecutive inputs of a weight row has a float16 scale d (and, for 4 bits, a
 * float16 minimum m), both as the file stores them:
 *
 *     4 bits   qs uint8 [N, K / 2]: byte j of a group holds value j (low nibble) and value j + 16
 *              (high nibble), as ggml's block_q4_0/block_q4_1;   w = q * d + m   (Q4_0: m = -8 d)
 *     8 bits   qs int8 [N, K]                                  w = q * d
 *
 * x float32 [M, K], y float32 [M, N]. Activations stay float32 (llama.cpp quantizes them to int8;
 * here they are not rounded at all). At 1-3 rows, per group the 32 products q * x are summed in
 * float32 (two 16-lane FMAs on the codes widened to float), scaled by d into 16 running lanes, and
 * the minimums add m * sum(x of the group) at the end; from DECODE_MIN_ROWS rows, weight rows are
 * decoded exactly to float32 in L1 and multiplied by FMAs (decoded_rows_f32). Either way the result
 * differs from the reference only in the order of float32 sums. bfloat16 activations
 * (block_quant_rows_bf16, AVX-512 BF16) meet the same exact weights at 1 to EXACT_ROWS rows, and
 * the weights decoded to bfloat16 above, at any number of rows (see there). The weight is read once per call, its rows
 * split over the threads in contiguous runs. On a CPU with AVX2 but not AVX-512, block_quant_rows_avx2.c has the
 * float32 paths, 8 lanes at a time. */
#include <immintrin.h>
#include <stdlib.h>

#include "common.h"
#include "pagedserve_cpu.h"
#include "work_share.h"

#define GROUP 32
#define BLOCK_QUANT_MAX_ROWS 32
#define ROW_CHUNK 4

/* How far ahead of the 4-bit codes the bfloat16 kernel's exact path prefetches, in bytes (0: the
 * hardware prefetchers alone); measured per host (kernels/native/tuning.py). On AMD Zen 4, without
 * it one thread read the codes at 12 GB/s, stalled on each new line: the loop does little work per
 * byte, and the hardware prefetchers do not run far enough ahead of it. */
static int64_t prefetch_bytes = 0;

void block_quant_set_prefetch(int64_t bytes) { prefetch_bytes = bytes > 0 ? bytes : 0; }

int64_t block_quant_prefetch(void) { return prefetch_bytes; }

#if defined(__AVX512F__) && defined(__F16C__)
static inline __m512 widen_u8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

static inline __m512 widen_i8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }

/* one weight row n against activation rows r0 .. r0 + R - 1 */
static inline __attribute__((always_inline)) void row_chunk(const int R, const int bits, const float *x,
                                                             const uint8_t *row, const uint16_t *d, int64_t r0,
                                                             int64_t K, float *sums) {
    __m512 acc[ROW_CHUNK];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t num_groups = K / GROUP;
    for (int64_t g = 0; g < num_groups; g++) {
        __m512 lo, hi;
        if (bits == 4) {
            __m128i packed = _mm_loadu_si128((const __m128i *)(row + g * (GROUP / 2)));
            __m128i mask = _mm_set1_epi8(0x0f);
            lo = widen_u8(_mm_and_si128(packed, mask));
            hi = widen_u8(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
        } else {
            lo = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP)));
            hi = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP + 16)));
        }
        __m512 scale = _mm512_set1_ps(_cvtsh_ss(d[g]));
        for (int r = 0; r < R; r++) {
            const float *xg = x + (r0 + r) * K + g * GROUP;
            __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xg));
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), t);
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

/* sum over groups of m[g] * group_sums[g] (the 4-bit minimums against the activations' group sums) */
static inline float min_terms(const uint16_t *m, const float *group_sums, int64_t num_groups) {
    __m512 acc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= num_groups; g += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g))),
                              _mm512_loadu_ps(group_sums + g), acc);
    float sum = _mm512_reduce_add_ps(acc);
    for (; g < num_groups; g++) sum += _cvtsh_ss(m[g]) * group_sums[g];
    return sum;
}

/* from DECODE_MIN_ROWS activation rows on, 4 weight rows at a time are decoded to float32 (exact:
 * q * d + m as gguf computes it) in L1 and multiplied 4 x 4 by FMAs, so the per-group scaling is
 * paid once per weight row rather than once per activation row */
#define DECODE_MIN_ROWS 4
#define DECODE_ROWS 4

/* group g of a weight row decoded exactly to float32: values 0-15 in lo, 16-31 in hi (q * d + m as
 * gguf computes it; q * d is exact in float32, so one rounding, as gguf's d * q + m) */
static inline __attribute__((always_inline)) void decode_group(const int bits, const uint8_t *row,
                                                                const uint16_t *d, const uint16_t *m, int64_t g,
                                                                __m512 *lo, __m512 *hi) {
    if (bits == 4) {
        const __m128i mask = _mm_set1_epi8(0x0f);
        __m128i packed = _mm_loadu_si128((const __m128i *)(row + g * (GROUP / 2)));
        *lo = widen_u8(_mm_and_si128(packed, mask));
        *hi = widen_u8(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    } else {
        *lo = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP)));
        *hi = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP + 16)));
    }
    __m512 scale = _mm512_set1_ps(_cvtsh_ss(d[g]));
    if (m) {
        __m512 offset = _mm512_set1_ps(_cvtsh_ss(m[g]));
        *lo = _mm512_fmadd_ps(*lo, scale, offset);
        *hi = _mm512_fmadd_ps(*hi, scale, offset);
    } else {
        *lo = _mm512_mul_ps(*lo, scale);
        *hi = _mm512_mul_ps(*hi, scale);
    }
}

static inline void decode_row_f32(const int bits, const uint8_t *row, const uint16_t *d, const uint16_t *m,
                                  float *out, int64_t K) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 lo, hi;
        decode_group(bits, row, d, m, g, &lo, &hi);
        _mm512_storeu_ps(out + g * GROUP, lo);
        _mm512_storeu_ps(out + g * GROUP + 16, hi);
    }
}


static inline __attribute__((always_inline)) void dot_rows_f32(const int MX, const float *x, const float *w, float *y,
                                                                int64_t m0, int64_t n0, int64_t nr, int64_t N,
                                                                int64_t K) {
    __m512 acc[DECODE_ROWS][DECODE_ROWS];
    for (int r = 0; r < MX; r++)
        for (int c = 0; c < DECODE_ROWS; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 xv[DECODE_ROWS];
        for (int r = 0; r < MX; r++) xv[r] = _mm512_loadu_ps(x + (m0 + r) * K + k);
        for (int64_t c = 0; c < nr; c++) {
            __m512 wv = _mm512_loadu_ps(w + c * K + k);
            for (int r = 0; r < MX; r++) acc[r][c] = _mm512_fmadd_ps(wv, xv[r], acc[r][c]);
        }
    }
    for (int r = 0; r < MX; r++)
        for (int64_t c = 0; c < nr; c++) y[(m0 + r) * N + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#include "block_quant_f32.h" /* one_row, decoded_rows_f32, block_quant_rows */

#if defined(__AVX512BF16__)
/* bfloat16 activations at 1 to EXACT_ROWS rows: the exact weights, as the float32 kernel multiplies
 * them (more rows, any number of them: decoded_panels_bf16 below). A code q (0..15, or -128..127) is exact in bfloat16 and so is each product q * x
 * in float32, so BF16 dot products give per group sum(q * x) in float32 lanes, which are scaled by
 * the file's d (float32), and the minimums add m * sum(x) per group: the exact weights against the
 * exact activations, differing from block_quant_linear_ref (kernels/linear/block_quant.py) only in
 * the order of float32 sums (no rounding of q * d + m to bfloat16, which the prefill path and
 * --quantization none have; llama.cpp instead rounds the activations to int8).
 *
 * 4 bits, per run of 4 groups: the 64 packed bytes, read as 32 words, give their 4 nibbles each
 * (shifts by 0, 4, 8 and 12) to a 32-entry table of bfloat16 values (one word permute per nibble);
 * the activations are copied once per call into the order that yields (order_activations_q4), so a
 * run takes four dot products per activation row into 16 lanes (4 per group), scaled by
 * [d_g x 4, .., d_g+3 x 4]. Two or three groups left over go as a pair the same way with widened
 * bytes (two dot products into 8 lanes per group), a last odd one alone. The codes are prefetched
 * block_quant_prefetch() bytes ahead (tuned per host). 8 bits: one group per dot product, the codes
 * widened to words and converted through float32 (a sign-aware table would need 256 entries), exact.
 * Each thread walks a contiguous run of weight rows (one stream of codes, as linear_rows.c);
 * activation rows are taken EXACT_ROWS at a time. */
#define EXACT_ROWS 8
#define MAX_GROUPS 256 /* K up to 8192 */

/* bfloat16 bit patterns of 0..15, twice: entry i is i & 15 (a word permute reads an index's low 5
 * bits, so the bit above a nibble needs no mask) */
static inline __m512i nibble_table(void) {
    return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                            0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                            0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

/* Activation order of the 4-bit kernel (block_quant_rows_bf16 copies x into it once per call): per
 * run of 4 groups (64 bytes of codes, read as 32 words), the 128 inputs as the word permutes of
 * exact_chunk_q4 produce their codes: word w holds bytes 2w and 2w + 1 of the run, and byte b holds
 * values b % 16 (low nibble) and b % 16 + 16 (high nibble) of group b / 16, so the four quarters are
 * [low nibble of byte 2w], [its high nibble], [low nibble of byte 2w + 1], [its high nibble] for w =
 * 0..31; then, when 2 or 3 groups remain, one pair of groups as [g 0-15, g+1 0-15], [g 16-31, g+1
 * 16-31]; then a last odd group in input order. */
static void order_activations_q4(const uint16_t *xr, uint16_t *out, int64_t K) {
    const int64_t num_groups = K / GROUP, num_runs = num_groups / 4;
    for (int64_t c = 0; c < num_runs; c++) {
        const uint16_t *xc = xr + c * 4 * GROUP;
        uint16_t *oc = out + c * 4 * GROUP;
        for (int w = 0; w < 32; w++)
            for (int half = 0; half < 2; half++) {
                const int b = 2 * w + half, value = b / 16 * GROUP + b % 16;
                oc[64 * half + w] = xc[value];
                oc[64 * half + 32 + w] = xc[value + 16];
            }
    }
    int64_t g = num_runs * 4;
    if (num_groups - g >= 2) {
        for (int j = 0; j < 16; j++) {
            out[g * GROUP + j] = xr[g * GROUP + j];
            out[g * GROUP + 16 + j] = xr[(g + 1) * GROUP + j];
            out[g * GROUP + 32 + j] = xr[g * GROUP + 16 + j];
            out[g * GROUP + 48 + j] = xr[(g + 1) * GROUP + 16 + j];
        }
        g += 2;
    }
    if (g < num_groups) memcpy(out + g * GROUP, xr + g * GROUP, 2 * GROUP);
}

/* weight row (4 bits) against activation rows r0 .. r0 + R - 1 (x_pairs: order_activations_q4's order) */
static inline __attribute__((always_inline)) void exact_chunk_q4(const int R, const uint16_t *x_pairs, int64_t r0,
                                                                  const uint8_t *row, const uint16_t *d,
                                                                  const uint16_t *m, const float *group_sums,
                                                                  float *sums, int64_t K) {
    const int64_t num_groups = K / GROUP, num_runs = num_groups / 4, num_pairs = num_groups / 2;
    const __m512i low_bits = _mm512_set1_epi16(0x0f), table = nibble_table();
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i quarters = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const int64_t distance = prefetch_bytes;
    __m512 acc[EXACT_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    /* runs of 4 groups: 64 bytes of codes as 32 words, whose 4 nibbles (shifts by 0, 4, 8, 12) are
     * turned into bfloat16 by one word permute each, 4 permutes for 128 codes where widening the
     * bytes first takes 6 (with the codes prefetched, 8 % faster at one row on Zen 4; without, the
     * loads bound both forms alike); lanes 4i..4i + 3 sum group g + i's products, scaled by
     * [d_g x 4, .., d_g+3 x 4] */
    for (int64_t c = 0; c < num_runs; c++) {
        if (distance) _mm_prefetch((const char *)(row + c * 2 * GROUP) + distance, _MM_HINT_T0);
        const __m512i words = _mm512_loadu_si512((const void *)(row + c * 2 * GROUP));
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(words, table);
        const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
        const __m512bh w2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table);
        const __m512bh w3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table);
        int64_t d4;
        memcpy(&d4, d + 4 * c, 8);
        const __m512 scale = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(d4))));
        for (int r = 0; r < R; r++) {
            const uint16_t *xp = x_pairs + (r0 + r) * K + c * 4 * GROUP;
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512((const void *)xp));
            t = _mm512_dpbf16_ps(t, w1, (__m512bh)_mm512_loadu_si512((const void *)(xp + 32)));
            t = _mm512_dpbf16_ps(t, w2, (__m512bh)_mm512_loadu_si512((const void *)(xp + 64)));
            t = _mm512_dpbf16_ps(t, w3, (__m512bh)_mm512_loadu_si512((const void *)(xp + 96)));
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
    }
    for (int64_t p = 2 * num_runs; p < num_pairs; p++) { /* one pair of groups left */
        __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + p * GROUP)));
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(codes, low_bits), table);
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
        int32_t d2;
        memcpy(&d2, d + 2 * p, 4);
        __m512 scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(d2))));
        for (int r = 0; r < R; r++) {
            const uint16_t *xp = x_pairs + (r0 + r) * K + p * 2 * GROUP;
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512((const void *)xp));
            t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512((const void *)(xp + 32)));
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
    }
    if (num_groups & 1) { /* the last group: values 0-15 then 16-31, in input order */
        const int64_t g = num_groups - 1;
        __m128i packed = _mm_loadu_si128((const __m128i *)(row + g * (GROUP / 2)));
        __m128i nibble = _mm_set1_epi8(0x0f);
        __m512bh w = (__m512bh)_mm512_permutexvar_epi16(
            _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble),
                                                  _mm_and_si128(packed, nibble))), table);
        __m512 scale = _mm512_set1_ps(_cvtsh_ss(d[g]));
        for (int r = 0; r < R; r++) {
            const uint16_t *xp = x_pairs + (r0 + r) * K + g * GROUP;
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512((const void *)xp));
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
    }
    /* the minimums: m * sum(x) per group, 16 groups at a time, into the same lanes */
    for (int64_t g = 0; g < num_groups; g += 16) {
        __mmask16 mask = num_groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (num_groups - g)) - 1u);
        __m512 mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + g));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(mins, _mm512_maskz_loadu_ps(mask, group_sums + (r0 + r) * num_groups + g),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

/* weight row (8 bits) against activation rows r0 .. r0 + R - 1 (x in input order) */
static inline __attribute__((always_inline)) void exact_chunk_q8(const int R, const uint16_t *x, int64_t r0,
                                                                  const uint8_t *row, const uint16_t *d, float *sums,
                                                                  int64_t K) {
    const int64_t num_groups = K / GROUP;
    __m512 acc[EXACT_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < num_groups; g++) {
        __m512 lo = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP)));
        __m512 hi = widen_i8(_mm_loadu_si128((const __m128i *)(row + g * GROUP + 16)));
        __m512bh w = _mm512_cvtne2ps_pbh(hi, lo); /* exact: |q| <= 128 */
        __m512 scale = _mm512_set1_ps(_cvtsh_ss(d[g]));
        for (int r = 0; r < R; r++) {
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), w,
                                        (__m512bh)_mm512_loadu_si512((const void *)(x + (r0 + r) * K + g * GROUP)));
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

static inline __attribute__((always_inline)) void exact_chunk(const int R, const int bits, const uint16_t *x,
                                                               int64_t r0, const uint8_t *row, const uint16_t *d,
                                                               const uint16_t *m, const float *group_sums,
                                                               float *sums, int64_t K) {
    if (bits == 4)
        exact_chunk_q4(R, x, r0, row, d, m, group_sums, sums, K);
    else
        exact_chunk_q8(R, x, r0, row, d, sums, K);
}

static inline __attribute__((always_inline)) void exact_row(const int bits, const uint16_t *x, const uint8_t *qs,
                                                             const uint16_t *d, const uint16_t *m,
                                                             const float *group_sums, float *y, int64_t n, int64_t M,
                                                             int64_t N, int64_t K) {
    const int64_t num_groups = K / GROUP;
    const uint8_t *row = qs + n * (bits == 4 ? K / 2 : K);
    const uint16_t *dn = d + n * num_groups, *mn = m ? m + n * num_groups : NULL;
    float sums[EXACT_ROWS];
    for (int64_t r0 = 0; r0 < M; r0 += EXACT_ROWS) {
        switch (M - r0 < EXACT_ROWS ? M - r0 : EXACT_ROWS) {
        case 1: exact_chunk(1, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 2: exact_chunk(2, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 3: exact_chunk(3, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 4: exact_chunk(4, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 5: exact_chunk(5, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 6: exact_chunk(6, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        case 7: exact_chunk(7, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        default: exact_chunk(8, bits, x, r0, row, dn, mn, group_sums, sums, K); break;
        }
        for (int64_t r = r0; r < M && r < r0 + EXACT_ROWS; r++) y[r * N + n] = sums[r - r0];
    }
}

/* a weight row decoded into bfloat16: q * d + m in float32 as gguf does, then rounded to nearest
 * even (the weights of the file dequantized to bfloat16, what the prefill path multiplies) */
static inline void decode_row_bf16(const int bits, const uint8_t *row, const uint16_t *d, const uint16_t *m,
                                   uint16_t *out, int64_t K) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 lo, hi;
        decode_group(bits, row, d, m, g, &lo, &hi);
        _mm512_storeu_si512((void *)(out + g * GROUP), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* from EXACT_ROWS + 1 rows on: the weights decoded into bfloat16 (rounded as decode_row_bf16 rounds
 * them, as the prefill path has them) and multiplied as panel_linear.c multiplies its panels. A
 * column block of PANEL_WIDTH panels of 16 weight rows is decoded row by row into a buffer of the
 * thread's, then laid out as panel_linear.c's panels (one vector per pair of inputs and panel: the
 * pair's two weights of each of the 16 rows side by side; a 16 x 16 transpose of 32-bit words per 16
 * pairs) in a second buffer (PANEL_WIDTH x K x 32 bytes, in L2), which every block of PANEL_ROWS
 * activation rows then walks once: per pair, PANEL_WIDTH panel vectors and PANEL_ROWS broadcasts of
 * the activations' pair feed PANEL_ROWS x PANEL_WIDTH BF16 dot products into float32 accumulators,
 * one output column per lane, so no horizontal sums and no activation reloads per weight row. The
 * decode is paid once per column block whatever the number of rows. Against the earlier kernel here
 * (4 weight rows decoded at a time, 4 x 4 dot products reduced across lanes), on AMD Zen 4 with 2
 * threads, SmolLM2's Q4_1 forward and LM head at 32 sequences took 0.77-0.88x the time (separate
 * processes alternated, each normalised by the bfloat16 forward it also ran), at 9 and 16 about
 * 0.96x; the sums are in another order, so the float32 outputs differ in their last bits. */
#define PANEL 16
#define PANEL_WIDTH 3
#define PANEL_ROWS 8

/* r[i] (16 32-bit words each) becomes column i of the 16 x 16 matrix whose rows they were */
static inline __attribute__((always_inline)) void transpose_16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4 j + k], 128-bit lane L: rows 4 j .. 4 j + 3 of column 4 L + k */
    for (int k = 0; k < 4; k++) {
        __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xee);
        __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44), e = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xee);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[8 + k] = _mm512_shuffle_i32x4(b, e, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(b, e, 0xdd);
    }
}

/* weight rows n0 .. n0 + nr - 1 (nr <= P x 16) decoded into `rows` [P x 16, K] (rows past nr zero),
 * then laid out in `panels` as panel_linear.c's block of P panels: the vector of pair p and panel q at
 * 32-bit word (p P + q) 16 */
static void decode_panels(const int bits, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t n0,
                          int64_t nr, int P, int64_t K, uint16_t *rows, uint16_t *panels) {
    const int64_t num_groups = K / GROUP, row_bytes = bits == 4 ? K / 2 : K;
    for (int64_t c = 0; c < P * PANEL; c++) {
        if (c < nr)
            decode_row_bf16(bits, qs + (n0 + c) * row_bytes, d + (n0 + c) * num_groups,
                            m ? m + (n0 + c) * num_groups : NULL, rows + c * K, K);
        else
            memset(rows + c * K, 0, sizeof(uint16_t) * K);
    }
    int32_t *out = (int32_t *)panels;
    for (int q = 0; q < P; q++)
        for (int64_t p0 = 0; p0 < K / 2; p0 += PANEL) {
            __m512i r[PANEL];
            for (int i = 0; i < PANEL; i++) r[i] = _mm512_loadu_si512((const void *)(rows + (q * PANEL + i) * K + 2 * p0));
            transpose_16x16(r);
            for (int i = 0; i < PANEL; i++) _mm512_store_si512((void *)(out + ((p0 + i) * P + q) * PANEL), r[i]);
        }
}
/* R activation rows from m against the P decoded panels: y[m.., n0 ..] in float32 */
static inline __attribute__((always_inline)) void panel_rows(const int R, const int P, const uint16_t *x, int64_t m,
                                                              const uint16_t *panels, float *y, int64_t n0, int64_t N,
                                                              int64_t K) {
    const int64_t pairs = K / 2;
    __m512 acc[PANEL_ROWS][PANEL_WIDTH];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) acc[r][q] = _mm512_setzero_ps();
    const int32_t *xr[PANEL_ROWS];
    for (int r = 0; r < R; r++) xr[r] = (const int32_t *)(x + (m + r) * K);
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[PANEL_WIDTH];
        for (int q = 0; q < P; q++) wv[q] = (__m512bh)_mm512_load_si512((const void *)(panels + (p * P + q) * 2 * PANEL));
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[r][p]);
            for (int q = 0; q < P; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xv, wv[q]);
        }
    }
    for (int q = 0; q < P; q++) {
        const int64_t n = n0 + q * PANEL;
        const __mmask16 mask = N - n >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1u);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (m + r) * N + n, mask, acc[r][q]);
    }
}
#define PANEL_ROW_CASES(P)                                                                                        \
    switch (R) {                                                                                                  \
    case 1: panel_rows(1, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 2: panel_rows(2, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 3: panel_rows(3, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 4: panel_rows(4, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 5: panel_rows(5, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 6: panel_rows(6, P, x, m0, panels, y, n0, N, K); break;                                                  \
    case 7: panel_rows(7, P, x, m0, panels, y, n0, N, K); break;                                                  \
    default: panel_rows(8, P, x, m0, panels, y, n0, N, K); break;                                                 \
    }
static void decoded_panels_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                                int64_t M, int64_t N, int64_t K, int32_t bits) {
    const int64_t block_rows = PANEL_WIDTH * PANEL, num_blocks = (N + block_rows - 1) / block_rows;
#pragma omp parallel if (N * K >= PARALLEL_MIN_ELEMENTS)
    {
        uint16_t *rows = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * block_rows * K);
        uint16_t *panels = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * block_rows * K);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks; b++) {
            if (!rows || !panels) continue;
            const int64_t n0 = b * block_rows, nr = N - n0 < block_rows ? N - n0 : block_rows;
            const int P = (int)((nr + PANEL - 1) / PANEL);
            decode_panels(bits, qs, d, m, n0, nr, P, K, rows, panels);
            for (int64_t m0 = 0; m0 < M; m0 += PANEL_ROWS) {
                const int64_t R = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
                if (P == 3) {
                    PANEL_ROW_CASES(3)
                } else if (P == 2) {
                    PANEL_ROW_CASES(2)
                } else {
                    PANEL_ROW_CASES(1)
                }
            }
        }
        free(rows);
        free(panels);
    }
}

/* the output rows over the threads (work_share.h), in chunks of about WORK_CHUNK_BYTES of codes */
#define FOR_EACH_EXACT_ROW(call)                                                                                   \
    FOR_EACH_SHARED_ITEM(n, N, work_chunk(bits == 4 ? K / 2 : K), N * K >= PARALLEL_MIN_ELEMENTS, call;)

/* block_quant_rows with x bfloat16 [M, K], the exact weights (above) */
void block_quant_rows_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                           int64_t M, int64_t N, int64_t K, int32_t bits) {
    const int64_t num_groups = K / GROUP;
    if (M > EXACT_ROWS || num_groups > MAX_GROUPS) {
        decoded_panels_bf16(x, qs, d, m, y, M, N, K, bits);
        return;
    }
    uint16_t *x_pairs = NULL;
    float *group_sums = NULL;
    if (bits == 4) {
        x_pairs = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * M * K);
        group_sums = (float *)malloc(sizeof(float) * M * num_groups);
        if (!x_pairs || !group_sums) {
            free(x_pairs);
            free(group_sums);
            return;
        }
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *xr = x + r * K;
            order_activations_q4(xr, x_pairs + r * K, K);
            for (int64_t g = 0; g < num_groups; g++) {
                float s = 0.0f;
                for (int j = 0; j < GROUP; j++) s += bf16_to_f32(xr[g * GROUP + j]);
                group_sums[r * num_groups + g] = s;
            }
        }
        FOR_EACH_EXACT_ROW(exact_row(4, x_pairs, qs, d, m, group_sums, y, n, M, N, K))
    } else {
        FOR_EACH_EXACT_ROW(exact_row(8, x, qs, d, m, NULL, y, n, M, N, K))
    }
    free(x_pairs);
    free(group_sums);
}

int32_t block_quant_rows_bf16_available(void) { return 1; }

/* the whole weight dequantized into out [N, K], float32 (dtype 0) or bfloat16 (dtype 1), with the
 * values BlockQuantWeight.dequantize(dtype) gives (q * d + m in float32, rounded to nearest even
 * for bfloat16): what the matmuls above 32 rows multiply by; 1, or 0 where this CPU has no kernel */
int32_t block_quant_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, void *out, int64_t N,
                               int64_t K, int32_t bits, int32_t dtype) {
    const int64_t num_groups = K / GROUP, row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_ELEMENTS)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *dn = d + n * num_groups, *mn = m ? m + n * num_groups : NULL;
        if (dtype == DTYPE_BF16)
            decode_row_bf16(bits, qs + n * row_bytes, dn, mn, (uint16_t *)out + n * K, K);
        else
            decode_row_f32(bits, qs + n * row_bytes, dn, mn, (float *)out + n * K, K);
    }
    return 1;
}
#else
void block_quant_rows_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                           int64_t M, int64_t N, int64_t K, int32_t bits) {
    (void)x, (void)qs, (void)d, (void)m, (void)y, (void)M, (void)N, (void)K, (void)bits;
}

int32_t block_quant_rows_bf16_available(void) { return 0; }

int32_t block_quant_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, void *out, int64_t N,
                               int64_t K, int32_t bits, int32_t dtype) {
    (void)qs, (void)d, (void)m, (void)out, (void)N, (void)K, (void)bits, (void)dtype;
    return 0;
}
#endif
#elif !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) /* AVX2: block_quant_rows_avx2.c */
void block_quant_rows(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y, int64_t M,
                      int64_t N, int64_t K, int32_t bits) {
    (void)x, (void)qs, (void)d, (void)m, (void)y, (void)M, (void)N, (void)K, (void)bits;
}

int32_t block_quant_rows_available(void) { return 0; } /* no AVX-512 nor AVX2: the callers dequantize in torch */

void block_quant_rows_bf16(const uint16_t *x, const uint8_t *qs, const uint16_t *d, const uint16_t *m, float *y,
                           int64_t M, int64_t N, int64_t K, int32_t bits) {
    (void)x, (void)qs, (void)d, (void)m, (void)y, (void)M, (void)N, (void)K, (void)bits;
}

int32_t block_quant_rows_bf16_available(void) { return 0; }

int32_t block_quant_dequantize(const uint8_t *qs, const uint16_t *d, const uint16_t *m, void *out, int64_t N,
                               int64_t K, int32_t bits, int32_t dtype) {
    (void)qs, (void)d, (void)m, (void)out, (void)N, (void)K, (void)bits, (void)dtype;
    return 0;
}
#endif
