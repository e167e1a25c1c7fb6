"""A finished run folder as the TUI shows it: its profile, per-point search results, report and the
device the run was measured on, each file checked for the fields the views draw.

A missing or malformed file becomes a problem that names the file and what is wrong with it, kept
per view ("profile", "search"); the views show the problem where the data would be. Reading a run
folder never raises for what is in it. This module only reads: it never writes into a run folder,
and never recomputes or re-ranks a figure the run recorded.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from workbench.dtypes import DTYPES
from workbench.lock import Lock
from workbench.profiler import Profile
from workbench.registry import REFERENCE

# torch's name of each dtype ("bfloat16") to the workbench's short one ("bf16"): profile.json uses
# torch's names, reports and search results the short ones.
_SHORT_DTYPE = {**{str(dt).removeprefix("torch."): name for name, dt in DTYPES.items()}, **{n: n for n in DTYPES}}
_NUMBER = (int, float)
# What the views draw of each candidate; a candidate without one of these is shown with "-" there.
_CANDIDATE_FIELDS = ("backend", "config", "gate_passed", "failed_check", "step_us", "spread", "speedup", "skipped")


@dataclass
class RunFiles:
    path: str
    profile: Profile | None = None
    results: dict[str, dict] = field(default_factory=dict)   # point -> the result search/<point>.json holds
    report: dict | None = None
    lock_path: str = ""
    lock: Lock | None = None
    target: str | None = None
    preset: str | None = None
    dtype: str | None = None      # short name: bf16, fp16, fp32
    device: str | None = None     # where the run was measured: the GPU's name, or "cpu"
    problems: dict[str, list[str]] = field(default_factory=dict)  # view -> "FILE: what is wrong"

    def problem(self, view: str, path: str, what: str) -> None:
        self.problems.setdefault(view, []).append(f"{path}: {what}")

    def describe(self) -> str:
        """What was run and where it was measured, as the header shows it."""
        what = f"{self.target or 'target not recorded'} on {self.preset or 'preset not recorded'}"
        return f"{what} ({self.dtype or 'dtype not recorded'}, {self.device or 'device not recorded'})"

    def locked(self) -> dict[str, str] | None:
        """point -> variant of the points the run's lock does not leave at the reference; None when
        the run wrote no lock or report this view can read."""
        if self.lock is not None:
            chosen = {p: e["variant"] for p, e in self.lock.points.items()}
        elif self.report is not None and isinstance(self.report.get("points"), list):
            chosen = {p["point"]: p["variant"] for p in self.report["points"]
                      if isinstance(p, dict) and "point" in p and "variant" in p}
        else:
            return None
        return {p: v for p, v in chosen.items() if v != REFERENCE}


def _json(run: RunFiles, view: str, path: str, required: bool = True):
    """The JSON object in `path`, or None with the problem recorded for `view`."""
    if not os.path.isfile(path):
        if required:
            run.problem(view, path, "missing")
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        run.problem(view, path, f"cannot be read ({e})")
        return None
    except json.JSONDecodeError as e:
        run.problem(view, path, f"not valid JSON ({e})")
        return None
    if not isinstance(data, dict):
        run.problem(view, path, f"holds a JSON {type(data).__name__}, not an object")
        return None
    return data


def _is_number(x) -> bool:
    return isinstance(x, _NUMBER) and not isinstance(x, bool)


def check_profile(profile: Profile) -> str | None:
    """Why a loaded profile cannot be drawn, or None when its figures are numbers where they must be."""
    for key in ("total_us", "unattributed_us", "kernels_per_step"):
        if not _is_number(getattr(profile, key)):
            return f"its {key} is {getattr(profile, key)!r}, not a number"
    for p in profile.points:
        for key in ("time_us", "share", "kernels"):
            if not _is_number(getattr(p, key)):
                return f"point {p.point!r} has {key} {getattr(p, key)!r}, not a number"
    return None


def check_result(result, stem: str) -> str | None:
    """Why a search file's `result` cannot be shown, or None when it has every field the views draw."""
    if not isinstance(result, dict):
        return "has no 'result' object"
    missing = [k for k in ("choice", "reference_us", "choice_us", "candidates") if k not in result]
    if missing:
        return f"its result lacks {', '.join(repr(k) for k in missing)}"
    if result.get("point", stem) != stem:
        return f"holds the results of point {result['point']!r}, not {stem!r}"
    if not isinstance(result["choice"], str):
        return f"its choice is {result['choice']!r}, not a variant name"
    for key in ("reference_us", "choice_us"):
        if not _is_number(result[key]):
            return f"its {key} is {result[key]!r}, not a number"
    if not isinstance(result["candidates"], list):
        return "its candidates are not a list"
    for i, c in enumerate(result["candidates"]):
        if not isinstance(c, dict) or not isinstance(c.get("variant"), str):
            return f"candidate {i} has no variant name"
        for key in ("step_us", "spread", "speedup"):
            value = c.get(key)
            if value is not None and not _is_number(value):
                return f"candidate {i} ({c['variant']}) has {key} {value!r}, not a number"
    return None


