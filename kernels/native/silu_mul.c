/* SiLU-and-multiply of a fused gate/up projection; torch reference: kernels/layer/reference.py silu_mul.
 *
 * gate_up [T, stride] holds gate in columns [0, inner) and up in [inner, 2 inner); out [T, inner]:
 *   out = round(round(silu(gate)) * up),   silu(g) = g / (1 + exp(-g))
 * each product rounded to dtype, as torch's silu followed by mul rounds. exp is common.h's
 * polynomial (vectorised; torch uses another approximation of the same accuracy), its argument
 * capped at 88 (exp(88) ~ 1.6e38: below g = -88 the result is a tiny negative number, not the
 * denormal torch computes). */
#include "common.h"
#include "pagedserve_cpu.h"

void silu_mul(const void *gate_up, void *out, int64_t T, int64_t inner, int64_t stride, int32_t dtype) {
#pragma omp parallel for schedule(static) if (T * inner >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
#pragma omp simd
        for (int64_t i = 0; i < inner; i++) {
            float g = load_elem(gate_up, t * stride + i, dtype);
            float up = load_elem(gate_up, t * stride + inner + i, dtype);
            float silu = round_to(g / (1.0f + exp_poly(-g < 88.0f ? -g : 88.0f)), dtype);
            store_elem(out, t * inner + i, silu * up, dtype);
        }
    }
}
