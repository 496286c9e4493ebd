"""pagedserve.scheduler.structured_output: constraints compiled into llguidance token matchers, one
matcher per sequence kept in step with its tokens, and the step's token bitmask rows for the
workers. No torch: llguidance computes masks into numpy arrays.

The code map: docs/architecture.md; the topic: docs/structured-output.md.
"""
