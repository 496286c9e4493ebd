"""The replica router: prefix affinity by the schedulers' own block keys, the imbalance escape
to the least loaded replica, round-robin, and the LRU index."""

from __future__ import annotations

import argparse

from pagedserve.config.flags import add_flags, from_args, to_argv
from pagedserve.frontend.config import FrontendConfig
from pagedserve.frontend.upstream.router import MIN_IMBALANCE, PrefixIndex, ReplicaRouter
from pagedserve.contracts.prefix_hash import full_block_keys
from pagedserve.scheduler.kv.prefix_cache import hash_block

BLOCK = 4


def _prompt(system: int, suffix: int) -> list[int]:
    return [system] * (3 * BLOCK) + [suffix, suffix + 1]


def test_keys_are_the_schedulers_prefix_cache_keys():
    tokens = list(range(1, 11))
    first = hash_block(None, tokens[:BLOCK])
    assert full_block_keys(tokens, BLOCK) == [first, hash_block(first, tokens[BLOCK:2 * BLOCK])]
    assert full_block_keys(tokens, BLOCK, max_num_blocks=1) == [first]


def test_same_prefix_goes_to_the_same_replica_and_new_prefixes_spread():
    router = ReplicaRouter("prefix", BLOCK)
    loads = {0: 0, 1: 0}
    first = router.choose(_prompt(7, 100), [0, 1], loads)
    loads[first] += 1
    other = router.choose(_prompt(8, 100), [0, 1], loads)
    assert other != first  # nothing cached anywhere: the replica with the smaller index
    loads[other] += 1
    for suffix in range(10):
        assert router.choose(_prompt(7, 200 + suffix), [0, 1], loads) == first
        assert router.choose(_prompt(8, 200 + suffix), [0, 1], loads) == other


def test_imbalance_sends_a_cached_prefix_to_the_least_loaded_replica():
    router = ReplicaRouter("prefix", BLOCK)
    home = router.choose(_prompt(7, 1), [0, 1], {0: 0, 1: 0})
    away = 1 - home
    assert router.choose(_prompt(7, 2), [0, 1], {home: MIN_IMBALANCE, away: 0}) == home
    assert router.choose(_prompt(7, 3), [0, 1], {home: MIN_IMBALANCE + 1, away: 0}) == away
    # the chosen replica learned the keys: both now hold the prefix, the least loaded wins
    assert router.choose(_prompt(7, 4), [0, 1], {home: 1, away: 0}) == away


def test_only_candidates_are_chosen_and_forget_drops_the_index():
    router = ReplicaRouter("prefix", BLOCK)
    assert router.choose(_prompt(7, 1), [1], {0: 0, 1: 5}) == 1
    assert router.choose(_prompt(7, 1), [0, 1], {0: 0, 1: 0}) == 1
    router.forget(1)
    assert router.choose(_prompt(7, 1), [0, 1], {0: 0, 1: 0}) == 0


def test_round_robin_takes_turns():
    router = ReplicaRouter("round-robin", BLOCK)
    assert [router.choose(_prompt(7, 1), [0, 1], {}) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_index_is_lru_and_counts_leading_hits():
    index = PrefixIndex(max_num_keys=3)
    index.add([b"a", b"b", b"c"])
    assert index.num_leading_hits([b"a", b"b", b"x", b"c"]) == 2
    index.add([b"a", b"d"])  # a refreshed, b evicted
    assert index.num_leading_hits([b"a", b"b"]) == 1 and len(index) == 3


def test_scheduler_address_repeats_and_round_trips():
    parser = argparse.ArgumentParser()
    add_flags(parser, FrontendConfig)
    args = parser.parse_args(["--model", "m", "--scheduler-address", "a:1", "--scheduler-address", "b:2"])
    config = from_args(FrontendConfig, args)
    assert config.scheduler_addresses == ["a:1", "b:2"]
    argv = to_argv(config)
    assert argv.count("--scheduler-address") == 2
    assert from_args(FrontendConfig, parser.parse_args(argv)).scheduler_addresses == ["a:1", "b:2"]
    single = from_args(FrontendConfig, parser.parse_args(["--model", "m", "--scheduler-address", "a:1"]))
    assert single.scheduler_address == "a:1"


def test_only_dns_names_are_resolved_into_replicas():
    from pagedserve.frontend.upstream.replica_set import is_dns_name, resolve

    assert not is_dns_name("127.0.0.1:6000") and not is_dns_name("[::1]:6000") and not is_dns_name("localhost:1")
    assert is_dns_name("pagedserve-replicas.default.svc:6000")
    assert resolve("127.0.0.1:6000") == ["127.0.0.1:6000"]
    assert resolve("no-such-host.invalid:6000") == ["no-such-host.invalid:6000"]
