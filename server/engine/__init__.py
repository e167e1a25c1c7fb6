"""The serving engine: continuous batching over a paged KV cache with prefix caching.

One concept per module: `sequence` (a request's state), `sampling_params`, `detokenizer` (text and
stop strings), `block_manager` (pages of both cache groups), `cache_sizing` (how many pages),
`scheduler` (who runs each step), `model_runner` (the step, CUDA graphs, sampling), `llm_engine`
(the synchronous engine), `async_engine` (the engine on its own thread for asyncio), `output`.
`testing` holds test-only hooks and is never imported by the rest.
"""

from server.engine.llm_engine import Engine
from server.engine.output import RequestOutput
from server.engine.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
