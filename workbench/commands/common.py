"""Arguments and helpers shared by several CLI commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import torch

from workbench.dtypes import DTYPES, dtype_of
from workbench.registry import WEIGHT_FORMATS

# The trained model that `generate` and `serve` run when neither --model nor --preset is given, where
# it is present (`workbench train` makes it); $BEAM_EMBEDDED_MODEL names another checkpoint folder.
EMBEDDED_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "models", "beam-mini")
FALLBACK_PRESET = "beam-tiny"


def add_model_arguments(p, *, default_preset: str = FALLBACK_PRESET, default_dtype: str | None = None,
                        embedded_default: bool = False) -> None:
    """--preset, --model, --dtype, --device, --seed. With `embedded_default`, neither --preset nor --model
    given means the embedded trained model where present (`choose_model`)."""
    if embedded_default:
        p.add_argument("--preset", default=None, help="model preset with random weights (default: the trained "
                       f"model in models/beam-mini where present, else {default_preset})")
    else:
        p.add_argument("--preset", default=default_preset, help="model preset (default: %(default)s)")
    p.add_argument("--model", metavar="DIR", help="load a checkpoint folder instead of a preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=default_dtype,
                   help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights of a preset")
    add_weights_argument(p, what="a preset's projections (a checkpoint says its own format)")


def add_weights_argument(p, *, what: str, default: str | None = None) -> None:
    """--weights; `default` None: a lock's where the command takes one (`choose_model`), else bf16."""
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=default,
                   help=f"how {what} are stored: bf16 (the model dtype), fp8 (E4M3 per output channel: attention, "
                        "dense and expert projections) or nvfp4 (the experts, E2M1 in blocks of 16); default: "
                        + (default or "a lock's, else bf16"))


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_of(name)


def embedded_model() -> str | None:
    """The embedded trained model's folder, or None where it is absent."""
    folder = os.environ.get("BEAM_EMBEDDED_MODEL") or EMBEDDED_MODEL
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def choose_model(args, lock=None) -> None:
    """Fill in args.model or args.preset when neither was given: the embedded trained model where present
    (with a lock, only where the lock was made on its config), else the preset a lock was made on, else
    FALLBACK_PRESET. A preset's --weights, when not given, are the lock's where the lock was made on it."""
    from beam_model.config import PRESETS, BeamConfig

    locked = (lock.model or {}) if lock is not None else {}
    if not (args.model or args.preset):
        folder = embedded_model()
        if folder and (not locked.get("config_hash")
                       or BeamConfig.from_pretrained(folder).config_hash() == locked["config_hash"]):
            args.model = folder
        else:
            args.preset = locked["preset"] if locked.get("preset") in PRESETS else FALLBACK_PRESET
    if getattr(args, "weights", "bf16") is None and not args.model:
        args.weights = locked.get("weights", "bf16") if locked.get("preset") == args.preset else "bf16"


def load_model(args, variants: dict | None = None):
    from beam_model import BeamForCausalLM

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model:  # BF16 or quantized, as its config.json says
        if args.weights not in (None, "bf16"):
            raise ValueError("--weights sets a preset's format; a checkpoint folder's config.json says its own "
                             "(`workbench quantize` writes one in another)")
        return BeamForCausalLM.from_pretrained(args.model, dtype=dtype, device=device, variants=variants)
    return BeamForCausalLM.from_preset(args.preset, seed=args.seed, dtype=dtype, device=device, variants=variants,
                                       weights=args.weights or "bf16")


def given_command(args) -> str:
    """The command as it was given (`workbench ...`), for the records a command writes: the argv
    `cli.main` parsed (which may not be the process's, e.g. a test's call), else the process's."""
    argv = getattr(args, "argv", None)
    return "workbench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def write_and_print(args, name: str, result: dict) -> bool:
    """`result` written to `--out`/NAME when --out is given, and printed as JSON with --json; whether it
    was printed (the command then prints nothing else)."""
    from workbench.run_folder import write_json

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, name), result)
    if args.json:
        print_json(result)
    return bool(args.json)


def _limit(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: a limit is a finite number >= 0 (0: no limit)")
    return value


def add_worker_arguments(p, *, what: str, timeout_s: float, mem_bytes: int) -> None:
    """--worker-timeout and --worker-memory: the limits of the worker process that `what` runs in."""
    p.add_argument("--worker-timeout", type=_limit, default=timeout_s, metavar="SECONDS",
                   help=f"end the worker process that {what} when it runs longer than this, the whole "
                        "process tree it started with it (default: %(default)s; 0: no limit)")
    p.add_argument("--worker-memory", type=_limit, default=mem_bytes / 2**30, metavar="GIB",
                   help="end that worker when it uses more memory than this: its address space on a CPU run, "
                        "its resident memory on CUDA (default: %(default)s; 0: no limit)")


def worker_limits(args) -> dict:
    """worker.run's `timeout` and `mem_bytes` from --worker-timeout and --worker-memory."""
    from workbench.agent import worker

    timeout = getattr(args, "worker_timeout", worker.DEFAULT_TIMEOUT_S)
    gib = getattr(args, "worker_memory", worker.DEFAULT_MEM_BYTES / 2**30)
    return {"timeout": timeout or None, "mem_bytes": int(gib * 2**30)}


def run_in_worker(name: str, args) -> int:
    """Command `name` (`args` its parsed Namespace, `args.dir` its plugin directories) re-run in a
    worker process, where plugin code may run; its output is forwarded. A worker that did not finish
    the command (killed, crashed, or exited without its completion sentinel) prints why and returns 1.
    A SIGTERM or SIGINT meanwhile ends the worker and its process tree, removes the temporary folder,
    and returns 128 + the signal's number."""
    import os
    import signal
    import sys
    import tempfile

    from workbench.agent import worker
    from workbench.agent.plugins import plugin_dirs

    fields = {**vars(args), "dir": plugin_dirs(getattr(args, "dir", None))}
    with worker.hold_signals() as held:
        with tempfile.TemporaryDirectory(prefix="workbench-worker-") as tmp:
            path = os.path.join(tmp, "args.json")
            with open(path, "w") as f:
                json.dump(fields, f, default=str)
            device = str(getattr(args, "device", None) or "cpu")
            result = worker.run(f"{__name__}:command_in_worker", [name, path], device=device, forward=True,
                                **worker_limits(args))
        signum = held.take()
    if signum is not None:
        print(f"workbench {name}: stopped by {signal.Signals(signum).name}; its worker was ended", file=sys.stderr)
        return 128 + signum
    if result.finished and result.returncode is not None and result.returncode >= 0:
        return result.returncode  # the command's own exit status
    if getattr(args, "json", False):
        print_json({"passed": False, "error": result.reason, "worker": result.to_dict()})
    else:
        print(f"error: plugin variants from {', '.join(fields['dir'])}: {result.reason}", file=sys.stderr)
    return 1


def command_in_worker(name: str, args_path: str) -> int:
    """The worker side of `run_in_worker`: command `name` on the arguments saved at `args_path`, with
    their plugin directories loaded."""
    import argparse
    import importlib
    import sys

    from workbench.agent import plugins
    from workbench.cli import COMMANDS

    with open(args_path) as f:
        args = argparse.Namespace(**json.load(f))
    try:
        plugins.load_dirs(args.dir)
        return importlib.import_module(COMMANDS[name]).run(args) or 0
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
