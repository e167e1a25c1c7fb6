"""A drafter's acceptance and speed-up on held-out text, through the engine as a server runs it.

Prompts are the first `prompt_tokens` tokens of the first held-out files of the training corpus (text
neither model trained on). Each prompt is served alone (one user), with and without the drafter, in
two modes: greedy, and temperature 1.0 with top-p 0.95 (seeded). Reported per mode: the mean
acceptance length (tokens per verify step: kept drafts plus the bonus token), its histogram, the
wall time and tokens per second with and without the drafter (same process, alternating per prompt),
and for greedy how many outputs equal the drafter-less ones token for token.
"""

from __future__ import annotations

import time

import torch

from server.engine.llm_engine import Engine
from server.engine.sampling_params import SamplingParams
from server.engine.speculative import SpecStats

MODES = {"greedy": dict(temperature=0.0), "temperature_1_top_p_0.95": dict(temperature=1.0, top_p=0.95)}


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
                       num_speculative_tokens: int | None = None) -> dict:
    from beam_model.drafter import BeamDrafter
    from beam_model.model import BeamForCausalLM
    from beam_model.tokenizer import load_tokenizer

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = load_tokenizer(target_dir)
    target = BeamForCausalLM.from_pretrained(target_dir, dtype=dtype, device=device)
    drafter = BeamDrafter.from_pretrained(drafter_dir, target, dtype=dtype)
    asked = held_out_prompts(tokenizer, prompts, prompt_tokens)
    pages = (prompt_tokens + max_tokens + drafter.config.block_size) // 16 + 4
    plain = Engine(target, tokenizer, num_pages=pages, max_num_seqs=1, cuda_graphs=False)
    spec = Engine(target, tokenizer, num_pages=pages, max_num_seqs=1, cuda_graphs=False, drafter=drafter,
                  num_speculative_tokens=num_speculative_tokens)
    k = spec.speculator.k
    for engine in (plain, spec):  # first-use costs outside the timings
        engine.generate([asked[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    modes = {}
    for mode, sampling in MODES.items():
        spec.speculator.stats = SpecStats()
        seconds = {"plain": 0.0, "drafter": 0.0}
        tokens, equal = 0, 0
        for i, prompt in enumerate(asked):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **sampling)
            started = time.perf_counter()
            base = plain.generate([prompt], params)[0]
            seconds["plain"] += time.perf_counter() - started
            started = time.perf_counter()
            drafted = spec.generate([prompt], params)[0]
            seconds["drafter"] += time.perf_counter() - started
            tokens += len(drafted)
            equal += drafted == base
        stats = spec.speculator.stats
        modes[mode] = {
            "sampling": sampling, "mean_acceptance_length": stats.mean_acceptance_length,
            "verify_steps": stats.verify_steps, "drafted": stats.drafted, "accepted": stats.accepted,
            "kept_drafts_histogram": stats.histogram, "tokens": tokens,
            "seconds_plain": round(seconds["plain"], 3), "seconds_drafter": round(seconds["drafter"], 3),
            "tokens_per_second_plain": tokens / seconds["plain"],
            "tokens_per_second_drafter": tokens / seconds["drafter"],
            "speedup": seconds["plain"] / seconds["drafter"],
        }
        if sampling["temperature"] == 0.0:
            modes[mode]["equal_to_plain"] = f"{equal}/{len(asked)}"
    return {"target": target_dir, "drafter": drafter_dir, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "num_speculative_tokens": k, "prompts": len(asked), "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "modes": modes}
