"""Helpers shared by the variant tests."""

import pytest

from workbench import registry


def available(point: str, name: str):
    """The variant, or skip the test with the reason its backend cannot run here."""
    v = registry.get(point, name)
    ok, why = registry.backend_available(v.backend)
    if not ok:
        pytest.skip(why)
    return v


def callables(v, extra=()):
    """(label, callable): the default and every tuning config (plus `extra` configs), each separately
    compiled or planned, so each is checked."""
    return [("default", v.fn)] + [(str(cfg), v.at(cfg)) for cfg in [*v.configs, *extra]]
