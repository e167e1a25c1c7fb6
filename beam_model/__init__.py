"""Beam: a faithful PyTorch model of the 501B-parameter MoE decoder, written against fusion points."""

from beam_model.config import PRESETS, BeamConfig
from beam_model.kv_cache import PagedKVCache
from beam_model.model import BeamForCausalLM

__all__ = ["BeamConfig", "BeamForCausalLM", "PagedKVCache", "PRESETS"]
