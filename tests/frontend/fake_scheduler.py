"""A scripted stand-in for the scheduler's internal gRPC service, for the frontend's unit tests.

It serves the real pagedserve.internal.Scheduler protocol over real gRPC; each Submit emits, per
completion index, the token ids of `tokens_by_index` one step at a time, honouring max_tokens,
stop_token_ids, FinishCompletion and cancellation, and records what the frontend asked for.
A Submit with continuations goes on from each continued index's position in its script (finished
indices stay finished). Each FakeScheduler is one scheduler instance (GetInfo's instance_id): a
new FakeSchedulerServer on the same port is a restarted scheduler. With `has_session` it also
serves Session, and says so in GetInfo: each request on a Session runs the same script as its own
Submit would (a thread per request), its outputs and its status carried by the Session.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent import futures

import grpc

from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = threading.Condition(self.lock)  # notified whenever a Submit stream ends
        self.instance_id = uuid.uuid4().hex
        self.reset()

    def reset(self) -> None:
        self.is_ready = True
        self.has_session = False
        self.max_model_len = 128
        self.vocab_size = 512
        self.tokens_by_index: dict[int, list[int]] = {0: [40, 41, 42, 43, 44, 45, 46, 47]}
        self.step_delay_s = 0.0
        self.reject_code: grpc.StatusCode | None = None
        self.abort_after_messages: int | None = None  # ends each stream with UNAVAILABLE after this many
        self.bad_index_at_message: int | None = None  # this message (from 0) names a completion that does
        # not exist, and the stream then stays open until the frontend closes it
        self.cached_prompt_tokens = 0
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.finish_requests: list[tuple[str, int]] = []
        self.cancelled_ids: list[str] = []
        self.completed_ids: list[str] = []
        self._finished_by_frontend: dict[str, set[int]] = {}

    # -- the internal service ------------------------------------------------------------------
    def Submit(self, request, context):
        with self.lock:
            self.submits.append(request)
            self._finished_by_frontend[request.request_id] = set()
        if self.reject_code is not None:
            context.abort(self.reject_code, "rejected by the fake scheduler")
        state = {"done": False}

        def on_rpc_end() -> None:
            with self.lock:
                (self.completed_ids if state["done"] else self.cancelled_ids).append(request.request_id)
                self.closed.notify_all()

        context.add_callback(on_rpc_end)
        sampling = request.sampling
        if sampling.beam_width > 1:
            yield from self._beams(request, context)
        else:
            yield from self._steps(request, context)
        # a loop that ended because the client went away is not a completed stream (the end
        # callback may run after this line)
        state["done"] = context.is_active()

    def Session(self, request_iterator, context):
        if not self.has_session:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this fake serves no Session")
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        calls: dict[str, _RequestContext] = {}

        def run(request, call: _RequestContext) -> None:
            try:
                for message in self.Submit(request, call):
                    outputs.put(scheduler_pb2.SessionOutput(request_id=request.request_id, response=message))
            except _Aborted as aborted:
                outputs.put(scheduler_pb2.SessionOutput(request_id=request.request_id,
                                                        status_code=aborted.code.value[0],
                                                        status_message=aborted.details))
            finally:
                call.end()

        def read() -> None:
            try:
                for message in request_iterator:
                    if message.WhichOneof("kind") == "submit":
                        call = calls[message.submit.request.request_id] = _RequestContext(context)
                        threading.Thread(target=run, args=(message.submit.request, call), daemon=True).start()
                    elif message.cancel_request_id in calls:
                        calls[message.cancel_request_id].cancel()
            except grpc.RpcError:
                pass
            finally:
                for call in list(calls.values()):  # the Session ended: every request on it is cancelled
                    call.cancel()

        threading.Thread(target=read, daemon=True).start()
        while context.is_active():
            try:
                output = outputs.get(timeout=0.05)
            except queue.Empty:
                continue
            yield scheduler_pb2.SessionResponse(outputs=[output])

    def FinishCompletion(self, request, context):
        with self.lock:
            self.finish_requests.append((request.request_id, request.index))
            self._finished_by_frontend.setdefault(request.request_id, set()).add(request.index)
        return scheduler_pb2.FinishCompletionResponse()

    def GetInfo(self, request, context):
        return scheduler_pb2.SchedulerInfo(
            is_ready=self.is_ready, model_name="fake-model", max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, block_size=16, num_kv_blocks=100, num_cpu_blocks=10,
            tensor_parallel_size=1, max_num_seqs=8, max_num_batched_tokens=256, instance_id=self.instance_id,
            has_session=self.has_session)

    def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(num_running=len(self.submits), is_pool_consistent=True)

    def wait_closed(self, request_id: str, timeout: float) -> bool:
        """Waits until the Submit stream of `request_id` has ended (a stream of an earlier test that
        ends late does not count)."""
        with self.closed:
            return self.closed.wait_for(
                lambda: request_id in self.cancelled_ids or request_id in self.completed_ids, timeout)

    # -- scripted outputs ------------------------------------------------------------------------
    def _steps(self, request, context):
        sampling = request.sampling
        num_completions = max(sampling.n, 1)
        positions = {i: 0 for i in range(num_completions)}
        finished: set[int] = set()
        for continuation in request.continuations:
            positions[continuation.index] = len(continuation.token_ids)
            if continuation.is_finished:
                finished.add(continuation.index)
        first = True
        num_sent = 0
        while len(finished) < num_completions and context.is_active():
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if self.abort_after_messages is not None and num_sent >= self.abort_after_messages:
                context.abort(grpc.StatusCode.UNAVAILABLE, "ended by the fake scheduler")
            num_sent += 1
            msg = scheduler_pb2.SubmitResponse()
            if first:
                msg.prompt_tokens = len(request.prompt_token_ids)
                msg.cached_prompt_tokens = self.cached_prompt_tokens
                first = False
            for index in range(num_completions):
                if index in finished:
                    continue
                if index in self._finished_by_frontend.get(request.request_id, set()):
                    msg.deltas.add(index=index, finish_reason=scheduler_pb2.FINISH_REASON_ABORT)
                    finished.add(index)
                    continue
                script = self.tokens_by_index.get(index, self.tokens_by_index[0])
                token_id = script[positions[index] % len(script)]
                positions[index] += 1
                delta = msg.deltas.add(index=index, token_ids=[token_id],
                                       cumulative_logprob=-0.5 * positions[index])
                if sampling.logprobs:
                    lp = delta.logprobs.add(token_id=token_id, logprob=-0.5)
                    for k in range(sampling.logprobs):
                        lp.top.add(token_id=token_id + k, logprob=-0.5 - k)
                if token_id in sampling.stop_token_ids:
                    delta.finish_reason = scheduler_pb2.FINISH_REASON_STOP
                elif positions[index] >= sampling.max_tokens:
                    delta.finish_reason = scheduler_pb2.FINISH_REASON_LENGTH
                if delta.finish_reason:
                    finished.add(index)
            is_bad = self.bad_index_at_message is not None and num_sent - 1 == self.bad_index_at_message
            if is_bad:
                msg.deltas.add(index=num_completions, token_ids=[self.tokens_by_index[0][0]])
            msg.is_finished = len(finished) == num_completions and not is_bad
            yield msg
            while is_bad and context.is_active():  # the stream goes on until the frontend closes it
                time.sleep(0.01)

    def _beams(self, request, context):
        sampling = request.sampling
        time.sleep(self.step_delay_s)
        msg = scheduler_pb2.SubmitResponse(prompt_tokens=len(request.prompt_token_ids), is_finished=True)
        for index in range(sampling.beam_width):
            script = self.tokens_by_index.get(index, self.tokens_by_index[0])
            msg.deltas.add(index=index, token_ids=script[:sampling.max_tokens], cumulative_logprob=-1.0 - index,
                           finish_reason=scheduler_pb2.FINISH_REASON_LENGTH)
        yield msg


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _RequestContext:
    """What Submit's script uses of its gRPC context, for one request on a Session: abort() ends the
    request with a status, a cancel (or the Session's end) makes it inactive, and the callbacks run
    when it ends."""

    def __init__(self, session_context) -> None:
        self._session = session_context
        self._cancelled = threading.Event()
        self._callbacks: list = []
        self._ended = False

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        return not self._cancelled.is_set() and self._session.is_active()

    def add_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def cancel(self) -> None:
        self._cancelled.set()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            for callback in self._callbacks:
                callback()


class FakeSchedulerServer:
    """The fake on 127.0.0.1, at `port` or a free one."""

    def __init__(self, port: int = 0) -> None:
        self.fake = FakeScheduler()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.fake, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait()
