"""Registers, local-memory spills, shared memory and load pipelining of `experts:triton`'s kernels
(decode GEMV and prefill grouped) and `experts:triton_rows`' (`--rows`) on an H200, per tuning
config, without a GPU: Triton compiles them
for sm_90 on the CPU, specialised as a launch at beam-501b-tp8's sizes would be (16-byte aligned
pointers, sizes divisible by 16), and the CUDA toolkit's `cuobjdump` (in the triton wheel) reads the
cubin's resource usage.

A config whose kernel spills (STACK > 0: registers spilled to local memory) streams its weights
slower, whatever the tiles suggest: on the H200, the 8 x 1024 and wider gate/up tiles at 2 warps
spill and ran 1.7-2.1x slower than the 8 x 512 winner (docs/decisions.md #26).
Read this before spending device time on a config. The GPU host's Triton may allocate differently.

    python3 scripts/sm90_resources.py [--rows | --persistent] [--config JSON ...]
    (default: experts/triton.py's CONFIGS, with --rows experts/triton_rows.py's, with --persistent
    experts/triton_persistent.py's)
    python3 scripts/sm90_resources.py --attention [--config JSON ...]
    (the decode kernels of attention:triton and attention:triton_prefetch at each of the latter's
    configs or the ones given, with PDL, at a TP8 rank's full-attention decode: 6 query heads on one KV head of 128)
"""

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels do not compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from workbench.sm90 import compile_sm90, resource_usage  # noqa: E402


def _sizes(n_pairs: int) -> dict:
    """The integer arguments the kernels get at beam-501b-tp8 (they decide divisibility hints)."""
    from beam_model.config import BeamConfig

    c = BeamConfig.from_preset("beam-501b-tp8")
    hidden, ff = c.hidden_size, c.moe_intermediate_size
    return dict(N_PAIRS=n_pairs, N_EXPERTS=c.n_routed_experts, HIDDEN=hidden, FF=ff, stride_we=ff * hidden,
                stride_wf=hidden, stride_wh=ff)


