"""The FastAPI app: routes, API-key guard, error shapes, metrics, and the engine's lifecycle.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics (Prometheus), GET /debug/engine (the engine's page accounting, for tests and
operators). With an API key set, /v1/* and /debug/* need `Authorization: Bearer KEY` (401 without).
The engine thread starts with the app and stops with it. Must never do model work on the event loop.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from server.api import chat, completions, errors
from server.api.errors import APIError
from server.api.metrics import Metrics
from server.engine.async_engine import AsyncEngine

log = logging.getLogger("beam.api")


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    served_models: list[str]
    api_key: str | None = None
    fingerprint: str = "fp_beam"
    constrain: str = "tools"  # what is decoded under a grammar unasked (structures.CONSTRAIN)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = None

    def __post_init__(self):
        self.metrics = self.metrics or Metrics(self.engine)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


class _Guard:
    """Pure ASGI middleware (streaming-safe): the API-key check and counting error responses, those
    answered outside it (an unhandled error's 500) included; a client that leaves is no error."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key, path = self.state.api_key, scope["path"]
        if key and path.startswith(("/v1", "/debug")):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + key.encode()):
                self.state.metrics.rejected.labels("401").inc()
                err = APIError(401, "incorrect or missing API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")
                return await err.response()(scope, receive, send)

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.state.metrics.rejected.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except ClientDisconnect:  # the client left (mid-body, say): routine, so a debug line and no traceback
            log.debug("client disconnected during %s %s", scope["method"], path)
            if not started:  # answered (to no one) like the handlers' own disconnects, so it is counted once
                await Response(status_code=499)(scope, receive, counting_send)
        except Exception:
            if not started:  # Starlette's ServerErrorMiddleware, outside this guard, answers it with a 500
                self.state.metrics.rejected.labels("500").inc()
            raise


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="Beam OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.beam = state
    errors.install(app)
    app.add_middleware(_Guard, state=state)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "beam-workbench",
                "max_model_len": state.max_model_len}

    @app.get("/health")
    async def health():
        ok = state.engine.accepting
        return JSONResponse({"status": "ok" if ok else "shutting_down"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/engine")
    async def debug_engine():
        return JSONResponse(json.loads(json.dumps({**state.engine.stats(),
                                                   "in_flight": state.engine.num_in_flight})))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(m) for m in state.served_models]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model not in state.served_models:
            raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
        return model_card(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create(request, state)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        return await completions.create(request, state)

    return app
