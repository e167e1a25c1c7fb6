"""Beam: a faithful PyTorch model of the 501B-parameter MoE decoder, written against fusion points.

Attributes load lazily so that `beam_model.config` can be read without importing torch.
"""

import importlib

_EXPORTS = {"BeamConfig": "beam_model.config", "PRESETS": "beam_model.config",
            "PagedKVCache": "beam_model.kv_cache", "BeamForCausalLM": "beam_model.model"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'beam_model' has no attribute {name!r}")
