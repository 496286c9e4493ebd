"""The waiting-queue bounds: requests and prompt tokens, duplicates, release and queue time."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.admission import Admission, DuplicateRequest, QueueFull


def test_request_bound():
    admission = Admission(max_requests=2, max_tokens=1000)
    admission.admit("a", 10)
    admission.admit("b", 10)
    with pytest.raises(QueueFull, match="2 requests"):
        admission.admit("c", 10)
    assert admission.release("a") is not None
    admission.admit("c", 10)
    assert admission.num_queued == 2 and admission.num_queued_tokens == 20


def test_token_bound_admits_one_oversized_prompt_into_an_empty_queue():
    admission = Admission(max_requests=10, max_tokens=100)
    admission.admit("big", 150)  # alone: it must be able to run some time
    with pytest.raises(QueueFull, match="prompt tokens"):
        admission.admit("small", 1)
    admission.release("big")
    admission.admit("a", 60)
    with pytest.raises(QueueFull):
        admission.admit("b", 41)
    admission.admit("b", 40)
    assert admission.num_queued_tokens == 100


def test_duplicate_and_unknown_ids():
    admission = Admission(max_requests=10, max_tokens=100)
    admission.admit("a", 5)
    with pytest.raises(DuplicateRequest, match="request_id"):
        admission.admit("a", 5)
    assert admission.release("unknown") is None
    assert admission.release("a", now=admission._queued["a"].arrival + 2.5) == pytest.approx(2.5)
    assert admission.release("a") is None  # released once
    admission.admit("a", 5)
    admission.clear()
    assert admission.num_queued == 0 and admission.num_queued_tokens == 0


@pytest.mark.parametrize("max_requests, max_tokens", [(0, 10), (10, 0)])
def test_bounds_must_be_positive(max_requests, max_tokens):
    with pytest.raises(ValueError):
        Admission(max_requests, max_tokens)
