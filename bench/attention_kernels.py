"""Kernel benchmark: paged decode attention against SDPA on the same data unpaged, and the KV-cache ops.

    python bench/attention_kernels.py [--device auto|cpu|cuda] [--quick] [--op-share] [--threads N]

The implementation timed is whatever pagedserve.kernels.ops dispatches to on the device (Triton
on CUDA, the plain-torch reference on CPU; PAGEDSERVE_KERNELS overrides). Every decode sequence
has the same context so that torch.nn.functional.scaled_dot_product_attention can run on the
identical K/V gathered into contiguous [batch, kv_heads, context, head_size] tensors.
Bandwidth counts the bytes a kernel must move at least (K and V read once, query read, output
written), so GB/s can be compared with the memory roofline. --op-share measures which part of a
Llama decode step RMSNorm and rotary embedding take (the case for fusing them). A table goes to
stdout and JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from lib.output import print_table, save_report, timestamp
from pagedserve.kernels import ops

GRIDS = {  # (decode batch sizes, context lengths)
    "cuda": ([1, 4, 16, 64, 256], [128, 512, 2048, 8192]),
    "cpu": ([1, 8, 32], [128, 1024, 4096]),
    "quick": ([1, 8], [128, 1024]),
}


def timed(fn, device: torch.device, min_seconds: float = 0.3, max_reps: int = 30) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3
    fn()
    samples: list[float] = []
    while len(samples) < max_reps and (len(samples) < 3 or sum(samples) < min_seconds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def decode_attention_row(args, batch: int, context: int, device: torch.device, dtype: torch.dtype) -> dict:
    nh, nkv, hs, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, bs, nkv, hs, device=device, dtype=dtype)  # [nb, bs, kvh, hs]
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()  # [B, nbps]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)  # [B]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)  # [B + 1]
    query = torch.randn(batch, nh, hs, device=device, dtype=dtype)  # [B, nh, hs]
    scale = hs ** -0.5

    def unpaged(cache):  # [nb, bs, kvh, hs] -> [B, kvh, context, hs], contiguous
        flat = cache[block_tables.long()].reshape(batch, blocks_per_seq * bs, nkv, hs)[:, :context]
        return flat.transpose(1, 2).contiguous()

    k, v = unpaged(key_cache), unpaged(value_cache)
    q = query.unsqueeze(2)  # [B, nh, 1, hs]

    def paged():
        return ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=nh != nkv)

    max_abs_diff = (paged().float() - sdpa().squeeze(2).float()).abs().max().item()
    paged_s, sdpa_s = timed(paged, device), timed(sdpa, device)
    moved = (2 * batch * context * nkv * hs + 2 * batch * nh * hs) * key_cache.element_size()
    return {"batch": batch, "context": context, "paged_ms": paged_s * 1e3, "paged_gbps": moved / paged_s / 1e9,
            "sdpa_ms": sdpa_s * 1e3, "sdpa_gbps": moved / sdpa_s / 1e9, "paged_over_sdpa": paged_s / sdpa_s,
            "max_abs_diff": max_abs_diff}


def cache_op_rows(args, device: torch.device, dtype: torch.dtype, batches: list[int]) -> list[dict]:
    nkv, hs, bs = args.num_kv_heads, args.head_size, args.block_size
    rows = []
    for num_tokens in batches:  # one new token per decode sequence
        key_cache = torch.zeros(num_tokens + 8, bs, nkv, hs, device=device, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(num_tokens, nkv, hs, device=device, dtype=dtype)  # [T, kvh, hs]
        slots = torch.randperm(key_cache.shape[0] * bs, device=device)[:num_tokens]  # [T]
        seconds = timed(lambda: ops.write_kv_cache(key, key, key_cache, value_cache, slots), device)
        moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
        rows.append({"op": "write_kv_cache", "size": f"{num_tokens} tokens", "ms": seconds * 1e3,
                     "gbps": moved / seconds / 1e9})
    num_layers = args.num_layers
    for num_pairs in (16, 256):
        key_caches = [torch.zeros(2 * num_pairs, bs, nkv, hs, device=device, dtype=dtype) for _ in range(num_layers)]
        value_caches = [torch.zeros_like(c) for c in key_caches]
        mapping = torch.stack([torch.arange(num_pairs), torch.arange(num_pairs, 2 * num_pairs)], 1).to(device)
        seconds = timed(lambda: ops.copy_blocks(key_caches, value_caches, mapping), device)
        moved = 2 * 2 * num_layers * num_pairs * key_caches[0][0].numel() * key_caches[0].element_size()
        rows.append({"op": "copy_blocks", "size": f"{num_pairs} blocks x {num_layers} layers", "ms": seconds * 1e3,
                     "gbps": moved / seconds / 1e9})
    if device.type == "cuda":
        gpu_cache = torch.randn(512, bs, nkv, hs, device=device, dtype=dtype)
        host_cache = torch.zeros(512, bs, nkv, hs, dtype=dtype).pin_memory()
        mapping = torch.stack([torch.randperm(512)[:256], torch.randperm(512)[:256]], 1)  # scattered ids
        for name, src, dst in (("swap_out", gpu_cache, host_cache), ("swap_in", host_cache, gpu_cache)):
            seconds = timed(lambda: ops.swap_blocks(src, dst, mapping), device)
            moved = 256 * gpu_cache[0].numel() * gpu_cache.element_size()
            rows.append({"op": name, "size": "256 blocks", "ms": seconds * 1e3, "gbps": moved / seconds / 1e9})
    return rows


def op_share(device: torch.device, dtype: torch.dtype) -> dict:
    """Share of a Llama decode step spent in RMSNorm and in rotary embedding (HF implementation)."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000)  # TinyLlama-1.1B shapes, fewer layers
    model = llama.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    spent = {"rms_norm": 0.0, "rotary": 0.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed_call(name, fn):
        def wrapper(*a, **kw):
            sync()
            start = time.perf_counter()
            result = fn(*a, **kw)
            sync()
            spent[name] += time.perf_counter() - start
            return result
        return wrapper

    for module in model.modules():
        if isinstance(module, llama.LlamaRMSNorm):
            module.forward = timed_call("rms_norm", module.forward)
        elif isinstance(module, llama.LlamaRotaryEmbedding):
            module.forward = timed_call("rotary", module.forward)
    original_apply = llama.apply_rotary_pos_emb
    llama.apply_rotary_pos_emb = timed_call("rotary", original_apply)
    try:
        with torch.inference_mode():
            prompt = torch.randint(0, config.vocab_size, (8, 32), device=device)  # 8 sequences
            past = model(prompt, use_cache=True).past_key_values
            next_ids = prompt[:, -1:]
            spent.update(rms_norm=0.0, rotary=0.0)
            sync()
            start = time.perf_counter()
            for _ in range(8):
                out = model(next_ids, past_key_values=past, use_cache=True)
                past, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync()
            total = time.perf_counter() - start
    finally:
        llama.apply_rotary_pos_emb = original_apply
    return {"decode_step_ms": total / 8 * 1e3, "rms_norm_share": spent["rms_norm"] / total,
            "rotary_share": spent["rotary"] / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="the smallest grid")
    parser.add_argument("--op-share", action="store_true", help="also measure RMSNorm/rotary share of a decode step")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32, help="layers for copy_blocks")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); on a machine "
                        "shared with other jobs 1 thread avoids OpenMP barrier stalls of tens of ms")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    batches, contexts = GRIDS["quick" if args.quick else device.type]
    impl = "triton" if ops.use_triton(device) else "reference"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"{name}, {dtype}, paged attention = {impl}, heads {args.num_heads}/{args.num_kv_heads} x "
          f"{args.head_size}, block size {args.block_size}\n")

    attention = [decode_attention_row(args, b, c, device, dtype) for b in batches for c in contexts]
    print_table(attention, ["batch", "context", "paged_ms", "paged_gbps", "sdpa_ms", "sdpa_gbps", "paged_over_sdpa",
                            "max_abs_diff"], float_format=".4g")
    cache_ops = cache_op_rows(args, device, dtype, batches)
    print_table(cache_ops, ["op", "size", "ms", "gbps"], float_format=".4g")
    share = op_share(device, dtype) if args.op_share else None
    if share:
        print_table([share], float_format=".4g")

    (path,) = save_report(f"kernels-{device.type}-{timestamp()}", {
        "device": name, "dtype": str(dtype), "implementation": impl, "args": vars(args), "torch": torch.__version__,
        "attention": attention, "cache_ops": cache_ops, "op_share": share})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
