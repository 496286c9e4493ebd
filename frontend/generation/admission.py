"""Where every public request, gRPC or HTTP, is admitted, started and ended.

```
 limits()  refuses while draining (Draining) or while the scheduler is not ready
           (SchedulerUnavailable); else the model limits a request is validated against
 start()   a validated request -> Generation, registered in flight (a drain waits for it, a cut
           cancels it)
 leave()   unregisters it (after its scheduler stream has closed)
 finished() records the end in the metrics and logs `request_finished`
 failed()  closes a request that failed, before or while it ran (failure.py: drain cut, cancel,
           classify, timer, log); the edge maps the returned RequestError to its status
```

The protocol handlers only convert their requests and responses; admission, back-pressure
(the scheduler's RESOURCE_EXHAUSTED surfaces while the Generation runs), cancellation and the
drain work the same for both.
"""

from __future__ import annotations

import structlog

from pagedserve.frontend.generation.drain import Draining, InFlight
from pagedserve.frontend.generation.errors import RequestError
from pagedserve.frontend.generation.failure import close_failed
from pagedserve.frontend.generation.generation import Generation
from pagedserve.frontend.generation.recovery import SchedulerRecovery
from pagedserve.frontend.generation.updates import Usage
from pagedserve.frontend.metrics import RequestTimer
from pagedserve.frontend.grpc.codec import finish_label
from pagedserve.frontend.upstream.readiness import ReadinessMonitor
from pagedserve.frontend.upstream.replica_set import ReplicaSet
from pagedserve.frontend.upstream.scheduler_client import SchedulerClient
from pagedserve.frontend.tokenization.tokenizer import Tokenizer
from pagedserve.frontend.grpc.validation import ModelLimits, ValidatedRequest, max_prompt_bytes

# Before the scheduler has said its max_model_len: the text Tokenize takes (gRPC and HTTP).
FALLBACK_MAX_PROMPT_BYTES = 1 << 20

log = structlog.get_logger()


class Admission:
    def __init__(self, tokenizer: Tokenizer, client: SchedulerClient | ReplicaSet,
                 readiness: ReadinessMonitor | ReplicaSet,
                 in_flight: InFlight, recovery: SchedulerRecovery | None = None) -> None:
        """recovery: how requests ride out a scheduler restart (None: they fail with UNAVAILABLE)."""
        self.tokenizer = tokenizer
        self.client = client
        self.readiness = readiness
        self.in_flight = in_flight
        self.recovery = recovery

    @property
    def is_serving(self) -> bool:
        """Ready for requests: the scheduler is ready and this frontend is not draining."""
        return not self.in_flight.is_draining and self.readiness.is_ready

    def limits(self) -> ModelLimits:
        """The model's limits, when requests are taken; raises Draining or SchedulerUnavailable."""
        if self.in_flight.is_draining:
            raise Draining("the frontend is shutting down; retry on another instance")
        info = self.readiness.require_ready()
        return ModelLimits(max_model_len=info.max_model_len, vocab_size=info.vocab_size or self.tokenizer.vocab_size)

    def max_prompt_bytes(self) -> int:
        """The longest text worth tokenizing (ModelLimits.max_prompt_bytes), also while not ready."""
        info = self.readiness.info
        return max_prompt_bytes(info.max_model_len) if info is not None else FALLBACK_MAX_PROMPT_BYTES

    def start(self, request: ValidatedRequest, timer: RequestTimer, timeout: float | None = None, *,
              whole: bool = False) -> Generation:
        """A Generation for the request, registered in flight (raises Draining once draining); it
        goes to the scheduler instance of readiness's latest answer. whole: the client takes the
        result at the end, not streamed (Generation's)."""
        info = self.readiness.info
        replicas = self.readiness if isinstance(self.readiness, ReplicaSet) else None
        generation = Generation(request, self.client, self.tokenizer, timer, timeout=timeout, recovery=self.recovery,
                                instance_id=info.instance_id if info is not None else "", replicas=replicas,
                                whole=whole)
        self.in_flight.enter(generation)
        return generation

    def leave(self, generation: Generation) -> None:
        self.in_flight.leave(generation)

    def failed(self, exc: BaseException, timer: RequestTimer, generation: Generation | None = None,
               **options) -> RequestError:
        """Closes a failed request (failure.close_failed; options: deadline_passed, code_of,
        request_id) and returns why it failed."""
        was_cut = generation is not None and self.in_flight.was_cut(generation)
        return close_failed(exc, timer, generation, was_cut=was_cut, **options)

    @staticmethod
    def finished(generation: Generation, timer: RequestTimer, usage: Usage) -> None:
        """Records a request that ran to its end (metrics label: its first completion's finish)."""
        label = finish_label(generation.states)
        timer.on_done(label)
        replica = {"replica": generation.replica_address} if generation.replica_address else {}
        log.info("request_finished", finish_reason=label, prompt_tokens=usage.prompt_tokens,
                 completion_tokens=usage.completion_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
                 **replica)
