"""The scheduler's ZeroMQ link against worker sockets driven by the test: a rank that replaces a
lost one is not told to exit, processes told to exit are ignored afterwards, ranks are told apart
by instance id even when their pids are equal (containers), and epochs do not repeat across
scheduler restarts."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedserve.internal import step_pb2
from pagedserve.scheduler.worker_link import WorkerLink, WorkerLost
from pagedserve.launch.serve_config import free_port


class FakeRank:
    """One worker rank's sockets: SUB for the scheduler's messages, PUSH for its own."""

    def __init__(self, link: WorkerLink, rank: int, pid: int, instance_id: int | None = None) -> None:
        self.rank = rank
        self.pid = pid
        self.instance_id = pid * 1000 + 7 if instance_id is None else instance_id
        self.world_size = link.world_size
        context = zmq.Context.instance()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(link.plan_address)
        self.push = context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(link.result_address)

    def register(self) -> None:
        self.push.send(step_pb2.WorkerMessage(register=step_pb2.Register(
            rank=self.rank, world_size=self.world_size, num_gpu_blocks=32, num_cpu_blocks=0, device="cpu",
            pid=self.pid, instance_id=self.instance_id)).SerializeToString())

    def received(self, timeout: float = 0.5) -> list[step_pb2.SchedulerMessage]:
        messages = []
        deadline = time.monotonic() + timeout
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = step_pb2.SchedulerMessage()
            message.ParseFromString(self.sub.recv())
            messages.append(message)
        return messages

    def answer_init(self, link: WorkerLink) -> None:
        """Answers every InitCache with Ready until the link reports the pool size."""
        for message in self.received(0.05):
            if message.WhichOneof("kind") == "init_cache":
                self.push.send(step_pb2.WorkerMessage(ready=step_pb2.Ready(
                    rank=self.rank, epoch=message.init_cache.epoch)).SerializeToString())

    def close(self) -> None:
        self.sub.close(0)
        self.push.close(0)


def _link(world_size: int = 1) -> WorkerLink:
    return WorkerLink(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", world_size=world_size)


def _register_until_known(link: WorkerLink, *ranks: FakeRank, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not link.all_registered():
        assert time.monotonic() < deadline, "the registration did not arrive"
        for rank in ranks:
            rank.register()
        link.poll_registration(0.1)


def _init(link: WorkerLink, *ranks: FakeRank) -> None:
    """Runs init_cache while the fake ranks answer from a thread of their own."""
    import threading

    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            for rank in ranks:
                rank.answer_init(link)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        link.init_cache(None, time.monotonic() + 10)
    finally:
        stop.set()
        thread.join()


@pytest.fixture
def link():
    link = _link()
    yield link
    link.close()


def test_a_replacement_rank_is_not_told_to_exit(link):
    old = FakeRank(link, 0, pid=1001)
    _register_until_known(link, old)
    _init(link, old)
    new = FakeRank(link, 0, pid=1002)
    time.sleep(0.2)  # the new SUB is subscribed, as a restarted worker is before it registers
    new.register()
    with pytest.raises(WorkerLost, match="registered again as instance .* \\(pid 1002\\)"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            link.drain()
            time.sleep(0.01)
    link.forget_ranks()
    (shutdown,) = [m.shutdown for m in new.received() if m.WhichOneof("kind") == "shutdown"]
    assert list(shutdown.instance_ids) == [old.instance_id]  # the new rank ignores it; the old one would exit

    old.register()  # the dismissed process, not yet gone, is not taken back
    link.drain()
    time.sleep(0.1)
    link.drain()
    assert not link.ranks
    _register_until_known(link, new)
    assert link.ranks[0].pid == 1002
    for rank in (old, new):
        rank.close()


def test_a_late_error_of_a_replaced_process_is_ignored(link):
    rank = FakeRank(link, 0, pid=2002)
    _register_until_known(link, rank)
    rank.push.send(step_pb2.WorkerMessage(error=step_pb2.WorkerError(
        rank=0, message="stopped by SIGTERM", pid=2002, instance_id=rank.instance_id + 1)).SerializeToString())
    time.sleep(0.1)
    link.drain()  # no WorkerLost: that instance is not the rank registered now, whatever its pid
    rank.push.send(step_pb2.WorkerMessage(error=step_pb2.WorkerError(
        rank=0, message="boom", pid=2002, instance_id=rank.instance_id)).SerializeToString())
    time.sleep(0.1)
    with pytest.raises(WorkerLost, match="boom"):
        link.drain()
    rank.close()


def test_epochs_do_not_repeat_across_scheduler_restarts():
    first = _link()
    rank = FakeRank(first, 0, pid=3001)
    _register_until_known(first, rank)
    _init(first, rank)
    first_epoch = first.epoch
    first.close()
    rank.close()
    time.sleep(0.01)
    second = _link()
    assert second.epoch + 1 > first_epoch  # the next InitCache is new to a worker that outlived `first`
    second.close()


def test_an_instance_dismissed_long_ago_is_forgotten(link):
    """The dismissed instances are kept DISMISSED_SECONDS, not for ever."""
    recent = FakeRank(link, 0, pid=4002)
    reused = FakeRank(link, 0, pid=4001)
    link.dismissed_instances = {reused.instance_id: time.monotonic() - 1000.0, recent.instance_id: time.monotonic()}
    recent.register()
    time.sleep(0.1)
    link.drain()
    assert not link.ranks
    _register_until_known(link, reused)
    assert link.ranks[0].pid == 4001
    for rank in (recent, reused):
        rank.close()


def test_ranks_with_equal_pids_are_told_apart_by_instance_id():
    """Ranks in separate containers are often all pid 1, and so is the rank that replaces one."""
    link = _link(world_size=2)
    try:
        rank0, rank1 = FakeRank(link, 0, pid=1, instance_id=0xA0), FakeRank(link, 1, pid=1, instance_id=0xB1)
        _register_until_known(link, rank0, rank1)
        _init(link, rank0, rank1)
        assert {state.instance_id for state in link.ranks.values()} == {0xA0, 0xB1}
        replacement = FakeRank(link, 0, pid=1, instance_id=0xC2)  # rank 0's new pod, pid 1 again
        time.sleep(0.2)  # subscribed, as a restarted worker is before it registers
        replacement.register()
        with pytest.raises(WorkerLost, match="registered again as instance 00000000000000c2"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # keyed by pid this was rank 0's heartbeat
                link.drain()
                time.sleep(0.01)
        link.forget_ranks()
        (shutdown,) = [m.shutdown for m in replacement.received() if m.WhichOneof("kind") == "shutdown"]
        assert sorted(shutdown.instance_ids) == [0xA0, 0xB1]  # not the replacement, though its pid is 1 too
        rank1_again = FakeRank(link, 1, pid=1, instance_id=0xD3)
        _register_until_known(link, replacement, rank1_again)  # not refused as dismissed
        assert {rank: state.instance_id for rank, state in link.ranks.items()} == {0: 0xC2, 1: 0xD3}
        for rank in (rank0, rank1, replacement, rank1_again):
            rank.close()
    finally:
        link.close()


def test_garbage_and_unexpected_worker_messages_are_dropped_and_the_step_still_completes(link):
    """Frames that do not parse, empty messages, ranks outside the replica and results of other
    steps are dropped and counted; none of them raises, and the awaited result still arrives."""
    from pagedserve.contracts.plan_codec import encode_result
    from pagedserve.contracts.step_plan import StepPlan, StepResult

    rank = FakeRank(link, 0, pid=5001)
    _register_until_known(link, rank)
    _init(link, rank)
    for frame in (b"\xff\xff\xff", b"\x0a\x05ab", b"", b"\x12\x01"):
        rank.push.send(frame)
    rank.push.send(step_pb2.WorkerMessage(register=step_pb2.Register(
        rank=3, world_size=7, num_gpu_blocks=1, pid=6666)).SerializeToString())
    plan = StepPlan(step_id=41)
    link.publish(plan)
    rank.push.send(encode_result(StepResult(step_id=40, samples=[], epoch=link.epoch)))  # a stale step
    rank.push.send(encode_result(StepResult(step_id=41, samples=[], epoch=link.epoch - 1)))  # another epoch
    rank.push.send(encode_result(StepResult(step_id=41, samples=[], epoch=link.epoch)))
    result = link.wait_result(plan)
    assert (result.step_id, result.epoch) == (41, link.epoch)
    assert link.num_dropped == 7
    assert list(link.ranks) == [0] and link.ranks[0].pid == 5001
    rank.close()


def test_with_curve_keys_only_the_workers_key_gets_through(monkeypatch):
    """A local process without the workers' secret key reads no plan and pushes no message; one
    with another key pair is refused by the ZAP handler; the real rank serves as before."""
    from pagedserve.security.zmq_curve import CURVE_ENVS, curve_keys_from_env, ensure_curve_keys, secure_client

    for name in CURVE_ENVS:  # recorded as they were (usually unset), so teardown removes the new keys
        monkeypatch.setenv(name, "")
    ensure_curve_keys()
    keys = curve_keys_from_env()
    link = _link()
    try:
        rank = FakeRank.__new__(FakeRank)
        rank.rank, rank.pid, rank.instance_id, rank.world_size = 0, 7001, 7001, 1
        context = zmq.Context.instance()
        rank.sub, rank.push = context.socket(zmq.SUB), context.socket(zmq.PUSH)
        for socket in (rank.sub, rank.push):
            socket.setsockopt(zmq.LINGER, 0)
            secure_client(socket, keys)
        rank.sub.setsockopt(zmq.SUBSCRIBE, b"")
        rank.sub.connect(link.plan_address)
        rank.push.connect(link.result_address)

        plain = FakeRank(link, 0, pid=6001)  # no CURVE at all
        other_public, other_secret = zmq.curve_keypair()
        forged = FakeRank.__new__(FakeRank)
        forged.rank, forged.pid, forged.instance_id, forged.world_size = 0, 6002, 6002, 1
        forged.sub, forged.push = context.socket(zmq.SUB), context.socket(zmq.PUSH)
        for socket in (forged.sub, forged.push):
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = \
                other_secret, other_public, keys.server_public
        forged.sub.setsockopt(zmq.SUBSCRIBE, b"")
        forged.sub.connect(link.plan_address)
        forged.push.connect(link.result_address)
        registration = step_pb2.WorkerMessage(register=step_pb2.Register(
            rank=0, world_size=1, num_gpu_blocks=32, device="cpu", pid=6000)).SerializeToString()
        for intruder in (plain, forged):
            for frame in (b"\xff\xff\xff", registration):
                try:  # a PUSH with no completed handshake has nowhere to send
                    intruder.push.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass

        _register_until_known(link, rank)
        _init(link, rank)
        assert link.ranks[0].pid == 7001 and link.num_dropped == 0
        for intruder in (plain, forged):
            assert intruder.received(0.3) == []  # no plan reached it
            intruder.close()
        rank.close()
    finally:
        link.close()


@pytest.mark.parametrize("num_steps", [6, 1])
def test_an_interrupt_while_a_run_is_awaited_publishes_end_run(link, num_steps):
    """interrupt() from another thread (a request arrived) while a decode run's result is awaited:
    the link publishes EndRun for that step and still returns the run's result; for a one-step
    plan it publishes nothing."""
    import threading

    from pagedserve.contracts.plan_codec import encode_result
    from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqSample, StepPlan, StepResult

    rank = FakeRank(link, 0, pid=3003)
    _register_until_known(link, rank)
    _init(link, rank)
    plan = StepPlan(step_id=5, seqs=[ScheduledSeq(1, [7], 3, [0], SampleSpec())], continuable=True, num_steps=num_steps)
    link.publish(plan)
    box = []
    waiter = threading.Thread(target=lambda: box.append(link.wait_result(plan)))
    waiter.start()
    assert [m.WhichOneof("kind") for m in rank.received(0.3)] == ["step_plan"]
    threading.Thread(target=link.interrupt).start()
    got = rank.received(0.5)
    if num_steps > 1:
        (end,) = [m.end_run for m in got if m.WhichOneof("kind") == "end_run"]
        assert (end.epoch, end.step_id) == (link.epoch, 5)
    else:
        assert not got
    rank.push.send(encode_result(StepResult(5, [SeqSample(1, 9, -0.5), SeqSample(1, 4, -0.5)], epoch=link.epoch,
                                            num_steps=2)))
    waiter.join(5)
    assert box and box[0].num_steps == 2
    rank.close()
