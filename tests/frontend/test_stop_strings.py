"""Stop strings over incremental text, and their use in one completion's state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.frontend.generation.completion_state import CompletionFinish, CompletionState, SchedulerAbortedCompletion
from pagedserve.frontend.generation.stop_strings import StopStringMatcher
from pagedserve.contracts.request_types import CompletionDelta, FinishReason
from pagedserve.contracts.sampling_params import SamplingParams


def _feed_all(matcher, pieces):
    emitted = []
    for piece in pieces:
        check = matcher.feed(piece)
        emitted.append(check.text)
        if check.is_stopped:
            return emitted, check.stop_sequence
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_string_across_pieces_is_held_back_then_cut():
    matcher = StopStringMatcher(["\n\nUser:"])
    first = matcher.feed("Hello.\n")
    assert (first.text, first.is_stopped, matcher.held_text) == ("Hello.", False, "\n")
    second = matcher.feed("\nUs")
    assert (second.text, matcher.held_text) == ("", "\n\nUs")
    third = matcher.feed("er: hi")
    assert (third.text, third.stop_sequence) == ("", "\n\nUser:")
    assert matcher.feed("more").text == ""


def test_include_stop_string_in_output():
    emitted, stop = _feed_all(StopStringMatcher(["END"], include_stop_str_in_output=True), ["abcE", "N", "D tail"])
    assert "".join(emitted) == "abcEND" and stop == "END"
    emitted, stop = _feed_all(StopStringMatcher(["END"]), ["abcE", "N", "D tail"])
    assert "".join(emitted) == "abc" and stop == "END"


def test_holds_back_only_the_longest_possible_beginning():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xxab").text == "xx"
    assert matcher.held_text == "ab"
    assert matcher.feed("d").text == "abd"
    assert matcher.held_text == ""
    overlapping = StopStringMatcher(["aab"])
    assert overlapping.feed("aaa").text == "a"
    assert overlapping.held_text == "aa"
    check = overlapping.feed("b!")
    assert (check.text, check.stop_sequence) == ("", "aab")  # "a" was released before


def test_first_ending_stop_string_wins_and_longer_on_a_tie():
    check = StopStringMatcher(["bcd", "ab"]).feed("xabcd")
    assert (check.text, check.stop_sequence) == ("x", "ab")
    check = StopStringMatcher(["c", "abc"]).feed("xabcd")
    assert (check.text, check.stop_sequence) == ("x", "abc")
    check = StopStringMatcher(["zz", "cd"], include_stop_str_in_output=True).feed("abcdzz")
    assert (check.text, check.stop_sequence) == ("abcd", "cd")


def test_without_stop_strings_text_passes_through_and_empty_stops_are_refused():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything").text == "anything" and matcher.held_text == ""
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_flush_releases_the_held_tail():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST").text == "go "
    assert matcher.flush() == "ST"
    assert matcher.held_text == ""


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Character-at-a-time semantics: generation stops as soon as the text ends with a stop string."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if text[:end].endswith(s)]
        if matches:
            stop = max(matches, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_matches_character_at_a_time_semantics_for_any_split(text, stops, cuts, include):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted, stop = _feed_all(matcher, pieces)
    assert ("".join(emitted), stop) == _reference(text, stops, include)


# -- one completion: detokenizer + stop strings ------------------------------------------------

def _deltas(tokenizer, text: str, index: int = 0):
    return [CompletionDelta(index=index, token_ids=[i]) for i in tokenizer.encode(text)[1:]]


def test_completion_stops_on_a_string_spanning_tokens(tokenizer):
    params = SamplingParams(stop=["stairs"], max_tokens=100)
    state = CompletionState(0, params, tokenizer)
    updates = [state.apply(d) for d in _deltas(tokenizer, "the keeper climbed the stairs and the lamp")]
    stopped = [u for u in updates if u is not None and u.finish is not None]
    assert len(stopped) == 1
    assert stopped[0].finish is CompletionFinish.STOP_SEQUENCE and stopped[0].stop_sequence == "stairs"
    assert stopped[0].is_stopped_by_frontend
    assert state.text == "the keeper climbed the "
    assert "".join(u.text for u in updates if u is not None) == state.text
    assert updates[-1] is None, "tokens after the stop string must be dropped"
    assert tokenizer.decode(state.token_ids).startswith("the keeper climbed the stairs")
    assert not tokenizer.decode(state.token_ids).endswith("lamp")


def test_completion_finished_by_the_scheduler_flushes_held_text(tokenizer):
    state = CompletionState(0, SamplingParams(stop=["keeper!"]), tokenizer)
    deltas = _deltas(tokenizer, "the keep")
    deltas[-1].finish_reason = FinishReason.LENGTH
    texts = [state.apply(d).text for d in deltas]
    assert "".join(texts) == "the keep"
    assert state.finish is CompletionFinish.LENGTH and state.stop_sequence is None


def test_stop_strings_wait_for_min_tokens(tokenizer):
    deltas = _deltas(tokenizer, "ab ab ab ab")
    state = CompletionState(0, SamplingParams(stop=["ab"], min_tokens=len(deltas) - 1, max_tokens=50), tokenizer)
    for delta in deltas:
        state.apply(delta)
    assert state.finish is CompletionFinish.STOP_SEQUENCE
    assert len(state.token_ids) == len(deltas)
    early = CompletionState(0, SamplingParams(stop=["ab"], max_tokens=50), tokenizer)
    for delta in deltas:
        early.apply(delta)
    assert early.finish is CompletionFinish.STOP_SEQUENCE and early.text == ""
    assert len(early.token_ids) < len(deltas) - 1


def test_unrequested_abort_from_the_scheduler_is_an_error(tokenizer):
    state = CompletionState(0, SamplingParams(), tokenizer)
    with pytest.raises(SchedulerAbortedCompletion):
        state.apply(CompletionDelta(index=0, token_ids=[], finish_reason=FinishReason.ABORT))
