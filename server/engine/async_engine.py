"""The engine on its own thread, for asyncio callers (the HTTP server).

One background thread owns the `Engine`: it takes "add" / "abort" commands from a queue, steps
while there is work and sleeps on the queue when there is none. Each request's outputs are handed
to the event loop and land in that request's asyncio queue. `open()` returns a RequestStream (an
async iterator); closing it early (a client disconnect) aborts the request, which frees its pages
on the engine thread's next turn (within one step). Must never touch the `Engine` from the event
loop thread except `check_request`, which reads only constants.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from server.engine.llm_engine import Engine
from server.engine.output import RequestOutput
from server.engine.sampling_params import SamplingParams

log = logging.getLogger("beam.engine")


class EngineUnavailable(RuntimeError):
    """No new request can be taken now (overloaded or shutting down): an HTTP 503."""


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queue_len: int = 1024):
        self.engine = engine
        self.max_in_flight = engine.max_num_seqs + max_queue_len
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="beam-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop taking requests, fail the ones in flight, and join the engine thread."""
        self.accepting = False
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout=30)
            self._thread = None
        for q in self._streams.values():
            q.put_nowait(EngineUnavailable("the server is shutting down"))
        self._streams.clear()

    def stats(self) -> dict:
        return self._stats  # replaced (never mutated) by the engine thread: a consistent snapshot

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests --------------------------------------------------------------------------
    def open(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> "RequestStream":
        """Submit a request; raises ValueError (bad request) or EngineUnavailable before anything
        is queued, so callers can still answer with a plain HTTP error."""
        if not self.accepting or self._thread is None:
            raise EngineUnavailable("the server is shutting down")
        if len(self._streams) >= self.max_in_flight:
            raise EngineUnavailable(f"the server is overloaded ({len(self._streams)} requests in flight); "
                                    "retry later")
        self.engine.check_request(prompt_ids, params)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream.queue
        self._commands.put(("add", request_id, prompt_ids, params))
        return stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            cmds = [self._commands.get()] if not eng.has_unfinished() else []
            while True:
                try:
                    cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            outputs: list = []
            for cmd in cmds:
                if cmd[0] == "stop":
                    return
                if cmd[0] == "add":
                    try:
                        eng.add_request(*cmd[1:])
                    except Exception as e:  # noqa: BLE001 - reported to that request only
                        outputs.append((cmd[1], e))
                elif cmd[0] == "abort":
                    eng.abort(cmd[1])
            try:
                if eng.has_unfinished():
                    outputs.extend((o.request_id, o) for o in eng.step())
            except Exception as e:  # noqa: BLE001 - an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed; failing every request in flight")
                try:
                    outputs.extend((o.request_id, o) for o in eng.abort_all(f"engine failure: {e}"))
                except Exception:  # noqa: BLE001 - the engine's state is beyond repair: stop taking work
                    log.exception("engine state is broken; the server refuses new requests")
                    self.accepting = False
                    self._loop.call_soon_threadsafe(self._fail_all)
                    return
            self._stats = eng.stats()
            if outputs:
                try:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                except RuntimeError:  # the event loop is gone: the server is exiting
                    return

    def _fail_all(self) -> None:
        for q in self._streams.values():
            q.put_nowait(EngineUnavailable("the engine failed; the server must be restarted"))
        self._streams.clear()

    def _deliver(self, outputs: list) -> None:
        for request_id, out in outputs:
            q = self._streams.get(request_id)
            if q is not None:
                q.put_nowait(out)
                if isinstance(out, Exception) or out.finished:  # nothing more will come: forget it
                    del self._streams[request_id]


class RequestStream:
    """One request's outputs as an async iterator; `close()` aborts it if it has not finished."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.last: RequestOutput | None = None  # the latest output (usage, finish reason)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self.queue.get()
        if isinstance(out, Exception):
            self.done = True
            raise out
        self.done, self.last = out.finished, out
        return out

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine._abort(self.request_id)
