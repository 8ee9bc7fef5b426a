"""The engine in one thread of its own; asyncio code talks to it through thread-safe queues.

    engine = AsyncEngine(Engine(llm, cfg)); engine.start()                 # a background thread
    engine = AsyncEngine(Engine(llm, cfg), own_thread=False); engine.run_here()   # the calling thread
    async for out in engine.generate(EngineRequest(...)): ...   # SeqOutput per step per choice
    engine.abort(request_id)                                     # also done when the iterator is closed

Requests and aborts go in through one queue.SimpleQueue; the thread steps the engine while it has
work and hands a step's SeqOutputs to their requests' asyncio.Queues, one loop.call_soon_threadsafe per
step (_deliver_all). Nothing
crosses a process boundary, so nothing is serialised. A request whose row fails in a step ends with that
error alone (Engine.step); if the step itself raises, every request in flight ends with that error and the
engine is emptied (blocks freed), then goes on serving.

`specdec serve` runs the engine on the main thread and uvicorn on another (run_here): libgomp, which
runs the C kernels' parallel regions, throttles its workers' spin-wait when a thread other than the
process's first one starts the regions on a machine with few cores (more managed threads than CPUs),
and each of a step's ~120 regions then waits for a sleeping worker: measured on a 2-core Xeon, a bf16
decode step 14 ms on the main thread, 23 ms on a second one. The C kernels now run on their own pool
off the main thread (specdec/kernels/pool.c), but torch's ops between them still run in libgomp.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from specdec.engine.engine import Engine
from specdec.engine.request import EngineRequest, EngineStats, SeqOutput

log = logging.getLogger("specdec.engine")


@dataclass
class EngineFailure:
    message: str
    status: int = 500  # 400: the request's own parameters made it fail


class RequestFailed(RuntimeError):
    """What generate() raises for a request the engine ended with an error (status: as EngineFailure's)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: one step's items into their requests' queues, in the engine's order."""
    for q, item in puts:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: Engine, on_stats: Callable[[EngineStats], None] | None = None,
                 own_thread: bool = True):
        self.engine = engine
        self.own_thread = own_thread  # False: start() leaves the loop to run_here() in the caller's thread
        self._here = False
        self.on_stats = on_stats
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- asyncio side -------------------------------------------------------------------------
    def start(self) -> None:
        if self.own_thread:
            self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
            self._thread.start()

    def run_here(self, while_true: Callable[[], bool] = lambda: True) -> None:
        """Run the engine loop in this thread until shutdown() (or while_true() turns false)."""
        self._here = True
        try:
            self._loop(while_true)
        finally:
            self._here = False

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._here or (self._thread is not None and self._thread.is_alive())

    async def generate(self, req: EngineRequest) -> AsyncIterator[SeqOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        n = req.params.n
        with self._lock:
            self._queues[req.request_id] = (loop, q)
        self._inbox.put(("add", req))
        done = 0
        try:
            while done < n:
                item = await q.get()
                if isinstance(item, EngineFailure):
                    raise RequestFailed(item.message, item.status)
                done += item.finished
                yield item
        finally:
            with self._lock:
                self._queues.pop(req.request_id, None)
            if done < n:  # the consumer went away (client disconnect, timeout): free everything now
                self._inbox.put(("abort", req.request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # --- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand each (request id, item) to its request's queue: one call_soon_threadsafe per event loop
        for the whole step, not one per output. Each call writes to the loop's wake-up socket, a syscall
        that lets go of the GIL, which the engine thread must then win back from the server's thread (py-spy,
        bf16, c = 16: the hand-offs were 2.4% of the engine thread's samples, 1.7-2.3% after; what remains
        is the wait for the server thread's SSE work)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                target = self._queues.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the loop is closed
                pass

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
            except ValueError as e:
                self._deliver(payload.request_id, EngineFailure(str(e), 400))
        elif kind == "abort":
            self.engine.abort(payload)
            self._report_stats()

    def _report_stats(self) -> None:
        if self.on_stats is None:
            return
        try:
            self.on_stats(self.engine.stats())
        except Exception:  # noqa: BLE001 - the metrics must not stop the engine thread
            log.exception("reporting the engine's stats failed")

    def _loop(self, while_true: Callable[[], bool] = lambda: True) -> None:
        try:
            self._serve_inbox_and_step(while_true)
        finally:  # however the loop ends, no request is left waiting for it (nor one still in the inbox)
            self._fail_all("the server is shutting down", everyone=True)

    def _serve_inbox_and_step(self, while_true: Callable[[], bool]) -> None:
        eng = self.engine
        while not self._stop.is_set() and while_true():
            try:
                block = not eng.has_unfinished()
                kind, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                if kind == "stop":
                    break
                try:
                    self._handle(kind, payload)
                except Exception as e:  # noqa: BLE001 - one bad request must not end the engine thread
                    log.exception("engine %s failed", kind)
                    if kind == "add":
                        self._deliver(payload.request_id, EngineFailure(f"engine error: {type(e).__name__}: {e}"))
                continue  # drain the inbox before stepping
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                continue
            self._deliver_all([(out.request_id, EngineFailure(out.error, out.error_status) if out.error else out)
                               for out in outs])
            self._report_stats()

    def _fail_all(self, message: str, everyone: bool = False) -> None:
        """Abort the engine's requests, each failed with `message`; everyone: the requests still in the inbox
        too (the loop's end: nothing will take them)."""
        failed = list(self.engine.seqs)
        for request_id in failed:
            self.engine.abort(request_id)
        if everyone:
            with self._lock:
                failed = list(dict.fromkeys(failed + list(self._queues)))
        self._deliver_all([(request_id, EngineFailure(message)) for request_id in failed])
