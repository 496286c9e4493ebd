"""Stop strings matched over the incremental text of one completion.

Text arrives in pieces (one per detokenizer step) and a stop string may straddle pieces, so the
matcher keeps back the longest tail that could still grow into a stop string and releases the rest:

```
 stop = ["\\n\\nUser:"]
 feed("Hello.\\n")   -> emit "Hello."   hold "\\n"        ("\\n" begins the stop string)
 feed("\\nUs")       -> emit ""         hold "\\n\\nUs"
 feed("er: hi")      -> match "\\n\\nUser:" : emit "" (or "\\n\\nUser:" when the stop string is
                                         included in the output); the completion is finished
```

When several stop strings occur in one piece, the one that ends first wins (it is the one that
would have stopped generation had the text arrived one character at a time); between stop strings
ending at the same place, the longer one wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What one piece of text released: `text` to emit, and the stop string that matched, if any."""

    text: str
    stop_sequence: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.stop_sequence is not None


class StopStringMatcher:
    """Finds the first stop string in a completion's text; holds back possible partial matches."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not text for text in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))  # deduplicated, order kept
        self._include = include_stop_str_in_output
        self._max_hold = max((len(text) for text in self._stop), default=1) - 1
        self._held = ""
        self._stop_sequence: str | None = None

    @property
    def held_text(self) -> str:
        return self._held

    @property
    def stop_sequence(self) -> str | None:
        return self._stop_sequence

    def feed(self, text: str) -> StopCheck:
        """Checks a new piece of text; after a match every further piece is dropped."""
        if self._stop_sequence is not None:
            return StopCheck("", self._stop_sequence)
        if not self._stop:
            return StopCheck(text)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop_text = match
            self._stop_sequence = stop_text
            self._held = ""
            end = start + len(stop_text) if self._include else start
            return StopCheck(buffer[:end], stop_text)
        num_held = self._num_chars_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held:] if num_held else ""
        return StopCheck(buffer[:len(buffer) - num_held])

    def flush(self) -> str:
        """Releases the held tail; call when the completion has finished for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string ending first in `buffer`, longest on a tie."""
        # Every full stop string in the held tail was already ruled out, so a match must end in the
        # new text; starting the search a little before it is enough.
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_text in self._stop:
            start = buffer.find(stop_text, max(0, len(self._held) - len(stop_text) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop_text), -len(stop_text), stop_text)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, neg_length, stop_text = best
        return end + neg_length, stop_text

    def _num_chars_to_hold(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[len(buffer) - length:]
            if any(stop_text.startswith(tail) for stop_text in self._stop if len(stop_text) > length):
                return length
        return 0
