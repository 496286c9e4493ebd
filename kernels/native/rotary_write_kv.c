/* RoPE on the query and key heads of a fused QKV projection, in place, then the new K/V rows
 * written into their paged-cache slots; torch reference: kernels/layer/reference.py rotary_write_kv.
 *
 * qkv [T, stride]: query heads [0, nh * hs), key heads [nh * hs, (nh + kvh) * hs), value heads after.
 * cos_sin [P, 2 hs]: per position cos_full = [cos | cos] then sin_signed = [-sin | sin]
 * (pagedserve.worker.layers.rotary.RotaryEmbedding). For every query and key head x = [x1 | x2]:
 *   x <- round(round(x * cos_full) + round([x2 | x1] * sin_signed))
 * key_cache, value_cache [num_slots, kvh, hs] (a block is block_size consecutive slots): row t's
 * rotated key and its value go to slot slot_mapping[t]; a slot of -1 is skipped. The caches hold
 * the model's dtype or float32 (cache_dtype). */
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

void rotary_write_kv(void *qkv, const void *cos_sin, const int64_t *positions, const int64_t *slot_mapping,
                     void *key_cache, void *value_cache, int64_t T, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_size, int64_t stride, int64_t num_slots, int32_t dtype, int32_t cache_dtype) {
    int64_t rotated_heads = num_heads + num_kv_heads;
    int64_t kv_width = num_kv_heads * head_size;
#pragma omp parallel for schedule(static) if (T * stride >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        int64_t table_row = positions[t] * 2 * head_size;
        for (int64_t h = 0; h < rotated_heads; h++)
            rotate_head(qkv, t * stride + h * head_size, cos_sin, table_row, head_size, dtype);
        int64_t slot = slot_mapping[t];
        if (slot < 0 || slot >= num_slots) continue;
        int64_t k_base = t * stride + num_heads * head_size;
        int64_t v_base = k_base + kv_width;
        for (int64_t i = 0; i < kv_width; i++) {
            store_elem(key_cache, slot * kv_width + i, load_elem(qkv, k_base + i, dtype), cache_dtype);
            store_elem(value_cache, slot * kv_width + i, load_elem(qkv, v_base + i, dtype), cache_dtype);
        }
    }
}
