"""OpenAI-compatible server that serves a locked Beam build (engine + HTTP API)."""
