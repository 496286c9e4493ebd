"""pagedserve.kernels: the worker's kernels, entered only through kernels.ops (Triton on CUDA, the
CPU and native paths otherwise), each beside a plain-torch reference with the same meaning.

The code map, with one line per module: docs/architecture.md; the kernels themselves: docs/kernels.md.
"""
