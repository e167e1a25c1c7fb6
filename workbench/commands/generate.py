"""Generate text from a Beam model through the paged KV cache (the embedded trained model by default where
present; presets have random weights)."""

from __future__ import annotations

import time

from workbench.commands.common import add_model_arguments, choose_model, load_model, print_json


def add_arguments(p) -> None:
    add_model_arguments(p, embedded_default=True)
    p.add_argument("--prompt", default="Hello, Beam!", help="prompt text (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    import torch

    from beam_model.chat_template import encode_chat
    from beam_model.generate import generate
    from beam_model.tokenizer import load_tokenizer

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    t0 = time.perf_counter()
    choose_model(args)
    model = load_model(args)
    tok = load_tokenizer(args.model)
    prompt = encode_chat(tok, [{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    t1 = time.perf_counter()
    out = generate(model, [prompt], args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_ids=(tok.eos_token_id,), vocab_limit=tok.vocab_size)[0]
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    result = {
        "model": args.model or model.config.preset, "device": str(model.device), "dtype": str(model.dtype),
        "prompt_tokens": len(prompt), "completion_tokens": len(out), "tokens": out,
        "text": tok.decode(out), "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
        "variants": model.ops.selection,
    }
    if args.json:
        print_json(result)
    else:
        print(f"{result['model']} on {result['device']} ({result['dtype']}): {len(prompt)} prompt tokens, "
              f"{len(out)} generated in {result['generate_s']} s")
        print(repr(result["text"]))
    return 0
