"""Which replica (one scheduler and its worker ranks) a request goes to, when a frontend has
several (`--scheduler-address A --scheduler-address B …`).

Rule (--routing prefix, the default):

    keys   = the prompt's full-block keys, hashed exactly as the schedulers' prefix caches hash
             them (pagedserve/contracts/prefix_hash.py: BLAKE2b chained over each full block)
    hits_r = how many leading keys replica r's index holds (an LRU of the keys recently routed
             to r: what r's prefix cache most likely holds)
    load_r = requests in flight on r, as this frontend sees them
    best   = the candidate with the most hits (ties: the least loaded, then the smaller index);
             when no candidate has any hit, the one whose index is smallest (ties: the least
             loaded), so new prefixes spread the cached content evenly
    least  = the candidate with the lowest load (ties: the smaller index)

    if load_best - load_min > max(MIN_IMBALANCE, IMBALANCE_RATIO * load_min):
        route to least                            (best is overloaded)
    else:
        route to best

and the chosen replica's index learns the keys. Candidates are the ready replicas not yet tried
by this request. --routing round-robin takes the candidates in turn (the baseline prefix routing
is measured against).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from pagedserve.contracts.prefix_hash import full_block_keys

MAX_INDEXED_BLOCKS = 1 << 16  # keys remembered per replica
MIN_IMBALANCE = 4  # requests in flight by which the best replica may exceed the least loaded
IMBALANCE_RATIO = 0.5  # ... or this fraction of the least loaded one's load, whichever is more
ROUTING_POLICIES = ("prefix", "round-robin")


class PrefixIndex:
    """An LRU set of block keys: those recently routed to one replica."""

    def __init__(self, max_num_keys: int = MAX_INDEXED_BLOCKS) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._max_num_keys = max_num_keys

    def __len__(self) -> int:
        return len(self._keys)

    def num_leading_hits(self, keys: list[bytes]) -> int:
        """How many of keys, from the first, the index holds (a chained key implies its parents)."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def add(self, keys: list[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._max_num_keys:
            self._keys.popitem(last=False)


class ReplicaRouter:
    """Chooses a replica index per request (thread-safe); see the module docstring."""

    def __init__(self, policy: str = "prefix", block_size: int = 16, *,
                 max_indexed_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, not {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self._max_indexed_blocks = max_indexed_blocks
        self._indexes: dict[int, PrefixIndex] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def choose(self, prompt_token_ids: list[int], candidates: list[int], loads: dict[int, int]) -> int:
        """One of candidates (replica indices, non-empty) for the prompt; loads: in flight per index."""
        if not candidates:
            raise ValueError("no candidate replica")
        with self._lock:
            if self.policy == "round-robin":
                return candidates[next(self._turn) % len(candidates)]
            keys = full_block_keys(prompt_token_ids, self.block_size)
            hits = {index: self._index(index).num_leading_hits(keys) for index in candidates}
            sizes = {index: len(self._index(index)) for index in candidates}
            least = min(candidates, key=lambda index: (loads.get(index, 0), sizes[index], index))
            best = max(candidates, key=lambda index: (hits[index], -loads.get(index, 0), -sizes[index], -index))
            if hits[best] == 0:
                best = min(candidates, key=lambda index: (sizes[index], loads.get(index, 0), index))
            load_min, load_best = loads.get(least, 0), loads.get(best, 0)
            is_imbalanced = load_best - load_min > max(MIN_IMBALANCE, IMBALANCE_RATIO * load_min)
            chosen = least if is_imbalanced else best
            self._index(chosen).add(keys)
            return chosen

    def forget(self, index: int) -> None:
        """Replica index lost its cache (its scheduler restarted): nothing is indexed for it."""
        with self._lock:
            self._indexes.pop(index, None)

    def _index(self, index: int) -> PrefixIndex:
        found = self._indexes.get(index)
        if found is None:
            found = self._indexes[index] = PrefixIndex(self._max_indexed_blocks)
        return found
