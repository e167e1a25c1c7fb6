"""The OpenAI-compatible HTTP layer over `server.engine`: `app` (routes, auth, lifecycle),
`protocol` (request validation), `chat` / `completions` (the endpoints), `streaming` (shared SSE
and request plumbing), `errors` (OpenAI error shapes), `metrics` (Prometheus), `server` (uvicorn)."""
