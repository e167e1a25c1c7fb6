"""Run the HTTP server: wrap an `Engine` for asyncio, build the app, hand it to uvicorn.

On SIGINT/SIGTERM, or when the caller's `stop` event is set, the server stops taking requests at
once (new ones get 503, /health says shutting_down), lets streams in flight finish for up to
`graceful_s` seconds, then stops the engine (what is still running gets an error event). Must never
load models itself: the CLI does that.
"""

from __future__ import annotations

import hashlib
import json
import threading

import uvicorn

from server.api.app import ServerState, build_app
from server.engine.async_engine import AsyncEngine


class _Server(uvicorn.Server):
    def __init__(self, config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.engine.accepting = False  # before uvicorn starts draining: new requests get 503
        super().handle_exit(sig, frame)


def fingerprint(engine) -> str:
    m = engine.model
    blob = json.dumps([m.config.config_hash(), m.ops.selection, str(m.dtype)], sort_keys=True)
    return "fp_" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def make_state(engine, tokenizer, *, served_model_name: str, api_key: str | None = None,
               max_queue_len: int = 1024, constrain: str = "tools") -> ServerState:
    return ServerState(AsyncEngine(engine, max_queue_len=max_queue_len), tokenizer, [served_model_name],
                       api_key=api_key, fingerprint=fingerprint(engine), constrain=constrain)


def serve(engine, tokenizer, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str,
          api_key: str | None = None, max_queue_len: int = 1024, graceful_s: int = 10,
          log_level: str = "info", constrain: str = "tools", stop: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM, or until `stop` is set (the same graceful shutdown)."""
    state = make_state(engine, tokenizer, served_model_name=served_model_name, api_key=api_key,
                       max_queue_len=max_queue_len, constrain=constrain)
    config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_s, access_log=False)
    server = _Server(config, state)
    if stop is not None:
        def stop_when_set():
            stop.wait()
            state.engine.accepting = False
            server.should_exit = True

        threading.Thread(target=stop_when_set, name="beam-stop", daemon=True).start()
    server.run()
    return 0
