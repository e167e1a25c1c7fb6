"""Variants known to misbehave on a kind of device, with the evidence.

A search, `workbench check` and `workbench bench` skip a quarantined variant with this reason unless
it is named explicitly (`check boundary:cute`, `bench boundary --variants cute`), which is how a fix is
tried. A variant that hangs would otherwise cost every search a watchdog timeout and a restart.
Kept apart from the variant modules on purpose: recording a problem changes no variant's code key,
so no lock goes stale for it. Remove an entry once the variant's GPU tests pass (docs/decisions.md, 19).
"""

from __future__ import annotations

# (point, variant) -> (device type, why)
KNOWN: dict[tuple[str, str], tuple[str, str]] = {}


def quarantined(point: str, name: str, device) -> str | None:
    """Why `point:name` is skipped on `device` (a torch.device or its string), or None."""
    entry = KNOWN.get((point, name))
    if entry is None or str(device).split(":")[0] != entry[0]:
        return None
    return entry[1]
