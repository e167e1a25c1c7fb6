"""Candidate code runs here and nowhere else: a process of its own that imports one variant and calls it on
tensors the judge sends, through shared memory (torch.multiprocessing: CPU tensors in shared segments,
CUDA tensors by IPC handle), over a pipe the judge opened.

The judge's side (`Sandbox`) owns every clock, input, reference, tolerance and verdict; the sandbox
holds none of them, so code that patches a timer, a tolerance or the reference, walks frames, or
rewrites a result file at exit changes only its own process. `Sandbox.variant()` is a `Variant` whose
function and weight transform run in the sandbox, so the op gate runs unchanged on it: in-place
arguments (a KV cache) are shared, so the sandbox's writes are the judge's; generators travel as their
states and come back advanced. Every gate call runs twice in the sandbox, plain and with uninitialised
memory poisoned, in a random order, and the two must agree bit for bit: a variant that can tell the
checks from real calls is caught by the difference. Outputs must be plain `torch.Tensor`s.

Timing (`prepare_batch`, `run_batch`): the judge places a batch of input copies and as many output
slots in shared memory; a run calls the variant on each copy, copies each output into its slot, waits
for the device, and answers. The judge times the round trip, less the least empty round trip of the
trusted sandboxes (`empty_round_trip`; a candidate could slow its own empty ones to shrink its times),
refills the copies' values in place before every run (a cache keyed by value or address never pays),
and re-checks a random sample of the slots against the reference after the run: which ones, the
sandbox cannot know.
"""

from __future__ import annotations

import os
import random
import time
import traceback

import torch

from workbench.gates import same_bits
from workbench.registry import Variant

START_TIMEOUT_S = 300.0


class SandboxError(RuntimeError):
    """The sandbox failed: the candidate raised (its traceback is the message), or the process died."""


class Child:
    """A spawned process that runs `serve(conn, *args)` and answers requests over a pipe this side opened;
    `info` is its first answer ("ready")."""

    def __init__(self, serve, args: tuple, name: str, *, start_timeout: float = START_TIMEOUT_S):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, daemon=True, name=name, args=(child, *args))
        self._proc.start()
        child.close()
        self.info = self._reply(timeout=start_timeout)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _reply(self, timeout: float | None = None):
        if timeout is not None and not self._conn.poll(timeout):
            raise SandboxError(f"the sandbox did not answer within {timeout:.0f} s")
        try:
            kind, *rest = self._conn.recv()
        except (EOFError, OSError):
            raise SandboxError(self._death()) from None
        if kind == "raised":
            raise SandboxError(rest[0])
        return rest[0] if len(rest) == 1 else tuple(rest)

    def _ask(self, *msg):
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError):
            raise SandboxError(self._death()) from None
        return self._reply()

    def _death(self) -> str:
        import signal

        self._proc.join(timeout=5)
        code = self._proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            return (f"the sandbox died of {name} (a crash in the candidate: segfault, abort, illegal memory "
                    "access)")
        return f"the sandbox exited (code {code}) while the candidate ran"

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _round_trip(self, *msg) -> float:
        started = time.perf_counter()
        self._ask(*msg)
        return time.perf_counter() - started


class Sandbox(Child):
    """One variant (`point:name` from `file`, or from the package when `file` is None) in its own process."""

    def __init__(self, point: str, name: str, *, file: str | None = None, config: dict | None = None,
                 device: str = "cpu", threads: int | None = None, static_check: bool = True):
        self.point, self.name, self.device, self.file = point, name, torch.device(device), file
        self._rng = random.Random()
        super().__init__(_serve, (point, name, file, config, device, threads or torch.get_num_threads(),
                                  static_check), f"sandbox {point}:{name}")

    # ---- the op gate's view ---------------------------------------------------------------------
    def variant(self) -> Variant:
        """This sandbox's variant as the gate calls it (metadata from the sandbox, code in it): the weight
        formats it reads and the format it quantizes activations to, as it declared them."""
        return Variant(self.point, self.name, self.info["backend"], self.call,
                       prepare=self.prepare if self.info["prepare"] else None,
                       origin=os.path.abspath(self.file) if self.file else None,
                       formats=tuple(self.info["formats"]), activations=self.info["activations"])

    def call(self, *args, **kwargs):
        """One call, run plain and poisoned (random order) in the sandbox; the two must agree bit for bit."""
        gens = {k: v for k, v in kwargs.items() if isinstance(v, torch.Generator)}
        sent = _generators_as_states(kwargs)
        first_poisoned = self._rng.random() < 0.5
        outs, states = [], None
        for poisoned in (first_poisoned, not first_poisoned):  # same generator states both times
            out, states = self._ask("call", args, sent, poisoned)
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            problem = _not_plain(out)
            if problem:
                raise SandboxError(problem)
            outs.append(out)
        if len(outs[0]) != len(outs[1]) or not all(same_bits(a, b) for a, b in zip(*outs)):
            raise SandboxError("outputs differ between a plain run and one with uninitialised memory poisoned "
                               "(a variant must compute the same whether or not it is being checked)")
        for k, state in states.items():
            gens[k].set_state(state)
        return outs[0][0] if len(outs[0]) == 1 else tuple(outs[0])

    def prepare(self, weights):
        return self._ask("prepare", weights)

    # ---- timing -----------------------------------------------------------------------------------
    def prepare_batch(self, key: str, calls: list, slots: list[list[torch.Tensor]]) -> None:
        """Hand the sandbox `calls` (args and kwargs in shared memory; generators as their states) and
        their output `slots`."""
        self._ask("batch", key, [(c.args, _generators_as_states(c.kwargs)) for c in calls], slots)

    def run_batch(self, key: str, order: list[int]) -> float:
        """Seconds of the round trip in which the sandbox runs the batch's calls in `order` (outputs into
        their slots, device synchronised)."""
        return self._round_trip("run", key, order)

    def empty_round_trip(self) -> float:
        """Seconds of a round trip that runs nothing: what the timing path itself costs."""
        return self._round_trip("run", "", [])


