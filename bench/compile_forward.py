"""torch.compile (inductor, CPU) of SmolLM2's decoder layers against eager, interleaved in one process.

    python bench/compile_forward.py [--dtype bfloat16] [--seqs 1,32] [--eager-linears] [--threads 2]

Each decoder layer's forward is compiled with dynamic shapes (one compiled graph serves every
layer and batch size); paged attention stays eager behind a graph break (torch._dynamo.disable), as
its plan and dict-carrying metadata are not traceable. --eager-linears also leaves the linear layers
to eager: bfloat16's oneDNN-prepacked weights are opaque tensors that inductor cannot lower. Prints
the first call's time per batch size (the compile), then medians of eager and compiled forwards
(6 alternating rounds of 8) and the largest logit difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo

from lib.decode_steps import decode_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqs", default="1,32")
    parser.add_argument("--eager-linears", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.checkpoints.smollm2 import ensure_smollm2
    from pagedserve.worker.layers.attention import PagedAttention
    from pagedserve.worker.model_input import build_model_input
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.worker.quantization.linear import QuantizableLinear

    PagedAttention.forward = torch._dynamo.disable(PagedAttention.forward)
    if args.eager_linears:
        QuantizableLinear.matmul = torch._dynamo.disable(QuantizableLinear.matmul)
    seq_counts = [int(value) for value in args.seqs.split(",")]
    runner = ModelRunner(ensure_smollm2(), device="cpu", dtype=args.dtype, block_size=16)
    runner.load()
    scheduler = decode_scheduler(max(seq_counts))
    runner.init_cache(scheduler.config.num_gpu_blocks, 0)
    model = runner.model
    plan = scheduler.schedule().plan
    eager = [layer.forward for layer in model.layers]
    compiled = [torch.compile(layer.forward, dynamic=True) for layer in model.layers]

    def use(forwards) -> None:
        for layer, forward in zip(model.layers, forwards):
            layer.forward = forward

    def inputs_for(num_seqs: int):
        return build_model_input(plan.seqs[:num_seqs], block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                                 max_positions=model.max_positions, device=runner.device)

    with torch.inference_mode():
        use(compiled)
        started = time.perf_counter()
        for num_seqs in seq_counts:
            inputs = inputs_for(num_seqs)
            first = time.perf_counter()
            model.compute_logits(model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache))
            print(f"first compiled call, {num_seqs} seqs: {time.perf_counter() - first:.1f} s", flush=True)
        print(f"compile in all: {time.perf_counter() - started:.1f} s", flush=True)
        for num_seqs in seq_counts:
            inputs = inputs_for(num_seqs)
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            logits = {}
            for round_index in range(6):
                order = ("eager", "compiled") if round_index % 2 == 0 else ("compiled", "eager")
                for name in order:
                    use(eager if name == "eager" else compiled)
                    for _ in range(8):
                        begin = time.perf_counter()
                        logits[name] = model.compute_logits(model(inputs.token_ids, inputs.metadata,
                                                                  runner.cache.gpu_cache))
                        times[name].append(time.perf_counter() - begin)
            diff = (logits["eager"].float() - logits["compiled"].float()).abs().max().item()
            print(f"{args.dtype} {num_seqs} seqs: eager {statistics.median(times['eager']) * 1e3:.2f} ms, "
                  f"compiled {statistics.median(times['compiled']) * 1e3:.2f} ms, max logit diff {diff:.3g}")


if __name__ == "__main__":
    main()
