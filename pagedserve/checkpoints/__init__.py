"""pagedserve.checkpoints: where the checkpoint a process serves comes from (shared by every process).

The code map, with one line per module: docs/architecture.md.
"""
