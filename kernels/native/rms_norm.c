/* RMSNorm with the residual add folded in; torch reference: kernels/layer/reference.py add_rms_norm.
 *
 * For each of the T rows of width H (rows contiguous, row stride H):
 *   has_residual:  residual += x (rounded to dtype), then s = residual
 *   otherwise:     s = x
 *   out = round(round(s * rsqrt(mean(s^2) + eps)) * weight)
 * statistics in float32, the normalised row rounded to dtype before the weight multiplies it, as
 * torch's rms_norm (no weight) followed by mul_(weight) rounds. */
#include <math.h>

#include "common.h"
#include "pagedserve_cpu.h"

void add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H, float eps,
                  int32_t dtype, int32_t has_residual) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        int64_t row = t * H;
        void *src = has_residual ? residual : x;
        float sum = 0.0f;
        if (has_residual) {
            for (int64_t i = 0; i < H; i++) {
                float v = round_to(load_elem(residual, row + i, dtype) + load_elem(x, row + i, dtype), dtype);
                store_elem(residual, row + i, v, dtype);
            }
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) {
            float v = load_elem(src, row + i, dtype);
            sum += v * v;
        }
        float rstd = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t i = 0; i < H; i++) {
            float normed = round_to(load_elem(src, row + i, dtype) * rstd, dtype);
            store_elem(out, row + i, normed * load_elem(weight, i, dtype), dtype);
        }
    }
}