def _not_plain(outs: list) -> str | None:
    """Why `outs` are not all plain tensors (or None), or None. The sandbox says so for honest mistakes;
    the judge's side checks again, since the sandbox's word is the candidate's."""
    return next((f"output {i} is a {type(o).__name__}, not a plain torch.Tensor"
                 for i, o in enumerate(outs) if o is not None and type(o) is not torch.Tensor), None)


def _generators_as_states(kwargs: dict) -> dict:
    """`kwargs` with each generator as ("generator", device type, state): a generator does not pickle."""
    return {k: ("generator", v.device.type, v.get_state()) if isinstance(v, torch.Generator) else v
            for k, v in kwargs.items()}


def _states_as_generators(kwargs: dict) -> dict:
    """`_generators_as_states` undone, in the sandbox."""
    return {k: _generator(v) if isinstance(v, tuple) and v[:1] == ("generator",) else v for k, v in kwargs.items()}


# ------------------------------------------------------------------------------------ the sandbox's side

def _serve(conn, point, name, file, config, device, threads, static_check) -> None:
    import torch.utils.deterministic as det

    from workbench import registry

    torch.set_num_threads(threads)
    try:
        if file is not None:
            from workbench.agent.plugins import load_file

            load_file(file, static=static_check)
        v = registry.get(point, name)
        fn = v.at(config) if config else v.fn
    except BaseException:  # noqa: BLE001 - reported to the judge, whatever the candidate raised
        conn.send(("raised", "the variant did not load:\n" + traceback.format_exc(limit=-8)))
        return
    conn.send(("ready", {"backend": v.backend, "prepare": v.prepare is not None, "formats": list(v.formats),
                         "activations": v.activations}))
    batches: dict = {}
    cuda = torch.device(device).type == "cuda"

    def answer(kind: str, msg: tuple):
        if kind == "call":
            args, kwargs, poisoned = msg
            kwargs = _states_as_generators(kwargs)
            gens = {k: g for k, g in kwargs.items() if isinstance(g, torch.Generator)}
            was = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
            torch.use_deterministic_algorithms(poisoned, warn_only=True)
            det.fill_uninitialized_memory = poisoned
            try:
                with torch.no_grad():
                    out = fn(*args, **kwargs)
            finally:
                torch.use_deterministic_algorithms(was[0], warn_only=True)
                det.fill_uninitialized_memory = was[1]
            if cuda:
                torch.cuda.synchronize()
            problem = _not_plain(list(out) if isinstance(out, (tuple, list)) else [out])
            if problem:
                raise TypeError(problem)
            return out, {k: g.get_state() for k, g in gens.items()}
        if kind == "prepare":
            return v.prepare_weights(msg[0])
        if kind == "batch":
            key, calls, slots = msg
            batches[key] = ([(args, _states_as_generators(kwargs)) for args, kwargs in calls], slots)
            return None
        if kind == "run":
            key, order = msg
            calls, slots = batches[key] if order else ([], [])
            with torch.no_grad():
                for i in order:
                    args, kwargs = calls[i]
                    out = fn(*args, **kwargs)
                    out = out if isinstance(out, (tuple, list)) else [out]
                    if len(out) != len(slots[i]):
                        raise ValueError(f"{len(out)} outputs, the contract has {len(slots[i])}")
                    for slot, o in zip(slots[i], out):
                        if slot is not None:
                            slot.copy_(o)
            if cuda:
                torch.cuda.synchronize()
            return None
        raise ValueError(f"unknown request {kind!r}")

    serve_requests(conn, answer)


def serve_requests(conn, answer) -> None:
    """A child's side of `Child`, once it has sent "ready": each request `(kind, *args)` is answered with
    `answer(kind, args)`, or with the traceback of what it raised (the code under test's failure is the
    caller's to report), until "close" or the pipe's end."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            return
        try:
            conn.send(("ok", answer(msg[0], msg[1:])))
        except BaseException:  # noqa: BLE001 - whatever the code under test raised
            conn.send(("raised", traceback.format_exc(limit=-8)))


def _generator(marker) -> torch.Generator:
    _, device, state = marker
    g = torch.Generator(device=device)
    g.set_state(state)
    return g
