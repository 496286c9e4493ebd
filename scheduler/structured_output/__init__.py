"""Structured output in the scheduler: constraints compiled into llguidance token matchers
(compiler.py, from the model's vocabulary, vocabulary.py), one matcher per sequence kept in step
with its tokens (matcher.py), and the step's token bitmask rows for the workers (bitmask.py).
No torch: llguidance computes masks into numpy arrays."""
