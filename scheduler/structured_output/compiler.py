"""Compiles constraints into llguidance matchers, once per distinct constraint.

    Constraint --grammar_text()--> llguidance grammar (JSON text) --LLMatcher(vocabulary)--> template
    each constrained sequence gets template.deep_copy() (matcher.py)

Compilation is bounded: the constraint's text is capped (contracts/constraint.py), llguidance's
parser limits cap the grammar and lexer sizes and the work of one mask, and the scheduler's gRPC
handler compiles on a worker thread with a timeout (compile_async) before it queues the request,
so a hostile schema is refused with the field named instead of stalling the step loop. The step
loop then finds the compiled template in the cache. Templates are kept by content, least
recently used first out.

The vocabulary (vocabulary.py) is read once, on first use or by warm_up() at start.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance

from pagedserve.contracts.constraint import Constraint
from pagedserve.contracts.constraint_grammar import PARSER_LIMITS, GrammarError, grammar_text

MAX_CACHED_GRAMMARS = 256
COMPILE_TIMEOUT_S = 10.0
class GrammarCompiler:
    """Thread-safe: the gRPC handlers compile, the step loop takes templates from the cache."""

    def __init__(self, load_vocabulary: Callable[[], llguidance.LLTokenizer]) -> None:
        self._load_vocabulary = load_vocabulary
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._vocabulary_error: str | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self.num_compiled = 0
        self.num_cache_hits = 0

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        """Read once; a failure is kept and every constraint is then refused with its reason."""
        with self._lock:
            if self._vocabulary is None and self._vocabulary_error is None:
                try:
                    self._vocabulary = self._load_vocabulary()
                except Exception as exc:
                    self._vocabulary_error = f"{type(exc).__name__}: {exc}"
            if self._vocabulary is None:
                raise GrammarError("constraint", f"structured output is not available for this model "
                                                 f"({self._vocabulary_error})")
            return self._vocabulary

    def warm_up(self) -> None:
        """Reads the vocabulary now (a GGUF file's takes seconds), so the first request need not."""
        _ = self.vocabulary

    @property
    def vocab_size(self) -> int:
        return self.vocabulary.vocab_size

    def template(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The compiled matcher of `constraint` in its initial state (never consume with it: copy
        it); raises GrammarError when the constraint does not compile."""
        key = constraint.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return found
        grammar = grammar_text(constraint)
        vocabulary = self.vocabulary
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary,
                                                                                 limits=self.limits)
        if is_error:
            raise GrammarError(constraint.field_name, messages[0] if messages else "does not compile")
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(constraint.field_name, matcher.get_error())
        with self._lock:
            self._cache[key] = matcher
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        return self.template(constraint).deep_copy()

    async def compile_async(self, constraint: Constraint, timeout: float = COMPILE_TIMEOUT_S) -> None:
        """Compiles on a worker thread (llguidance drops the GIL while it builds); GrammarError
        when it fails or takes longer than `timeout` (the thread finishes in the background)."""
        await asyncio.to_thread(self.warm_up)  # reading the vocabulary is not the constraint's time
        try:
            await asyncio.wait_for(asyncio.to_thread(self.template, constraint), timeout)
        except asyncio.TimeoutError as exc:
            raise GrammarError(constraint.field_name, f"did not compile within {timeout:g} s") from exc
