/* RoPE on the query and key heads of a fused QKV projection, in place, then the new K/V rows
 * written into their paged-cache slots; torch reference: kernels/layer/reference.py rotary_write_kv.
 *
 * qkv [T, stride]: query heads [0, nh * hs), key heads [nh * hs, (nh + kvh) * hs), value heads after.
 * cos_sin [P, 2 hs]: per position cos_full = [cos | cos] then sin_signed = [-sin | sin]
 * (pagedserve.worker.layers.rotary.RotaryEmbedding). For every query and key head x = [x1 | x2]:
 *   x <- round(round(x * cos_full) + round([x2 | x1] * sin_signed))
 * key_cache, value_cache [num_slots, kvh, hs] (a block is block_size consecutive slots): row t's
 * rotated key and its value go to slot slot_mapping[t]; a slot of -1 is skipped. The caches hold
 * the model's dtype or float32 (cache_dtype). With AVX-512, a bfloat16 row and cache whose heads are a
 * multiple of 32 values go 16 lanes at a time (the same operations and roundings: bit for bit). */
#include "common.h"
#include "pagedserve_cpu.h"

static void rotate_head(void *qkv, int64_t base, const void *cos_sin, int64_t table_row, int64_t hs, int dtype) {
    int64_t half = hs / 2;
    float x[512];
    for (int64_t i = 0; i < hs; i++) x[i] = load_elem(qkv, base + i, dtype);
    for (int64_t i = 0; i < hs; i++) {
        float cos = load_elem(cos_sin, table_row + i, dtype);
        float sin = load_elem(cos_sin, table_row + hs + i, dtype);
        float swapped = x[i < half ? i + half : i - half];
        float a = round_to(x[i] * cos, dtype);
        float b = round_to(swapped * sin, dtype);
        store_elem(qkv, base + i, a + b, dtype);
    }
}

#if defined(__AVX512F__)
/* bfloat16 heads of a multiple of 32 values (both halves whole vectors), 16 lanes at a time: the same
 * products, sums and roundings as rotate_head and the copy below (AVX-512 arithmetic rounds as the
 * scalar float arithmetic does, with contraction off) */
static inline void store16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, f32x16_to_bf16(v)); }

/* v rounded to bfloat16 and widened back: what a bfloat16 op leaves */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16));
}

static void rotate_head_bf16(uint16_t *head, const uint16_t *cos_sin_row, int64_t hs) {
    __m512 x[32];
    const int64_t n = hs / 16, half = n / 2;
    for (int64_t c = 0; c < n; c++) x[c] = bf16x16_to_f32(head + 16 * c);
    for (int64_t c = 0; c < n; c++) {
        const __m512 a = round16(_mm512_mul_ps(x[c], bf16x16_to_f32(cos_sin_row + 16 * c)));
        const __m512 b = round16(_mm512_mul_ps(x[(c + half) % n], bf16x16_to_f32(cos_sin_row + hs + 16 * c)));
        store16(head + 16 * c, _mm512_add_ps(a, b));
    }
}
#endif

/* row t: its heads rotated, its key and value written to its slot */
static void rotary_row(void *qkv, const void *cos_sin, int64_t position, int64_t slot, void *key_cache,
                       void *value_cache, int64_t t, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                       int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype) {
    const int64_t rotated_heads = num_heads + num_kv_heads, kv_width = num_kv_heads * head_size;
    const int64_t table_row = position * 2 * head_size;
#if defined(__AVX512F__)
    if (dtype == DTYPE_BF16 && cache_dtype == DTYPE_BF16 && head_size % 32 == 0 && head_size <= 512) {
        uint16_t *row = (uint16_t *)qkv + t * stride;
        for (int64_t h = 0; h < rotated_heads; h++)
            rotate_head_bf16(row + h * head_size, (const uint16_t *)cos_sin + table_row, head_size);
        if (slot < 0 || slot >= num_slots) return;
        const uint16_t *k = row + num_heads * head_size, *v = k + kv_width;
        uint16_t *kc = (uint16_t *)key_cache + slot * kv_width, *vc = (uint16_t *)value_cache + slot * kv_width;
        for (int64_t i = 0; i < kv_width; i += 16) { /* kv_width: a multiple of head_size */
            store16(kc + i, bf16x16_to_f32(k + i));
            store16(vc + i, bf16x16_to_f32(v + i));
        }
        return;
    }
#endif
    for (int64_t h = 0; h < rotated_heads; h++)
        rotate_head(qkv, t * stride + h * head_size, cos_sin, table_row, head_size, dtype);
    if (slot < 0 || slot >= num_slots) return;
    const int64_t k_base = t * stride + num_heads * head_size, v_base = k_base + kv_width;
    for (int64_t i = 0; i < kv_width; i++) {
        store_elem(key_cache, slot * kv_width + i, load_elem(qkv, k_base + i, dtype), cache_dtype);
        store_elem(value_cache, slot * kv_width + i, load_elem(qkv, v_base + i, dtype), cache_dtype);
    }
}

/* a few rows run on the calling thread without an OpenMP construct (a nested one, inside the layers'
 * parallel region, costs about half a microsecond) */
void rotary_write_kv(void *qkv, const void *cos_sin, const int64_t *positions, const int64_t *slot_mapping,
                     void *key_cache, void *value_cache, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_size, int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype) {
    if (T * stride < PARALLEL_MIN_ELEMENTS) {
        for (int64_t t = 0; t < T; t++)
            rotary_row(qkv, cos_sin, positions[t], slot_mapping[t], key_cache, value_cache, t, num_heads,
                       num_kv_heads, head_size, stride, num_slots, dtype, cache_dtype);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        rotary_row(qkv, cos_sin, positions[t], slot_mapping[t], key_cache, value_cache, t, num_heads, num_kv_heads,
                   head_size, stride, num_slots, dtype, cache_dtype);
}
