"""pagedserve.scheduler: the scheduler process (no torch). It owns one replica's block pools, queues
and preemption policy, and sends the workers one StepPlan per step.

The code map, with one line per module and a request's life across the processes:
docs/architecture.md.
"""
