"""The kernels' worker pool (pool.c): every job completes, whoever calls and however fresh the pool is."""
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels

pytestmark = pytest.mark.skipif(kernels._load() is None, reason="C kernels unavailable")


def _linear_in_fresh_pool(x, w, expected) -> int:
    """Fork: the child's pool starts with no workers, so its first call creates them (the race that hung a
    worker created after its job was posted). 0 if the child's result was right, else a failure code.
    The child calls from a second thread (the pool's caller; the main thread runs OpenMP regions) and runs
    no torch op that could start OpenMP threads: libgomp's workers do not survive fork()."""
    pid = os.fork()
    if pid == 0:  # child: no pytest, no exceptions out of here
        code = 1
        try:
            ok = []
            t = threading.Thread(target=lambda: ok.extend(torch.equal(kernels.linear(x, w), expected) for _ in range(3)))
            t.start()
            t.join()
            code = 0 if ok == [True] * 3 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1  # hung


def test_a_fresh_pool_never_misses_its_first_job():
    torch.manual_seed(0)
    x, w = torch.randn(2, 256), torch.randn(1024, 256)
    expected = kernels.linear(x, w)  # the parent's pool, started here if it was not yet
    assert torch.allclose(expected, F.linear(x, w), atol=1e-4)
    for attempt in range(40):
        code = _linear_in_fresh_pool(x, w, expected)
        assert code == 0, f"fresh pool {attempt}: " + ("hung" if code == -1 else f"child exit code {code}")


def test_threads_calling_at_once_all_get_their_results():
    """Callers on other threads share the pool (one that finds it busy runs its job alone): every result
    stays exact, and the main thread's OpenMP regions alongside them too."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 512), torch.randn(2048, 512)
    expected = kernels.linear(x, w)
    results, errors = [], []

    def call():
        try:
            for _ in range(50):
                results.append(torch.equal(kernels.linear(x, w), expected))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    call()  # the main thread at the same time
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(results) == 250 and all(results)
