"""pagedserve.kernels: the worker's kernels, each Triton kernel beside a plain-torch reference with
the same signature.

ops.py dispatches every call (PAGEDSERVE_KERNELS: Triton on CUDA, the CPU paths otherwise):
  paged_attention.py  Triton    paged_attention_cpu.py  CPU (SDPA)    paged_attention_ref.py  reference
  cache_ops.py        Triton    cache_ops_cpu.py        CPU           cache_ops_ref.py        reference
prepacked_linear_cpu.py: bfloat16 CPU linear layers on weights prepacked once for oneDNN (reference: F.linear).
"""
