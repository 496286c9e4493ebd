"""kernels/native/work_share.h, the kernels' split of a parallel loop: compiled into a probe with the
system C compiler and OpenMP, which counts how often each item is taken over many parallel regions
(teams of every size up to more threads than parts, some threads held up so that others take from
their ranges, empty and tiny loops) and checks that a thread starts with the range
schedule(static) gives it, front to back."""

from __future__ import annotations

import subprocess

import pytest

from pagedserve.kernels.native import library as native_lib

PROBE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "work_share.h"

static void hold_up(int microseconds) {
    struct timespec until, now;
    clock_gettime(CLOCK_MONOTONIC, &until);
    long ns = until.tv_nsec + microseconds * 1000L;
    until.tv_sec += ns / 1000000000L, until.tv_nsec = ns % 1000000000L;
    do clock_gettime(CLOCK_MONOTONIC, &now);
    while (now.tv_sec < until.tv_sec || (now.tv_sec == until.tv_sec && now.tv_nsec < until.tv_nsec));
}

int main(void) {
    int failures = 0, stolen = 0;
    static int taken[5000], taker[5000];
    const int64_t sizes[] = {0, 1, 2, 3, 7, 64, 65, 1000, 4999};
    for (int max_threads = 1; max_threads <= 4; max_threads++)
        for (int team = 1; team <= 5; team++)
            for (int s = 0; s < (int)(sizeof sizes / sizeof sizes[0]); s++)
                for (int64_t chunk = 1; chunk <= 9; chunk += 4) {
                    const int64_t n = sizes[s];
                    for (int64_t i = 0; i < n; i++) taken[i] = 0, taker[i] = -1;
                    omp_set_num_threads(max_threads);
                    struct work_share share;
                    work_share_init(&share, n);
                    int64_t firsts[8];
                    for (int t = 0; t < 8; t++) firsts[t] = -1;
#pragma omp parallel num_threads(team)
                    {
                        struct work_cursor cursor = work_cursor_start();
                        const int self = omp_get_thread_num();
                        int64_t first, count, calls = 0;
                        if (self == 0) hold_up(200); /* the others run into thread 0's range */
                        while ((count = work_next(&share, &cursor, chunk, &first)) > 0) {
                            if (calls++ == 0) firsts[self] = first;
                            if (count > chunk) failures++;
                            for (int64_t i = first; i < first + count; i++) {
                                __atomic_add_fetch(&taken[i], 1, __ATOMIC_RELAXED);
                                taker[i] = self;
                            }
                        }
                    }
                    for (int64_t i = 0; i < n; i++)
                        if (taken[i] != 1) {
                            printf("item %ld taken %d times (max %d team %d n %ld chunk %ld)\n", (long)i,
                                   taken[i], max_threads, team, (long)n, (long)chunk);
                            failures++;
                        }
                    /* a thread that owns a part starts at its front, as schedule(static) would (others
                       take a part's front only by taking the whole of it from the back) */
                    int parts = max_threads;
                    for (int t = 1; t < team && t < parts; t++) {
                        int64_t q = n / parts, r = n % parts, begin = t * q + (t < r ? t : r);
                        int64_t end = begin + q + (t < r);
                        if (begin < end && taker[begin] == t && firsts[t] != begin) {
                            printf("thread %d started at %ld, not %ld\n", t, (long)firsts[t], (long)begin);
                            failures++;
                        }
                    }
                    if (team > 1 && max_threads > 1 && n >= 64)
                        for (int64_t i = 0; i < n / max_threads; i++) stolen += taker[i] != 0;
                }
    printf("failures %d stolen %d\n", failures, stolen);
    return failures != 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    compiler = native_lib.compiler()
    if compiler is None:
        pytest.skip("needs a C compiler")
    work = tmp_path_factory.mktemp("work_share")
    source, binary = work / "probe.c", work / "probe"
    source.write_text(PROBE)
    subprocess.run([compiler, "-O2", "-std=gnu11", "-fopenmp", "-I", str(native_lib.SOURCE_DIR), str(source),
                    "-o", str(binary)], check=True, capture_output=True, text=True, timeout=120)
    return binary


def test_every_item_is_taken_once_and_each_thread_starts_with_its_static_range(probe):
    result = subprocess.run([str(probe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]
    stolen = int(result.stdout.split()[-1])
    # thread 0 was held up 200 us at the start of every loop: the others took items of its range
    assert stolen > 0, result.stdout
