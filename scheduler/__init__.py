"""pagedserve.scheduler: the scheduler process (no torch). It owns the block pools, the queues and
the preemption policy, and sends the workers one StepPlan per step.

server.py (process, internal gRPC service, drain; metrics.py) -> engine.py (the step loop thread;
admission.py: back-pressure; worker_link.py: ZeroMQ to the workers) -> scheduler.py (the core:
requests in, step plans out, results back):
  request_intake.py   Request -> SequenceGroup, or rejected (sequence.py: sequences and groups)
  step_builder.py     one step within the budget (sample_specs.py: what each sampling sequence
                      asks of the sampler; preemption.py: the victim, swap or recompute, the act;
                      chunk_planning.py: a group's new tokens cut into chunks within the budget)
  output_processor.py sampled tokens, stops and deltas (beam_search.py: beam scores as HF does
                      them; beam_forking.py: the next step's beams)
  block_manager.py    block tables: copy-on-write, forking, swapping; over block_pool.py (ref
                      counts, free list, cached blocks) and prefix_cache.py
  invariants.py       the accounting checks tests run after every step
  spec_drafting.py    speculation: n-gram proposals (ngram_proposer.py) appended as extra
                      scheduled tokens; spec_acceptance.py: the verified tokens, KV rollback
scheduler_config.py, scheduler_stats.py and errors.py hold the core's config, counters and errors.
"""
