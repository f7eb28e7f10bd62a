"""engine/threads.py's release_openmp_pool: the server frees the main thread's OpenMP workers before
its engine thread takes over the steps (why: the function's docstring)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from minserve.engine.threads import release_openmp_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs two cores and Linux's /proc")
def test_releasing_ends_this_threads_openmp_workers_and_a_later_region_still_runs():
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.arange(4_000_000, dtype=torch.float32)
        assert float((x * 2).sum()) == pytest.approx(2 * float(x.sum()))   # a team of two: a pool
        with_pool = _threads()
        assert release_openmp_pool() is True
        deadline = time.monotonic() + 5
        while _threads() >= with_pool and time.monotonic() < deadline:
            time.sleep(0.01)              # the released workers exit on their own
        assert _threads() < with_pool
        assert float((x * 3).sum()) == pytest.approx(3 * float(x.sum()))   # a new pool, same result
    finally:
        torch.set_num_threads(before_threads)
