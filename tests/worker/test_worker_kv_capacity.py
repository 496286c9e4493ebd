"""A real worker process registers its KV capacity in blocks of its KV dtype, and loads quantized."""

from __future__ import annotations

import multiprocessing

import zmq

from pagedserve.internal import step_pb2
from pagedserve.worker.process import run_worker
from pagedserve.worker.config import WorkerConfig

BUDGET_GIB = 1 / 256


def _registered_blocks(checkpoint: str, **options) -> int:
    """Starts a worker, reads its first Register, then shuts it down; returns num_gpu_blocks."""
    context = zmq.Context()  # its own: the process-wide one may carry another test's ZAP handler
    plans = context.socket(zmq.PUB)
    plan_port = plans.bind_to_random_port("tcp://127.0.0.1")
    results = context.socket(zmq.PULL)
    result_port = results.bind_to_random_port("tcp://127.0.0.1")
    config = WorkerConfig(model_path=checkpoint, plan_address=f"tcp://127.0.0.1:{plan_port}",
                          result_address=f"tcp://127.0.0.1:{result_port}", device="cpu", dtype="float32",
                          swap_space_gib=0, kv_cache_memory_gib=BUDGET_GIB, num_threads=1,
                          allow_insecure_internal_transport=True, **options)
    process = multiprocessing.get_context("spawn").Process(target=run_worker, args=(config,))
    process.start()
    try:
        assert results.poll(120_000), "the worker never registered"
        message = step_pb2.WorkerMessage.FromString(results.recv())
        assert message.WhichOneof("kind") == "register", message
        return message.register.num_gpu_blocks
    finally:
        shutdown = step_pb2.SchedulerMessage(shutdown=step_pb2.Shutdown(reason="test done"))
        for _ in range(50):  # PUB drops messages until the worker's SUB has joined
            plans.send(shutdown.SerializeToString())
            process.join(0.1)
            if not process.is_alive():
                break
        if process.is_alive():
            process.terminate()
            process.join()
        plans.close(0)
        results.close(0)
        context.term()


def test_fp8_worker_registers_four_times_the_float32_blocks(checkpoint_dir, monkeypatch):
    from pagedserve.security.zmq_curve import CURVE_ENVS

    for name in CURVE_ENVS:  # this test's sockets are plain: so must the worker's be
        monkeypatch.delenv(name, raising=False)
    checkpoint = str(checkpoint_dir("llama-gqa-untied"))
    float32_blocks = _registered_blocks(checkpoint)
    fp8_blocks = _registered_blocks(checkpoint, kv_cache_dtype="fp8_e4m3", quantization="int8")
    assert float32_blocks > 0 and fp8_blocks == 4 * float32_blocks
