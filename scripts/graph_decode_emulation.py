"""How far a served decode step's logits move when the step is graph-shaped, on the CPU: the serving
engine runs once eagerly and once with its CUDA-graph path emulated (the graph buffers and metadata
`ModelRunner._capture` builds: page tables as wide as the longest graphed sequence, the batch padded
to a captured size; each "replay" an eager `model.step` on them, then the draw graph's `_draw`), fed the eager
run's tokens. Prints, per prompt, the largest logit difference at each output token.

With the reference attention, FP32 steps differ by ~1e-5 (the padded batch changes the GEMMs'
blocking); BF16 steps by ~0.2 and, where a near-tied expert choice flips, by O(1): why the GPU test
compares each graph replay with an eager step on the replay's own inputs instead
(tests/server/test_server_gpu.py).

    PYTHONPATH=. python3 scripts/graph_decode_emulation.py [--attention torch] [--preset beam-small]
        [--dtype bfloat16] [--prompts 3,70,130,17,64,700,33] [--tokens 6]
"""

import argparse
import math

import torch

from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer
from server.engine import Engine, SamplingParams, llm_engine
from server.engine import model_runner as mr
from server.engine.graph_inputs import GraphInputs


class _Replay:
    def __init__(self, fn):
        self.replay = fn


def _emulated_capture(self, sizes, max_pages):
    """`ModelRunner._capture`'s buffers and metadata, with an eager step in place of each graph."""
    big = max(sizes)
    self._inputs = GraphInputs(big, max_pages, mr.GROUPS, torch.device("cpu"))
    for b in sizes:
        meta = self._inputs.metadata(b, self.page_size)
        with torch.inference_mode():
            out = self.model.step(self._inputs.ids[:b], self.cache, meta).clone()
            ids = self._draw(out, b).clone()

        def forward(b=b, meta=meta, out=out):
            with torch.inference_mode():
                out.copy_(self.model.step(self._inputs.ids[:b], self.cache, meta))

        def draw(b=b, out=out, ids=ids):
            with torch.inference_mode():
                ids.copy_(self._draw(out, b))
        self.graphs[b] = mr.Captured(_Replay(forward), out, meta, _Replay(draw), ids)


def _emulated_runner(*args, cuda_graphs=False, **kw):
    runner = mr.ModelRunner(*args, cuda_graphs=False, **kw)
    if cuda_graphs:
        top = min(kw["max_num_seqs"], mr.MAX_GRAPH_BATCH)
        sizes = sorted({b for b in mr.GRAPH_BATCH_SIZES if b < top} | {top})
        _emulated_capture(runner, sizes, math.ceil(kw["graph_max_len"] / runner.page_size))
    return runner


class _Logits:
    """Records each prompt's logits per output token; with `forced`, makes that run's tokens win."""

    def __init__(self, forced=None):
        self.rows, self.forced = {}, forced

    def __call__(self, seqs, logits):
        for s, row in zip(seqs, logits):
            key = tuple(s.token_ids[:s.num_prompt_tokens])
            self.rows.setdefault(key, []).append(row.clone())
            if self.forced is not None:
                token = self.forced[key][s.num_tokens - s.num_prompt_tokens]
                row.fill_(float("-inf"))
                row[token] = 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="torch")
    ap.add_argument("--preset", default="beam-small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", default="3,70,130,17,64,700,33")
    ap.add_argument("--tokens", type=int, default=6)
    args = ap.parse_args()
    model = BeamForCausalLM.from_preset(args.preset, dtype=getattr(torch, args.dtype), device="cpu", seed=0,
                                        variants={"attention": args.attention})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in args.prompts.split(",")]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    eager_logits = _Logits()
    eager = Engine(model, ByteTokenizer(), num_pages=256, cuda_graphs=False, logits_hook=eager_logits).generate(
        prompts, params)
    graphed_logits = _Logits(forced={tuple(p): out for p, out in zip(prompts, eager)})
    llm_engine.ModelRunner = _emulated_runner  # the name the engine builds its runner through
    try:
        engine = Engine(model, ByteTokenizer(), num_pages=256, cuda_graphs=True, max_num_seqs=8,
                        logits_hook=graphed_logits)
    finally:
        llm_engine.ModelRunner = mr.ModelRunner
    replays = []
    replay = engine.runner._replay
    engine.runner._replay = lambda *a: replays.append(a[0]) or replay(*a)
    assert engine.generate(prompts, params) == eager
    print(f"{args.preset} {args.dtype} attention:{args.attention}: {len(replays)} emulated graph replays; "
          "largest |logit difference| per output token (eager engine vs graph-shaped steps):")
    for key, rows in eager_logits.rows.items():
        diffs = [(a - b)[torch.isfinite(a)].abs().max().item() for a, b in zip(rows, graphed_logits.rows[key])]
        scale = rows[0][torch.isfinite(rows[0])].abs().max().item()
        print(f"  prompt of {len(key):4d} tokens (max |logit| {scale:5.1f}): " + " ".join(f"{d:.3g}" for d in diffs))


if __name__ == "__main__":
    main()
