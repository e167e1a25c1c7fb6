"""A drafter's acceptance and speed-up on held-out text, through the engine as a server runs it.

Prompts are the first `prompt_tokens` tokens of the first held-out files of the training corpus (text
neither model trained on). Each prompt is served alone (one user), with and without the drafter, in
two modes: greedy, and temperature 1.0 with top-p 0.95 (drawn from each engine's generator, seeded as the
engine starts; a request's own seed would keep its steps off the graphs). Reported per mode: the mean
acceptance length (tokens per verify step: kept drafts plus the bonus token), its histogram, the
wall time and tokens per second without the drafter, with it verifying every draft and with adaptive
verification (same process, the three taking turns to go first), each over the whole request and over its
decode alone (from its first token to its last, as a serving benchmark's time per output token counts it:
the prompt's prefill, which the drafter does not speed up, left out), where a decode or verify step's time
goes (medians: the engine's whole step, the host's share before the model step's launch, the device's
from launch to its tokens read), and for greedy how many outputs equal the drafter-less ones token for token. On
CUDA the engines replay graphs where a server would: every decode step without the drafter, and with it
every verify + draft step (`verify_draft.py`).
"""

from __future__ import annotations

import statistics
import time

import torch

from server.engine.llm_engine import Engine
from server.engine.sampling_params import SamplingParams
from server.engine.speculative import SpecStats

MODES = {"greedy": dict(temperature=0.0), "temperature_1_top_p_0.95": dict(temperature=1.0, top_p=0.95)}
VERIFICATION = {"fixed": False, "adaptive": True}  # every draft verified, or as many as pay
# What replays a CUDA graph on a GPU (the card says it)
GRAPHED = "every step without the drafter, and with it every verify + draft step of greedy and unseeded requests"


class StepTimes:
    """An engine's decode and verify steps, timed: the whole step's wall seconds (drafting included, where
    it runs after the model step), and from its `step_observer` the host's seconds before the model
    step's launch and the device's from launch to its tokens read; and every step's wall seconds summed
    by its kind (`step_kind`: where a request's time goes)."""

    def __init__(self, engine):
        self.steps: list[tuple[float, float, float | None]] = []
        self.kinds: dict[str, list] = {}  # kind -> [steps, seconds]
        self._seen = None
        step = engine.step

        def timed():
            self._seen = None
            started = time.perf_counter()
            out = step()
            seconds = time.perf_counter() - started
            if self._seen is not None:
                kind, prepare, device = self._seen
                total = self.kinds.setdefault(kind, [0, 0.0])
                total[0], total[1] = total[0] + 1, total[1] + seconds
                if kind in ("decode", "verify"):
                    self.steps.append((seconds, prepare, device))
            return out

        engine.step, engine.step_observer = timed, self._observe

    def reset(self) -> None:
        self.steps, self.kinds = [], {}

    def _observe(self, kind: str, batch: int, seconds: float, prepare: float, device: float | None, masks) -> None:
        self._seen = (kind, prepare, device)

    def seconds_by_kind(self) -> dict:
        """{kind: {"steps", "seconds"}} of every step seen."""
        return {kind: {"steps": n, "seconds": round(seconds, 4)} for kind, (n, seconds) in sorted(self.kinds.items())}

    def medians_ms(self) -> dict:
        """Median milliseconds of a step: `wall`, `before_launch`, `device` (None where untimed)."""
        if not self.steps:
            return {}
        wall, before, device = zip(*self.steps)
        timed = [d for d in device if d is not None]

        def ms(values):
            return round(statistics.median(values) * 1e3, 4)

        return {"wall": ms(wall), "before_launch": ms(before), "device": ms(timed) if timed else None}


def serve_alone(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, float]:
    """Serve one request to completion, nothing else running: (its ids, the seconds from its arrival to its
    last token, the seconds from its first token to its last)."""
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ids, first = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.error:
                raise RuntimeError(o.error)
            ids.extend(o.token_ids)
        if first is None and ids:
            first = time.perf_counter()
    ended = time.perf_counter()
    return ids, ended - started, ended - (first or ended)


def _fused_steps(engine) -> int:
    """The steps `engine` ran as one verify + draft graph replay (none on the CPU); the rest ran eagerly."""
    fused = engine.speculator.fused
    return fused.steps if fused is not None else 0


def held_out_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    from workbench.training.corpus import corpus_files, split

    prompts = []
    for f in split(corpus_files())[1]:
        ids = tokenizer.encode(f.read(), allow_special=False)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"the held-out files hold {len(prompts)} prompts of {prompt_tokens} tokens, fewer than {count}")