def _results(run: RunFiles) -> list[dict]:
    """Each readable search/<point>.json into run.results; the fingerprints they were searched under."""
    folder = os.path.join(run.path, "search")
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        run.problem("search", folder + os.sep, "missing" if not os.path.isdir(folder) else "holds no <point>.json")
    fingerprints = []
    for path in paths:
        saved = _json(run, "search", path)
        if saved is None:
            continue
        stem = os.path.basename(path)[:-len(".json")]
        why = check_result(saved.get("result"), stem)
        if why:
            run.problem("search", path, why)
            continue
        result = dict(saved["result"], point=stem)
        result["candidates"] = [{**dict.fromkeys(_CANDIDATE_FIELDS), **c, "point": stem} for c in result["candidates"]]
        run.results[stem] = result
        if isinstance(saved.get("fingerprint"), dict):
            fingerprints.append(saved["fingerprint"])
    return fingerprints


def _device(run: RunFiles, profile: dict, fingerprints: list[dict]) -> str | None:
    """The device the run recorded: "cpu" for a CPU run, else the GPU's name from its environment."""
    key = profile.get("key") if isinstance(profile.get("key"), dict) else {}
    kinds = [str(d).split(":")[0] for d in [key.get("device"), *(f.get("device") for f in fingerprints)] if d]
    if kinds and kinds[0] == "cpu":
        return "cpu"
    report = run.report or {}
    environments = [report.get("environment"), run.lock.environment if run.lock else None]
    names = [report.get("gpu"), *(e.get("gpu") for e in environments if isinstance(e, dict)), profile.get("device")]
    return next((n for n in names if isinstance(n, str) and n), kinds[0] if kinds else None)


def read_run(path: str) -> RunFiles:
    """Everything the views show of the run folder at `path`; what cannot be read is in `problems`."""
    run = RunFiles(path=path, lock_path=os.path.join(path, "lock.yaml"))
    profile_path = os.path.join(path, "profile.json")
    profile = _json(run, "profile", profile_path)
    if profile is not None:
        try:
            run.profile = Profile.from_dict(profile)
            why = check_profile(run.profile)
        except KeyError as e:
            why = f"lacks {e}"
        except (TypeError, ValueError, AttributeError) as e:
            why = f"is not a profile ({e})"
        if why:
            run.profile = None
            run.problem("profile", profile_path, why)
    fingerprints = _results(run)
    run.report = _json(run, "search", os.path.join(path, "report.json"), required=False)
    try:
        run.lock, _ = Lock.load(run.lock_path)
    except (OSError, TypeError, ValueError, KeyError, AttributeError):  # the Lock view names the problem
        run.lock = None
    profile = profile or {}
    key = profile.get("key") if isinstance(profile.get("key"), dict) else {}
    lock = {"target": run.lock.target, **(run.lock.model if isinstance(run.lock.model, dict) else {})} \
        if run.lock else {}
    sources = [run.report or {}, *fingerprints, key, profile, lock]
    for attr in ("target", "preset", "dtype"):
        setattr(run, attr, next((s[attr] for s in sources if isinstance(s.get(attr), str)), None))
    run.dtype = _SHORT_DTYPE.get(run.dtype, run.dtype)
    run.device = _device(run, profile, fingerprints)
    return run
