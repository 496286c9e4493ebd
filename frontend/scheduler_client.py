"""Client of the scheduler's internal gRPC service; protobuf stays inside this module.

Transport failures become exceptions the servicer maps to public status codes:

```
 scheduler status / failure             exception              public status
 UNAVAILABLE, connection refused/lost   SchedulerUnavailable   UNAVAILABLE
 RESOURCE_EXHAUSTED (queue full)        SchedulerBusy          RESOURCE_EXHAUSTED
 INVALID_ARGUMENT                       SchedulerRejected      INVALID_ARGUMENT
 DEADLINE_EXCEEDED                      SchedulerTimeout       DEADLINE_EXCEEDED
 CANCELLED (the frontend cancelled)     SubmitCancelled        (the client is gone)
 anything else                          SchedulerError         INTERNAL
```
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields

import grpc

from pagedserve.grpc_options import INTERNAL_CHANNEL_OPTIONS
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.scheduler.outputs import CompletionDelta, FinishReason, Request, RequestOutput, TokenLogprob
from pagedserve.scheduler.sampling_codec import sampling_to_proto

DEFAULT_RPC_TIMEOUT_S = 5.0
_FINISH_FROM_PROTO = {
    scheduler_pb2.FINISH_REASON_UNSPECIFIED: None,
    scheduler_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    scheduler_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    scheduler_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


class SchedulerError(RuntimeError):
    """The scheduler call failed; `code` is the gRPC status it failed with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class SchedulerUnavailable(SchedulerError):
    """The scheduler cannot be reached, is not ready, or is draining."""


class SchedulerBusy(SchedulerError):
    """The scheduler's waiting queue is full."""


class SchedulerRejected(SchedulerError):
    """The scheduler found the request invalid."""


class SchedulerTimeout(SchedulerError):
    """The call's deadline passed."""


class SubmitCancelled(SchedulerError):
    """The frontend cancelled the Submit stream itself (its own client went away)."""


_ERROR_FOR_CODE = {
    grpc.StatusCode.UNAVAILABLE: SchedulerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SchedulerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: SchedulerRejected,
    grpc.StatusCode.DEADLINE_EXCEEDED: SchedulerTimeout,
    grpc.StatusCode.CANCELLED: SubmitCancelled,
}


def error_from_rpc(exc: grpc.RpcError) -> SchedulerError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    error_class = _ERROR_FOR_CODE.get(code, SchedulerError)
    return error_class(f"scheduler: {details or code.name}", code)


@dataclass(frozen=True, slots=True)
class SchedulerInfo:
    is_ready: bool
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_cpu_blocks: int
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class StepSummary:
    step_id: int
    request_ids: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks_total: int
    num_gpu_blocks_free: int
    num_gpu_blocks_used: int
    num_gpu_blocks_cached: int
    num_cpu_blocks_total: int
    num_cpu_blocks_free: int
    num_cpu_blocks_used: int
    num_cpu_blocks_cached: int
    num_steps: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    recent_steps: tuple[StepSummary, ...]
    is_pool_consistent: bool


def _output_from_proto(request_id: str, msg: scheduler_pb2.SubmitResponse) -> RequestOutput:
    deltas = [
        CompletionDelta(
            index=delta.index,
            token_ids=list(delta.token_ids),
            logprobs=[
                TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                             top_token_ids=[top.token_id for top in lp.top],
                             top_logprobs=[top.logprob for top in lp.top])
                for lp in delta.logprobs
            ],
            cumulative_logprob=delta.cumulative_logprob,
            finish_reason=_FINISH_FROM_PROTO.get(delta.finish_reason),
        )
        for delta in msg.deltas
    ]
    return RequestOutput(request_id=request_id, deltas=deltas, prompt_tokens=msg.prompt_tokens,
                         cached_prompt_tokens=msg.cached_prompt_tokens, is_finished=msg.is_finished)


class SubmitStream:
    """The outputs of one submitted request; `cancel()` (from any thread) aborts it in the scheduler."""

    def __init__(self, request_id: str, call) -> None:
        self.request_id = request_id
        self._call = call
        self._is_cancelled = threading.Event()

    @property
    def is_cancelled(self) -> bool:
        return self._is_cancelled.is_set()

    def cancel(self) -> None:
        self._is_cancelled.set()
        self._call.cancel()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            for msg in self._call:
                yield _output_from_proto(self.request_id, msg)
        except grpc.RpcError as exc:
            if self.is_cancelled:
                raise SubmitCancelled("the Submit stream was cancelled", grpc.StatusCode.CANCELLED) from exc
            raise error_from_rpc(exc) from exc


class SchedulerClient:
    """One channel (with keepalive) to the scheduler, shared by every request of the frontend."""

    def __init__(self, address: str, frontend_id: str = "", channel: grpc.Channel | None = None) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self._channel = channel or grpc.insecure_channel(address, options=INTERNAL_CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def submit(self, request: Request, timeout: float | None = None) -> SubmitStream:
        """Starts the request; failures surface while iterating the returned stream."""
        msg = scheduler_pb2.SubmitRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_proto(request.sampling),
            frontend_id=self.frontend_id,
        )
        return SubmitStream(request.request_id, self._stub.Submit(msg, timeout=timeout))

    def finish_completion(self, request_id: str, index: int, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self._unary(self._stub.FinishCompletion,
                    scheduler_pb2.FinishCompletionRequest(request_id=request_id, index=index), timeout)

    def abort(self, request_id: str, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> bool:
        """Aborts a request; returns whether the scheduler knew it."""
        return self._unary(self._stub.Abort, scheduler_pb2.AbortRequest(request_id=request_id), timeout).found

    def get_info(self, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> SchedulerInfo:
        msg = self._unary(self._stub.GetInfo, scheduler_pb2.GetInfoRequest(), timeout)
        return SchedulerInfo(**{f.name: getattr(msg, f.name) for f in fields(SchedulerInfo)})

    def get_stats(self, max_recent_steps: int = 0, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> SchedulerStats:
        msg = self._unary(self._stub.GetStats, scheduler_pb2.GetStatsRequest(max_recent_steps=max_recent_steps),
                          timeout)
        values = {f.name: getattr(msg, f.name) for f in fields(SchedulerStats) if f.name != "recent_steps"}
        recent = tuple(
            StepSummary(step_id=s.step_id, request_ids=tuple(s.request_ids),
                        num_prefill_tokens=s.num_prefill_tokens, num_decode_tokens=s.num_decode_tokens)
            for s in msg.recent_steps
        )
        return SchedulerStats(recent_steps=recent, **values)

    @staticmethod
    def _unary(method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