def measure_acceptance(target_dir: str, drafter_dir: str, *, prompts: int = 16, max_tokens: int = 96,
                       prompt_tokens: int = 64, device: str = "cpu", dtype: torch.dtype | None = None,
                       num_speculative_tokens: int | None = None, lock=None, plain_lock=None,
                       draft_lock=None) -> dict:
    """`lock`: a `workbench.lock.Lock` whose variants both models run (every engine alike); `plain_lock`:
    the engine without the drafter runs its variants instead (a decode lock, where `lock` is a verify
    lock: each build at the step it was searched for), on a model of its own (a model binds one build);
    `draft_lock`: the drafter's points run its variants (a draft-b1 lock)."""
    from beam_model.drafter import BeamDrafter
    from beam_model.model import BeamForCausalLM
    from beam_model.tokenizer import load_tokenizer

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = load_tokenizer(target_dir)
    target = BeamForCausalLM.from_pretrained(target_dir, dtype=dtype, device=device)
    drafter = BeamDrafter.from_pretrained(drafter_dir, target, dtype=dtype)
    asked = held_out_prompts(tokenizer, prompts, prompt_tokens)
    pages = (prompt_tokens + max_tokens + drafter.config.block_size) // 16 + 4
    def build(chosen):
        return dict(variants=chosen.selection if chosen else None, variant_configs=chosen.configs if chosen else None)

    plain_target = target if plain_lock is None else BeamForCausalLM.from_pretrained(target_dir, dtype=dtype,
                                                                                       device=device)
    engines = {"plain": Engine(plain_target, tokenizer, num_pages=pages, max_num_seqs=1, **build(plain_lock or lock))}
    drafter_build = {"drafter_variants": draft_lock.selection, "drafter_variant_configs": draft_lock.configs} \
        if draft_lock else {}
    for name, adaptive in VERIFICATION.items():
        engines[name] = Engine(target, tokenizer, num_pages=pages, max_num_seqs=1, **build(lock), drafter=drafter,
                               num_speculative_tokens=num_speculative_tokens, adaptive_verification=adaptive,
                               **drafter_build)
    k = engines["fixed"].speculator.k
    for engine in engines.values():  # first-use costs outside the timings (Triton's compiles on CUDA)
        if device.startswith("cuda"):
            engine.warm_up()
        engine.generate([asked[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    modes = {}
    times = {name: StepTimes(engine) for name, engine in engines.items()}
    for mode, sampling in MODES.items():
        seconds, outputs = {name: 0.0 for name in engines}, {name: [] for name in engines}
        for t in times.values():
            t.reset()
        fused_before = {name: _fused_steps(engines[name]) for name in VERIFICATION}
        for name in VERIFICATION:
            engines[name].speculator.stats = SpecStats()
        decoding = {name: 0.0 for name in engines}
        for i, prompt in enumerate(asked):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
            order = list(engines)[i % len(engines):] + list(engines)[:i % len(engines)]  # no engine always first
            for name in order:
                ids, total, decode = serve_alone(engines[name], f"{mode}-{i}", prompt, params)
                outputs[name].append(ids)
                seconds[name] += total
                decoding[name] += decode
        tokens = sum(len(o) for o in outputs["plain"])
        decoded = tokens - len(asked)  # the tokens after each request's first
        modes[mode] = {"sampling": sampling, "tokens": tokens, "seconds_plain": round(seconds["plain"], 3),
                       "tokens_per_second_plain": tokens / seconds["plain"],
                       "decode_seconds_plain": round(decoding["plain"], 3),
                       "decode_tokens_per_second_plain": decoded / decoding["plain"],
                       "step_ms_plain": times["plain"].medians_ms(),
                       "steps_by_kind_plain": times["plain"].seconds_by_kind()}
        for name in VERIFICATION:
            stats = engines[name].speculator.stats
            modes[mode][name] = {
                "mean_acceptance_length": stats.mean_acceptance_length, "verify_steps": stats.verify_steps,
                "drafted": stats.drafted, "accepted": stats.accepted, "kept_drafts_histogram": stats.histogram,
                "seconds": round(seconds[name], 3), "tokens_per_second": tokens / seconds[name],
                "speedup": seconds["plain"] / seconds[name],
                "decode_seconds": round(decoding[name], 3), "decode_tokens_per_second": decoded / decoding[name],
                "decode_speedup": decoding["plain"] / decoding[name], "step_ms": times[name].medians_ms(),
                "steps_by_kind": times[name].seconds_by_kind(),
                "fused_steps": _fused_steps(engines[name]) - fused_before[name]}
            if sampling["temperature"] == 0.0:
                same = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
                modes[mode][name]["equal_to_plain"] = f"{same}/{len(asked)}"
    return {"target": target_dir, "drafter": drafter_dir, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "cuda_graphs": GRAPHED if device.startswith("cuda") else None, "selection": target.ops.selection,
            "plain_selection": plain_target.ops.selection, "drafter_selection": drafter.ops.selection,
            "num_speculative_tokens": k, "block_size": drafter.config.block_size, "prompts": len(asked),
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "modes": modes}