def gemv_kernels(config: dict, top_k: int) -> dict:
    """Both GEMV kernels of `experts:triton` (gate_up, down) compiled for sm_90 at a GEMV tuning
    config (decode at batch 1, BF16, beam-501b-tp8's sizes)."""
    from workbench.variants.kernels import moe as moe

    ints = _sizes(top_k)
    steps = -(-ints["HIDDEN"] // config["BLOCK_K"])  # hidden slices of whole BLOCK_K steps, as the launch
    ints["K_PER_SPLIT"] = config["BLOCK_K"] * -(-steps // config.get("SPLIT_K", 1))
    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"], ints=ints)
    gate_up = compile_sm90(moe.gate_up_gemv_kernel, dict(
        x_ptr="*bf16", ids_ptr="*i64", wg_ptr="*bf16", wu_ptr="*bf16", act_ptr="*bf16", part_ptr="*fp32",
        count_ptr="*i32", HIDDEN="i32", FF="i32", K_PER_SPLIT="i32", stride_we="i32", stride_wf="i32"), dict(
        TOP_K=top_k, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT=config.get("SPLIT_K", 1)),
        **launch)
    down = compile_sm90(moe.down_gemv_kernel, dict(
        act_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wd_ptr="*bf16", y_ptr="*bf16", HIDDEN="i32", FF="i32",
        stride_we="i32", stride_wh="i32"), dict(
        TOP_K=top_k, K_P2=1 << (top_k - 1).bit_length(), BLOCK_N=config["DOWN_BLOCK_N"],
        BLOCK_K=config["DOWN_BLOCK_K"]),
        **dict(launch, num_warps=config.get("DOWN_WARPS", config["num_warps"])))
    return {"gate_up": gate_up, "down": down}


def rows_kernels(config: dict, top_k: int) -> dict:
    """`experts:triton_rows`' kernels (gate_up, down) compiled for sm_90 at one of its configs (decode,
    BF16, beam-501b-tp8's sizes); a config with BLOCK_K runs experts:triton's gate/up kernel."""
    from workbench.variants.kernels import moe_rows as rows

    ints = _sizes(top_k)
    hidden, ff = ints["HIDDEN"], ints["FF"]
    kernels = {}
    if "BLOCK_K" not in config:
        h_a, h_b = rows.pieces(hidden)
        kernels["gate_up"] = compile_sm90(rows.gate_up_rows_kernel, dict(
            x_ptr="*bf16", ids_ptr="*i64", wg_ptr="*bf16", wu_ptr="*bf16", act_ptr="*bf16", FF="i32",
            stride_we="i32", stride_wf="i32"), dict(
            HIDDEN=hidden, H_A=h_a, H_B=h_b, TOP_K=top_k, BLOCK_N=config["BLOCK_N"], STEPS=config.get("STEPS", 1)),
            ints=ints, num_warps=config["num_warps"], num_stages=1)
    f_a, f_b = rows.pieces(ff)
    kernels["down"] = compile_sm90(rows.down_rows_kernel, dict(
        act_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wd_ptr="*bf16", y_ptr="*bf16", HIDDEN="i32",
        stride_we="i32", stride_wh="i32"), dict(
        FF=ff, F_A=f_a, F_B=f_b, TOP_K=top_k, K_P2=1 << (top_k - 1).bit_length(), BLOCK_N=config["DOWN_BLOCK_N"],
        STEPS=config.get("DOWN_STEPS", 1)), ints=ints, num_warps=config["DOWN_WARPS"], num_stages=1)
    return kernels


def persistent_kernels(config: dict, top_k: int) -> dict:
    """`experts:triton_persistent`'s one kernel (both phases and the barrier) compiled for sm_90 at one of
    its configs (decode, BF16, beam-501b-tp8's sizes)."""
    from workbench.variants.kernels import moe_persistent as persistent

    ints = _sizes(top_k)
    hidden, ff = ints["HIDDEN"], ints["FF"]
    (h_a, h_b), (f_a, f_b) = persistent.pieces(hidden), persistent.pieces(ff)
    return {"one_launch": compile_sm90(persistent.experts_persistent_kernel, dict(
        x_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wg_ptr="*bf16", wu_ptr="*bf16", wd_ptr="*bf16", act_ptr="*bf16",
        y_ptr="*bf16", sync_ptr="*i32", n_tokens="i32", stride_we="i32", stride_wf="i32", stride_wde="i32",
        stride_wdh="i32"), dict(
        HIDDEN=hidden, H_A=h_a, H_B=h_b, FF=ff, F_A=f_a, F_B=f_b, TOP_K=top_k, K_P2=1 << (top_k - 1).bit_length(),
        BLOCK_N=config["BLOCK_N"], DOWN_BLOCK_N=config["DOWN_BLOCK_N"], PHASES=persistent.BOTH),
        ints=ints, num_warps=config["num_warps"], num_stages=1)}


def grouped_kernels(config: dict, top_k: int, rounded: bool = True) -> dict:
    """Both grouped (prefill) kernels of `experts:triton` (gate_up, down) compiled for sm_90 at a
    grouped tuning config (BF16; `rounded`: experts:triton_rounded's down epilogue)."""
    from workbench.variants.kernels import moe as moe

    ints = _sizes(8 * 2048 * top_k)  # an 8 x 2048-token prefill
    common = dict(pairs_ptr="*i32", block_expert_ptr="*i32")
    sizes = dict(N_PAIRS="i32", N_EXPERTS="i32", HIDDEN="i32", FF="i32")
    gate_up = compile_sm90(moe.gate_up_grouped_kernel, dict(
        x_ptr="*bf16", **common, wg_ptr="*bf16", wu_ptr="*bf16", act_ptr="*bf16", **sizes, stride_we="i32",
        stride_wf="i32"), dict(
        TOP_K=top_k, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        N_BLOCKS_N=1, PRECISION=None, INTERP=False), ints=ints, num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    down = compile_sm90(moe.down_grouped_kernel, dict(
        act_ptr="*bf16", **common, rw_ptr="*fp32", wd_ptr="*bf16", out_ptr="*bf16" if rounded else "*fp32", **sizes,
        stride_we="i32", stride_wh="i32"), dict(
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config.get("DOWN_BLOCK_N", config["BLOCK_N"]),
        BLOCK_K=config.get("DOWN_BLOCK_K", config["BLOCK_K"]), N_BLOCKS_N=1, ROUNDED=rounded, PRECISION=None,
        INTERP=False), ints=ints, num_warps=config.get("DOWN_WARPS", config["num_warps"]),
        num_stages=config.get("DOWN_STAGES", config["num_stages"]))
    return {"gate_up": gate_up, "down": down}


def attention_kernels(config: dict) -> dict:
    """attention:triton's decode kernel (separate merge, V after the scores) and attention:triton_prefetch's,
    with PDL, at `config`: beam-501b-tp8's rank (6 query heads on one KV head of 128), 16-token pages."""
    from workbench.variants.kernels import attention as base
    from workbench.variants.kernels import attention_prefetch as prefetch

    i32 = "i32"
    sig = dict(q_ptr="*bf16", cache_ptr="*bf16", table_ptr="*i32", seq_lens_ptr="*i32", pos_ptr="*i64",
               out_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", stride_qn=i32, stride_qh=i32,
               stride_cp=i32, stride_ckv=i32, stride_ct=i32, stride_ch=i32, stride_tb=i32, stride_on=i32,
               stride_oh=i32, max_pages=i32, window=i32, qk_scale="fp32", n_heads=i32, head_dim=i32)
    consts = dict(GROUP=6, BLOCK_G=16, BLOCK_D=128, BLOCK_N=config["BLOCK_N"], PAGE=16, HAS_WINDOW=False,
                  SINGLE=False, IEEE=False, INTERP=False, PDL=True)
    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    return {"triton": compile_sm90(base._decode_kernel, dict(sig, count_ptr="*i32"),
                                   dict(consts, FUSED_MERGE=False, MERGE_BLOCK_S=1), **launch),
            "triton_prefetch": compile_sm90(prefetch._decode_prefetch_kernel, sig,
                                            dict(consts, PREFETCH_V=config.get("PREFETCH_V", True)), **launch)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", metavar="JSON", help="a tuning config, GEMV or grouped (repeatable)")
    p.add_argument("--top-k", type=int, default=8, help="routed experts per token (default: %(default)s)")
    p.add_argument("--rows", action="store_true", help="experts:triton_rows' kernels and configs")
    p.add_argument("--persistent", action="store_true", help="experts:triton_persistent's kernel and configs")
    p.add_argument("--attention", action="store_true", help="attention:triton(_prefetch)'s decode kernels")
    args = p.parse_args()
    if args.attention:
        from workbench.variants.kernels.attention_configs import PREFETCH_CONFIGS as ATTENTION_CONFIGS

        for config in [json.loads(c) for c in args.config] if args.config else ATTENTION_CONFIGS:
            usage = {name: resource_usage(k) for name, k in attention_kernels(config).items()}
            keys = ("BLOCK_N", "num_warps", "num_stages", "PREFETCH_V")
            print(json.dumps({"config": {k: config[k] for k in keys if k in config}, **usage}))
        return 0
    from workbench.variants.experts.triton import CONFIGS as TRITON_CONFIGS
    from workbench.variants.experts.triton_persistent import CONFIGS as PERSISTENT_CONFIGS
    from workbench.variants.experts.triton_rows import CONFIGS as ROWS_CONFIGS

    configs = [json.loads(c) for c in args.config] if args.config else ROWS_CONFIGS if args.rows \
        else PERSISTENT_CONFIGS if args.persistent else TRITON_CONFIGS
    for config in configs:
        build = rows_kernels if args.rows else persistent_kernels if args.persistent \
            else gemv_kernels if config["path"] == "gemv" else grouped_kernels
        kernels = build(config, args.top_k)
        # cp_async: the loop's loads are pipelined through shared memory (num_stages > 1 took effect)
        usage = {name: {**resource_usage(k), "cp_async": "cp.async" in k.asm["ptx"]} for name, k in kernels.items()}
        spills = " SPILLS" if any(u["STACK"] or u["LOCAL"] for u in usage.values()) else ""
        print(json.dumps({"config": config, **usage}) + spills)
    return 0


if __name__ == "__main__":
    sys.exit(main())
