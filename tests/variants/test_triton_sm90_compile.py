"""The kernels whose last program to finish does a final step, compiled for the H200 (sm_90) on the CPU.

The interpreter runs their logic (the variants' own tests) but accepts code the GPU compiler may not,
and says nothing about the memory ordering that makes the pattern correct on a GPU. Triton compiles
to PTX and a cubin without a GPU, so each kernel is compiled here at a decode specialisation, and its
PTX must hold what the pattern relies on: a GPU-scope acquire-release counter increment and reset, a
CTA barrier before it, and the other programs' partials read from L2 (`ld.global.cg`). Runs in a
subprocess without TRITON_INTERPRET (tests/conftest.py sets it, and interpreted kernels do not compile).
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

SCRIPT = r'''
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gemv_kernels
from workbench.sm90 import compile_sm90
import workbench.variants.kernels.attention as attention
import workbench.variants.route.triton as route

def ptx(fn, sig, consts):
    return compile_sm90(fn, sig, consts).asm["ptx"]

I32 = "i32"
out = {}
out["attention decode, fused merge"] = ptx(attention._decode_kernel, dict(
    q_ptr="*bf16", cache_ptr="*bf16", table_ptr="*i32", seq_lens_ptr="*i32", pos_ptr="*i64", out_ptr="*bf16",
    m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", count_ptr="*i32", stride_qn=I32, stride_qh=I32, stride_cp=I32,
    stride_ckv=I32, stride_ct=I32, stride_ch=I32, stride_tb=I32, stride_on=I32, stride_oh=I32, max_pages=I32,
    window=I32, qk_scale="fp32", n_heads=I32, head_dim=I32), dict(
    GROUP=6, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, PAGE=16, HAS_WINDOW=True, SINGLE=False, FUSED_MERGE=True,
    MERGE_BLOCK_S=16,
    IEEE=False, INTERP=False))
out["route GEMV, fused selection"] = ptx(route._route_gemv, dict(
    x_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32", N=I32, E=I32, K=I32, K_PER_SPLIT=I32, bias_ptr="*fp32",
    ids_ptr="*i64", wts_ptr="*fp32", count_ptr="*i32", EPG=I32, scale="fp32"), dict(
    BLOCK_N=1, BLOCK_E=4, BLOCK_K=1024, FUSED=True, SPLIT=5, N_GROUP=8, TOPK_GROUP=4, TOP_K=8, BLOCK_T=1,
    BLOCK_G=8, BLOCK_J=32))
import workbench.variants.kernels.attention_merged_gemv as merged
out["attention_out merged GEMV, head groups"] = ptx(merged._merged_gemv_kernel, dict(
    m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", g_ptr="*bf16", bias_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
    part_ptr="*fp32", count_ptr="*i32", M=I32, N=I32, n_heads=I32, head_dim=I32, n_splits=I32, g_stride=I32), dict(
    HEADS=3, SPLIT_K=2, BLOCK_N=32, BLOCK_S=32, BLOCK_D=128, PDL=True))
split_k = dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1,
               SPLIT_K=4)
out["experts gate/up GEMV, split-K"] = gemv_kernels(split_k, top_k=8)["gate_up"].asm["ptx"]
json.dump(out, sys.stdout)
'''

PERSISTENT = r'''
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import persistent_kernels
from workbench.variants.experts.triton_persistent import CONFIGS

json.dump({"ptx": persistent_kernels(CONFIGS[0], top_k=8)["one_launch"].asm["ptx"]}, sys.stdout)
'''


def _require_compiler() -> None:
    try:
        importlib.import_module("triton.backends.compiler").GPUTarget
        importlib.import_module("triton.compiler").ASTSource
    except (ImportError, AttributeError) as e:
        pytest.skip(f"this triton cannot compile for a GPU target from Python: {e}")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 3):
        pytest.skip(f"triton {triton.__version__}: constexpr signatures need 3.3 or later")


def _compiled(script: str = SCRIPT) -> dict[str, str]:
    """What `script` prints (JSON), run in a subprocess without TRITON_INTERPRET."""
    _require_compiler()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_fused_final_steps_compile_for_sm90_with_their_memory_ordering():
    for name, ptx in _compiled().items():
        lines = [line.strip() for line in ptx.splitlines()]
        assert any(line.startswith("bar.sync") or line.startswith("barrier.sync") for line in lines), name
        assert any("atom.global.gpu.acq_rel.add" in line for line in lines), f"{name}: no acq_rel arrival count"
        assert any("atom.global.gpu.acq_rel.exch" in line for line in lines), f"{name}: counter never reset"
        assert any("ld.global.cg" in line for line in lines), f"{name}: partials not read from L2"


def test_persistent_experts_grid_barrier_in_the_ptx():
    """experts:triton_persistent's grid barrier as the GPU will run it: each CTA's threads meet (bar.sync)
    before one thread counts the CTA in with a GPU-scope acquire-release add, the spin re-reads the count
    with GPU-scope acquires by that thread and the CTA meets again before leaving it, the counters are
    reset, and the activations other CTAs wrote are read from L2. (Counted by every thread instead, the
    barrier would open early; read without acquire, the spin could see the count before the stores.)"""
    lines = [line.strip() for line in _compiled(PERSISTENT)["ptx"].splitlines()]
    code = [line for line in lines if line and not line.startswith(("//", ".loc", "$L"))]
    add = next(i for i, line in enumerate(code) if "atom.global.gpu.acq_rel.add" in line)
    assert code[add].startswith("@%p"), "the arrival is counted by every thread"
    meet = max((i for i in range(add) if code[i].startswith("bar.sync")), default=None)
    assert meet is not None and not any("st.global" in line for line in code[meet:add]), \
        "no CTA barrier between the activations' stores and the arrival"
    spin = [i for i, line in enumerate(code) if "ld.global.gpu.acquire" in line or "atom.global.gpu.acquire" in line]
    assert spin and all(code[i].startswith("@%p") for i in spin), "the spin does not acquire the count"
    for i in spin:  # the CTA meets after the read, before the branch that leaves or repeats the spin
        branch = next(j for j in range(i, len(code)) if " bra" in code[j])
        assert any(line.startswith("bar.sync") for line in code[i:branch]), \
            "threads leave the spin without meeting the thread that read the count"
    assert sum("atom.global.gpu.acq_rel.exch" in line for line in code) == 2, "the two counters are not reset"
    assert any("ld.global.cg" in line for line in code), "activations not read from L2"


def test_sm90_resources_reads_registers_and_spills_of_a_config():
    """scripts/sm90_resources.py: both GEMV kernels of an experts config, compiled for sm_90 on the
    CPU, with their registers and spills from the cubin; a 1024-wide gate/up tile at 2 warps spills."""
    _require_compiler()
    config = dict(path="gemv", BLOCK_N=8, BLOCK_K=1024, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sm90_resources.py"), "--config",
                           json.dumps(config)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    usage = json.loads(line.removesuffix(" SPILLS"))
    assert usage["config"] == config and 0 < usage["down"]["REG"] <= 255
    assert usage["gate_up"]["STACK"] > 0 and line.endswith(" SPILLS")


def test_triton_rows_configs_do_not_spill():
    """Every experts:triton_rows config (its comment says none spills, and the variant's register
    budget assumes so): both kernels compiled for sm_90 at beam-501b-tp8's decode sizes."""
    _require_compiler()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sm90_resources.py"), "--rows"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    from workbench.variants.experts.triton_rows import CONFIGS

    assert len(lines) == len(CONFIGS) and not any(line.endswith(" SPILLS") for line in lines), lines


GROUPING_SCRIPT = r'''
import json
from workbench.sm90 import compile_sm90, resource_usage
import workbench.variants.kernels.moe as moe

ints = dict(N_PAIRS=131072, N_EXPERTS=256, N_CHUNKS=256, MAX_BLOCKS=1278)  # 8 x 2048 tokens, top 8 of 256
sizes = dict(E_P2=256, CHUNK=moe.ALIGN_CHUNK)
count = compile_sm90(moe.count_by_expert_kernel, dict(ids_ptr="*i64", chunk_counts_ptr="*i32", N_PAIRS="i32"),
                     dict(**sizes, SUB=moe.ALIGN_SUB), ints=ints, num_warps=8)
align = compile_sm90(moe.align_by_expert_kernel, dict(
    ids_ptr="*i64", chunk_counts_ptr="*i32", cursor_ptr="*i32", pairs_ptr="*i32", block_expert_ptr="*i32",
    N_PAIRS="i32", N_EXPERTS="i32", N_CHUNKS="i32", MAX_BLOCKS="i32"), dict(
    **sizes, BLOCK_M=128, PLACE=moe.ALIGN_PLACE, ROWS=moe.ALIGN_ROWS, MARK_N=moe.MARK), ints=ints, num_warps=8)
print(json.dumps({"count": resource_usage(count), "align": resource_usage(align)}))
'''


def test_grouping_kernels_fit_in_registers_at_a_prefill():
    """experts' grouping kernels at an 8 x 2048-token prefill's sizes: placing 128 pairs at once took
    255 registers and spilled on sm_90 (runs/bench-experts-prefill-tp8/next-relock-grouping/)."""
    for name, usage in _compiled(GROUPING_SCRIPT).items():
        assert usage["STACK"] == 0 and usage["REG"] <= 128, (name, usage)


PDL_SCRIPT = r'''
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import _sizes
from workbench.sm90 import compile_sm90
import workbench.variants.kernels.gemv as gemv
import workbench.variants.kernels.moe as moe

out = {}
for pdl in (False, True):
    out[f"linear pdl={pdl}"] = compile_sm90(gemv.linear_kernel, dict(
        x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", part_ptr="*bf16", lock_ptr="*i32", M="i32", N="i32",
        K="i32", stride_xm="i32", b1="i32", b2="i32", b3="i32"), dict(
        BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, DOT=False, SWIGLU=False, IEEE=False, PDL=pdl),
        ints=dict(M=1, N=7168, K=5120, stride_xm=5120, b1=7168, b2=7168, b3=7168), num_warps=2).asm["ptx"]
    out[f"experts gate/up pdl={pdl}"] = compile_sm90(moe.gate_up_gemv_kernel, dict(
        x_ptr="*bf16", ids_ptr="*i64", wg_ptr="*bf16", wu_ptr="*bf16", act_ptr="*bf16", part_ptr="*fp32",
        count_ptr="*i32", HIDDEN="i32", FF="i32", K_PER_SPLIT="i32", stride_we="i32", stride_wf="i32"), dict(
        TOP_K=8, BLOCK_N=8, BLOCK_K=512, SPLIT=1, PDL=pdl), ints=_sizes(8), num_warps=2).asm["ptx"]
json.dump(out, sys.stdout)
'''


def test_pdl_kernels_wait_in_the_ptx_and_only_a_gemv_reads_weights_before():
    """With PDL, the GEMV's first weight tile is loaded before griddepcontrol.wait (weights are never
    written), the experts kernel loads nothing before it (its rows depend on routed ids); without
    PDL neither instruction is emitted."""
    ptx = _compiled(PDL_SCRIPT)

    def before_wait(text):
        lines = [line.strip() for line in text.splitlines()]
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
        assert any(line.startswith("griddepcontrol.launch_dependents") for line in lines[:wait])
        return [line for line in lines[:wait] if line.lstrip("@%!p0123456789 ").startswith("ld.global")]

    for name in ("linear", "experts gate/up"):
        assert "griddepcontrol" not in ptx[f"{name} pdl=False"], name
    assert before_wait(ptx["linear pdl=True"]), "the GEMV reads no weights before its wait"
    assert not before_wait(ptx["experts gate/up pdl=True"]), "experts reads memory before its wait"


MERGED = r'''
import json, sys, triton
from workbench.sm90 import compile_sm90, resource_usage
import workbench.variants.kernels.attention_merged_gemv as merged
from workbench.variants.attention_out.triton_merged import CONFIGS

sig = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", g_ptr="*bf16", bias_ptr="*bf16", w_ptr="*bf16",
           out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", n_heads="i32", head_dim="i32",
           n_splits="i32", g_stride="i32")
out = []
for c in CONFIGS:  # beam-501b-tp8's rank: 6 query heads of 128; a 512-key window's splits
    heads = merged.head_group(6, c["merged"]["HEADS"])
    splits = min(c["attention"]["MAX_SPLITS"], -(-511 // c["attention"]["BLOCK_N"]) + 1)
    kernel = compile_sm90(merged._merged_gemv_kernel, sig, dict(
        HEADS=heads, SPLIT_K=6 // heads, BLOCK_N=c["merged"]["BLOCK_N"], BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=128, PDL=True), num_warps=c["merged"]["num_warps"])
    out.append(dict(merged=c["merged"], splits=splits, **resource_usage(kernel)))
json.dump(out, sys.stdout)
'''


def test_attention_out_merged_configs_do_not_spill():
    """Every attention_out:triton_merged config's GEMV at the TP8 rank's decode sizes, for sm_90."""
    usage = _compiled(MERGED)
    assert len(usage) >= 6
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255, u



TASKS = r"""
import json, sys
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.attention_out.triton_tasks import CONFIGS
from workbench.variants.kernels import attention_tasks as at

I32 = "i32"
sig = dict(q_ptr="*bf16", cache_ptr="*bf16", table_ptr="*i32", seq_lens_ptr="*i32", pos_ptr="*i64", g_ptr="*bf16",
           bias_ptr="*bf16", w_ptr="*bf16", gated_ptr="*bf16", y_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32",
           acc_ptr="*fp32", queue_ptr="*i32", stride_qn=I32, stride_qh=I32, stride_cp=I32, stride_ckv=I32,
           stride_ct=I32, stride_ch=I32, stride_tb=I32, g_stride=I32, max_pages=I32, window=I32, qk_scale="fp32",
           n_tokens=I32, n_heads=I32, kv_heads=I32, head_dim=I32, hidden=I32, n_splits=I32)
ints = dict(stride_qn=768, stride_qh=128, stride_cp=4096, stride_ckv=2048, stride_ct=128, stride_ch=128, g_stride=768,
            head_dim=128, hidden=5120)
out = []
for c in CONFIGS:  # beam-501b-tp8's rank: 6 query heads of 128 on one kv head, o_proj 5120 x 768
    a = c["attention"]
    splits = min(a["MAX_SPLITS"], -(-511 // a["BLOCK_N"]) + 1)
    kernel = compile_sm90(at._tasks_kernel, sig, dict(
        GROUP=6, BLOCK_G=16, BLOCK_D=128, BLOCK_N=a["BLOCK_N"], PAGE=16, HAS_WINDOW=True, IEEE=False, INTERP=False,
        EARLY_V=a["EARLY_V"], MERGE_BLOCK_S=1 << (splits - 1).bit_length(), MERGE_BLOCK_D=32, ROWS=c["tasks"]["ROWS"],
        K_P2=1024, COUNTER_BLOCK=at.COUNTER_BLOCK, PDL=True), ints=ints, num_warps=c["tasks"]["num_warps"],
        num_stages=1)
    out.append(dict(tasks=c["tasks"], ptx=kernel.asm["ptx"], **resource_usage(kernel)))
json.dump(out, sys.stdout)
"""


def test_attention_out_tasks_compiles_without_spills_with_its_queue_in_the_ptx():
    """attention_out:triton_tasks at the TP8 rank's decode sizes, for sm_90: no config spills, and the
    PTX holds what the queue relies on. The first o_proj weight tile is loaded before the PDL wait;
    tickets are taken after it, by one thread; each wait reads its counter with a
    GPU-scope acquire by one thread, and the CTA meets before leaving the spin; each task counts
    itself in with a GPU-scope release after a CTA barrier, its stores all before it; the last program
    out resets the ticket and the exit count; the other programs' results are read from L2."""
    usage = _compiled(TASKS)
    assert len(usage) >= 6
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255, {k: v for k, v in u.items() if k != "ptx"}
    lines = [line.strip() for line in usage[0]["ptx"].splitlines()]
    code = [line for line in lines if line and not line.startswith(("//", ".loc", "$L"))]
    tickets = [i for i, line in enumerate(code) if "atom.global.gpu.relaxed.add" in line]
    waits = [i for i, line in enumerate(code) if "ld.global.gpu.acquire" in line]
    assert len(tickets) == 2 and waits, "a ticket before the loop and one at its end; the waits"
    pdl_wait = next(i for i, line in enumerate(code) if line.startswith("griddepcontrol.wait"))
    assert pdl_wait < tickets[0] and all(code[i].startswith("@%p") for i in tickets + waits)
    weights = [line for line in code[:pdl_wait] if any(t.startswith("ld.global.v4") for t in line.split()[:2])]
    assert len(weights) >= 8, "the first o_proj weight tile is not loaded before the PDL wait"
    for i in waits:
        branch = next(j for j in range(i, len(code)) if " bra" in code[j])
        assert any(line.startswith("bar.sync") for line in code[i:branch]), "threads leave a spin before the read"
    # a release add whose result is unused: `red` (Triton 3.9) or `atom` (3.6, the GPU host's)
    releases = ("red.global.gpu.release.add", "atom.global.gpu.release.add")
    signals = [i for i, line in enumerate(code) if any(r in line for r in releases)]
    assert len(signals) == 2, "the attention and merge tasks each count themselves in"
    for i in signals:
        meet = max(j for j in range(i) if code[j].startswith("bar.sync"))
        assert not any("st.global" in line for line in code[meet:i]), "a store after the barrier before the release"
    assert any("atom.global.gpu.acq_rel.add" in line for line in code), "programs do not count themselves out"
    assert sum("atom.global.gpu.acq_rel.exch" in line for line in code) == 2, "ticket and exit count not reset"
    assert any("ld.global.cg" in line for line in code), "other programs' results not read from L2"

QUANTIZED = r'''
import json
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.experts.triton_quantized import CONFIGS
from workbench.variants.kernels import moe_quantized as mq

H, F = 5120, 320  # beam-501b-tp8's rank: hidden, ff
out = []
for fmt in ("fp8", "nvfp4"):
    nvfp4 = fmt == "nvfp4"
    w, s = ("*u8", "*fp8e4nv") if nvfp4 else ("*fp8e4nv", "*fp32")
    per_byte, blocks_h, blocks_f = (2, H // 16, F // 16) if nvfp4 else (1, 1, 1)  # inputs a byte, scales a row
    for c in CONFIGS:
        gate_up = compile_sm90(mq.gate_up_quantized_kernel, dict(
            x_ptr="*bf16", ids_ptr="*i64", wg_ptr=w, wu_ptr=w, sg_ptr=s, su_ptr=s, sg2_ptr="*fp32", su2_ptr="*fp32",
            act_ptr="*bf16", HIDDEN="i32", FF="i32", stride_we="i32", stride_wf="i32", stride_se="i32",
            stride_sf="i32"), dict(TOP_K=8, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], NVFP4=nvfp4, PDL=True),
            ints=dict(HIDDEN=H, FF=F, stride_we=F * H // per_byte, stride_wf=H // per_byte, stride_se=F * blocks_h,
                      stride_sf=blocks_h), num_warps=c["num_warps"], num_stages=c["num_stages"])
        down = compile_sm90(mq.down_quantized_kernel, dict(
            act_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wd_ptr=w, sd_ptr=s, sd2_ptr="*fp32", y_ptr="*bf16",
            HIDDEN="i32", FF="i32", stride_we="i32", stride_wh="i32", stride_se="i32", stride_sh="i32"), dict(
            TOP_K=8, K_P2=8, BLOCK_N=c["DOWN_BLOCK_N"], BLOCK_K=c["DOWN_BLOCK_K"], NVFP4=nvfp4, PDL=True),
            ints=dict(HIDDEN=H, FF=F, stride_we=H * F // per_byte, stride_wh=F // per_byte, stride_se=H * blocks_f,
                      stride_sh=blocks_f), num_warps=c.get("DOWN_WARPS", c["num_warps"]), num_stages=c["num_stages"])
        for name, k in (("gate_up", gate_up), ("down", down)):
            ptx = k.asm["ptx"]
            out.append(dict(fmt=fmt, kernel=name, config=c, e4m3_cvt="e4m3x2" in ptx,
                            waits="griddepcontrol.wait" in ptx, **resource_usage(k)))
print(json.dumps(out))
'''


def test_quantized_experts_configs_do_not_spill_and_convert_e4m3_natively():
    """Every experts:triton_quantized config, both kernels in both formats, with PDL, at the TP8 rank's decode
    sizes for sm_90: no spills, the E4M3 weights (FP8) and block scales (NVFP4) converted by the hardware's
    cvt from e4m3x2, not emulated, and a grid dependency wait."""
    usage = _compiled(QUANTIZED)
    from workbench.variants.experts.triton_quantized import CONFIGS

    assert len(usage) == 2 * 2 * len(CONFIGS)
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255 and u["e4m3_cvt"] and u["waits"], u


QUANTIZED_ROWS = r"""
import json
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.experts.triton_quantized_rows import CONFIGS
from workbench.variants.kernels import moe_quantized_rows as mq
from workbench.variants.kernels.moe_rows import pieces

H, F = 5120, 320  # beam-501b-tp8's rank: hidden, ff
out = []
for fmt in ("fp8", "nvfp4"):
    nvfp4 = fmt == "nvfp4"
    w, s = ("*i64", "*fp8e4nv") if nvfp4 else ("*fp8e4nv", "*fp32")
    unit = 16 if nvfp4 else 1  # inputs a stored element (NVFP4: a 64-bit word)
    scales_h, scales_f = (H // 16, F // 16) if nvfp4 else (1, 1)  # scales a row
    for c in CONFIGS:
        a, b = pieces(H // unit)
        gate_up = compile_sm90(mq.gate_up_quantized_rows_kernel, dict(
            x_ptr="*bf16", ids_ptr="*i64", wg_ptr=w, wu_ptr=w, sg_ptr=s, su_ptr=s, sg2_ptr="*fp32", su2_ptr="*fp32",
            act_ptr="*bf16", FF="i32", stride_we="i32", stride_wf="i32", stride_se="i32", stride_sf="i32"), dict(
            HIDDEN=H, A=a, B=b, TOP_K=8, BLOCK_N=c["BLOCK_N"], STEPS=c.get("STEPS", 1), NVFP4=nvfp4, PDL=True),
            ints=dict(FF=F, stride_we=F * H // unit, stride_wf=H // unit, stride_se=F * scales_h, stride_sf=scales_h),
            num_warps=c["num_warps"], num_stages=1)
        a, b = pieces(F // unit)
        down = compile_sm90(mq.down_quantized_rows_kernel, dict(
            act_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wd_ptr=w, sd_ptr=s, sd2_ptr="*fp32", y_ptr="*bf16",
            HIDDEN="i32", stride_we="i32", stride_wh="i32", stride_se="i32", stride_sh="i32"), dict(
            FF=F, A=a, B=b, TOP_K=8, K_P2=8, BLOCK_N=c["DOWN_BLOCK_N"], STEPS=c.get("DOWN_STEPS", 1), NVFP4=nvfp4,
            PDL=True), ints=dict(HIDDEN=H, stride_we=H * F // unit, stride_wh=F // unit, stride_se=H * scales_f,
                                 stride_sh=scales_f), num_warps=c["DOWN_WARPS"], num_stages=1)
        for name, k in (("gate_up", gate_up), ("down", down)):
            ptx = k.asm["ptx"]
            steps = c.get("STEPS" if name == "gate_up" else "DOWN_STEPS", 1)
            out.append(dict(fmt=fmt, kernel=name, config=c, e4m3_cvt="e4m3x2" in ptx, steps=steps,
                            int_to_float="cvt.rn.f32.s32" in ptx or "cvt.rn.f32.u32" in ptx,
                            shared_stores=ptx.count("st.shared"),
                            waits="griddepcontrol.wait" in ptx, **resource_usage(k)))
print(json.dumps(out))
"""


def test_quantized_rows_configs_do_not_spill_and_decode_without_integer_conversions():
    """Every experts:triton_quantized_rows config, both kernels in both formats, with PDL, at the TP8 rank's decode
    sizes for sm_90: no spills, E4M3 converted by the hardware's cvt from e4m3x2, a grid dependency wait, no
    integer-to-float conversion (NVFP4's codes become fp16 by their bits), and shared memory only for the
    reductions across warps: a block's inputs sent through it to the weights' layout (a gate/up block of two rows
    does that) store 30 or more times a program, each behind a CTA barrier."""
    usage = _compiled(QUANTIZED_ROWS)
    from workbench.variants.experts.triton_quantized_rows import CONFIGS

    assert len(usage) == 2 * 2 * len(CONFIGS)
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255 and u["e4m3_cvt"] and u["waits"], u
        assert not u["int_to_float"] and u["shared_stores"] <= 8 * u["steps"], u


QUANTIZED_GROUPED = r"""
import json
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.experts.triton_quantized_grouped import CONFIGS
from workbench.variants.kernels import moe_quantized_grouped as mg

H, F, E, PAIRS = 5120, 320, 256, 8 * 2048 * 8  # beam-501b-tp8's rank: hidden, ff, experts; the 8 x 2K prefill
out = []
for fmt in ("fp8", "nvfp4"):
    nvfp4 = fmt == "nvfp4"
    w, s = ("*u8", "*fp8e4nv") if nvfp4 else ("*fp8e4nv", "*fp32")
    per_byte, scales_h, scales_f = (2, H // 16, F // 16) if nvfp4 else (1, 1, 1)
    for c in CONFIGS:
        gate_up = compile_sm90(mg.gate_up_quantized_grouped_kernel, dict(
            x_ptr="*bf16", xs_ptr="*fp32", pairs_ptr="*i32", block_expert_ptr="*i32", wg_ptr=w, wu_ptr=w, sg_ptr=s,
            su_ptr=s, sg2_ptr="*fp32", su2_ptr="*fp32", act_ptr="*bf16", N_PAIRS="i32", N_EXPERTS="i32", HIDDEN="i32",
            FF="i32", stride_we="i32", stride_wf="i32", stride_se="i32", stride_sf="i32"), dict(
            TOP_K=8, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], N_BLOCKS_N=-(-F // c["BLOCK_N"]),
            NVFP4=nvfp4, PRECISION=None, INTERP=False, PDL=True), ints=dict(
            N_PAIRS=PAIRS, N_EXPERTS=E, HIDDEN=H, FF=F, stride_we=F * H // per_byte, stride_wf=H // per_byte,
            stride_se=F * scales_h, stride_sf=scales_h), num_warps=c["num_warps"], num_stages=c["num_stages"])
        bn, bk = c.get("DOWN_BLOCK_N", c["BLOCK_N"]), c.get("DOWN_BLOCK_K", c["BLOCK_K"])
        down = compile_sm90(mg.down_quantized_grouped_kernel, dict(
            act_ptr="*bf16", as_ptr="*fp32", pairs_ptr="*i32", block_expert_ptr="*i32", wd_ptr=w,
            sd_ptr=s, sd2_ptr="*fp32", out_ptr="*bf16", N_PAIRS="i32", N_EXPERTS="i32", HIDDEN="i32", FF="i32",
            stride_we="i32", stride_wh="i32", stride_se="i32", stride_sh="i32"), dict(
            BLOCK_M=c["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=H // bn, NVFP4=nvfp4, PRECISION=None, INTERP=False,
            PDL=True), ints=dict(N_PAIRS=PAIRS, N_EXPERTS=E, HIDDEN=H, FF=F, stride_we=H * F // per_byte,
                                 stride_wh=F // per_byte, stride_se=H * scales_f, stride_sh=scales_f),
            num_warps=c.get("DOWN_WARPS", c["num_warps"]), num_stages=c.get("DOWN_STAGES", c["num_stages"]))
        for name, k in (("gate_up", gate_up), ("down", down)):
            ptx = k.asm["ptx"]
            out.append(dict(fmt=fmt, kernel=name, config=c, pipelined="cp.async" in ptx,
                            tensor_cores="wgmma" in ptx or "mma.sync" in ptx, waits="griddepcontrol.wait" in ptx,
                            packed_scale="mul.rn.bf16x2" in ptx, scalar_bf16=" mul.bf16 " in ptx or
                            "cvt.rn.bf16.f16" in ptx, **resource_usage(k)))
print(json.dumps(out))
"""


def test_quantized_grouped_configs_do_not_spill_and_pipeline_their_packed_loads():
    """Every experts:triton_quantized_grouped config, both kernels in both formats, with PDL, at the TP8 rank's
    8 x 2K prefill for sm_90: no spills, the packed weight loads pipelined (cp.async) though dequantized before
    the dot, tensor-core dots, a grid dependency wait, and shared memory within an SM's 227 KB. Stored values are
    scaled by packed bf16 multiplies, with no one-value bf16 arithmetic or fp16-to-bf16 conversion (both cost
    repacking or a slow pipe per code)."""
    usage = _compiled(QUANTIZED_GROUPED)
    from workbench.variants.experts.triton_quantized_grouped import CONFIGS

    assert len(usage) == 2 * 2 * len(CONFIGS)
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255, u
        assert u["pipelined"] and u["tensor_cores"] and u["waits"] and u["DYN_SHARED"] <= 227 * 1024, u
        assert u["packed_scale"] and not u["scalar_bf16"], u


FP8_GROUPED = r"""
import json
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.experts.triton_fp8_grouped import CONFIGS
from workbench.variants.kernels import moe_quantized_grouped as mg

H, F, E, PAIRS = 5120, 320, 256, 8 * 2048 * 8  # beam-501b-tp8's rank: hidden, ff, experts; the 8 x 2K prefill
out = []
for c in CONFIGS:
    gate_up = compile_sm90(mg.gate_up_quantized_grouped_kernel, dict(
        x_ptr="*fp8e4nv", xs_ptr="*fp32", pairs_ptr="*i32", block_expert_ptr="*i32", wg_ptr="*fp8e4nv",
        wu_ptr="*fp8e4nv", sg_ptr="*fp32", su_ptr="*fp32", sg2_ptr="*fp32", su2_ptr="*fp32", act_ptr="*bf16",
        N_PAIRS="i32", N_EXPERTS="i32", HIDDEN="i32", FF="i32", stride_we="i32", stride_wf="i32", stride_se="i32",
        stride_sf="i32"),
        dict(TOP_K=8, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
             N_BLOCKS_N=-(-F // c["BLOCK_N"]), NVFP4=False, PRECISION=None, INTERP=False, PDL=False),
        ints=dict(N_PAIRS=PAIRS, N_EXPERTS=E, HIDDEN=H, FF=F, stride_we=F * H, stride_wf=H, stride_se=F, stride_sf=1),
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    bn, bk = c.get("DOWN_BLOCK_N", c["BLOCK_N"]), c.get("DOWN_BLOCK_K", c["BLOCK_K"])
    down = compile_sm90(mg.down_quantized_grouped_kernel, dict(
        act_ptr="*fp8e4nv", as_ptr="*fp32", pairs_ptr="*i32", block_expert_ptr="*i32",
        wd_ptr="*fp8e4nv", sd_ptr="*fp32", sd2_ptr="*fp32", out_ptr="*bf16", N_PAIRS="i32", N_EXPERTS="i32",
        HIDDEN="i32", FF="i32", stride_we="i32", stride_wh="i32", stride_se="i32", stride_sh="i32"), dict(
        BLOCK_M=c["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=H // bn, NVFP4=False, PRECISION=None,
        INTERP=False, PDL=False), ints=dict(
        N_PAIRS=PAIRS, N_EXPERTS=E, HIDDEN=H, FF=F, stride_we=H * F, stride_wh=F, stride_se=H, stride_sh=1),
        num_warps=c.get("DOWN_WARPS", c["num_warps"]), num_stages=c.get("DOWN_STAGES", c["num_stages"]))
    for name, k in (("gate_up", gate_up), ("down", down)):
        ptx = k.asm["ptx"]
        fp8_mma = any(("wgmma" in line or "mma.sync" in line) and "e4m3.e4m3" in line for line in ptx.splitlines())
        out.append(dict(kernel=name, config=c, pipelined="cp.async" in ptx, fp8_tensor_cores=fp8_mma,
                        tensor_cores="mma" in ptx, **resource_usage(k)))
print(json.dumps(out))
"""


def test_fp8_grouped_configs_run_on_fp8_tensor_cores_without_spills():
    """Every experts:triton_fp8_grouped config, both kernels, at the TP8 rank's 8 x 2K prefill for sm_90:
    E4M3 x E4M3 tensor-core instructions (the point of W8A8) at the prompt tiles (BLOCK_M of 64 or more, wgmma;
    at 16 rows Triton takes mma.sync on exact fp16 copies, for decode batches bound by bytes), no spills,
    pipelined loads, shared memory within an SM's 227 KB."""
    usage = _compiled(FP8_GROUPED)
    from workbench.variants.experts.triton_fp8_grouped import CONFIGS

    assert len(usage) == 2 * len(CONFIGS)
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255, u
        assert u["fp8_tensor_cores"] or (u["config"]["BLOCK_M"] < 64 and u["tensor_cores"]), u
        assert u["pipelined"] and u["DYN_SHARED"] <= 227 * 1024, u


FP8_GEMV = r"""
import json
import importlib
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.kernels import gemv_fp8

H, Q, F = 5120, 768, 2560  # beam-501b-tp8's rank: hidden, q width, dense ff
# (point, K, N, SWIGLU) of each launch the point's variant makes
LAUNCHES = [("qkvg_proj", H, Q, False), ("dense_mlp", H, F, True), ("dense_mlp", F, H, False),
            ("attn_out", Q, H, False)]
out = []
for point, k, n, swiglu in LAUNCHES:
    for c in importlib.import_module(f"workbench.variants.{point}.triton_fp8").CONFIGS:
        for rows in (1, gemv_fp8.MAX_ROWS):
            block_m, block_k = gemv_fp8.tiles(c, rows, k)
            kernel = compile_sm90(gemv_fp8.fp8_gemv_kernel, dict(
                x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", w2_ptr="*fp8e4nv", s2_ptr="*fp32", y_ptr="*bf16",
                M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_sn="i32"), dict(
                BLOCK_M=block_m, BLOCK_N=c["BLOCK_N"], BLOCK_K=block_k, SWIGLU=swiglu,
                PDL=True), ints=dict(M=rows, N=n, K=k, stride_xm=k, stride_wn=k, stride_sn=1),
                num_warps=c["num_warps"], num_stages=c["num_stages"])
            ptx = kernel.asm["ptx"]
            out.append(dict(point=point, swiglu=swiglu, rows=rows, config=c, e4m3_cvt="e4m3x2" in ptx,
                            waits="griddepcontrol.wait" in ptx, **resource_usage(kernel)))
print(json.dumps(out))
"""


def test_fp8_gemv_configs_do_not_spill_and_convert_e4m3_natively():
    """Every *:triton_fp8 config, each launch its variant makes, at one row and at MAX_ROWS, with PDL, at the
    TP8 rank's sizes for sm_90: no spills, the E4M3 weights converted by the hardware's cvt from e4m3x2, not
    emulated, and a grid dependency wait."""
    usage = _compiled(FP8_GEMV)
    assert len(usage) == 4 * 3 * 2
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255 and u["e4m3_cvt"] and u["waits"], u


FP8_ROWS_GEMV = r"""
import json
from workbench.sm90 import compile_sm90, resource_usage
from workbench.variants.kernels import gemv_fp8_rows as rows
from workbench.variants.kernels.moe_rows import pieces

H, Q, F, HD = 5120, 768, 2560, 128  # beam-501b-tp8's rank: hidden, q width, dense ff, head dim
# (point, K, N, GATED, SWIGLU) of each launch the point's variant makes
LAUNCHES = [("qkvg_proj", H, Q + 2 * HD + Q, False, False), ("dense_mlp", H, F, False, True),
            ("dense_mlp", F, H, False, False), ("attn_out", Q, H, True, False)]
out = []
for point, k, n, gated, swiglu in LAUNCHES:
    k_a, k_b = pieces(k)
    for c in rows.CONFIGS + (rows.NARROW_CONFIGS if point == "attn_out" else []):
        for m in (1, rows.ROWS):
            kernel = compile_sm90(rows.fp8_rows_gemv_kernel, dict(
                x_ptr="*bf16", g_ptr="*bf16", bias_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", w2_ptr="*fp8e4nv",
                s2_ptr="*fp32", y_ptr="*bf16", N="i32", stride_xm="i32", stride_xh="i32", stride_g="i32",
                stride_wn="i32", stride_sn="i32"), dict(
                M=m, K=k, K_A=k_a, K_B=k_b, BLOCK_N=c["BLOCK_N"], HD=HD if gated else 1, GATED=gated,
                SWIGLU=swiglu, PDL=True), ints=dict(N=n, stride_xm=k, stride_xh=HD, stride_g=k, stride_wn=k,
                                                    stride_sn=1), num_warps=c["num_warps"], num_stages=1)
            lines = [line.strip() for line in kernel.asm["ptx"].splitlines()]
            wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
            loads = [i for i, line in enumerate(lines) if line.lstrip("@%!p0123456789 ").startswith("ld.global")]
            out.append(dict(point=point, rows=m, config=c, e4m3_cvt=any("e4m3x2" in line for line in lines),
                            loads_before_wait=sum(i < wait for i in loads),
                            loads_after_wait=sum(i > wait for i in loads), **resource_usage(kernel)))
print(json.dumps(out))
"""


def test_fp8_rows_gemv_reads_its_weights_before_the_wait_without_spills():
    """Every *:triton_fp8_rows config, each launch its variant makes, at one row and at ROWS, with PDL, at the
    TP8 rank's sizes for sm_90: no spills, the E4M3 weights converted by the hardware's cvt from e4m3x2, and
    the weight rows and scales loaded before griddepcontrol.wait, the activations after it."""
    usage = _compiled(FP8_ROWS_GEMV)
    from workbench.variants.kernels.gemv_fp8_rows import CONFIGS, NARROW_CONFIGS

    assert len(usage) == (4 * len(CONFIGS) + len(NARROW_CONFIGS)) * 2
    for u in usage:
        assert u["STACK"] == 0 and u["LOCAL"] == 0 and 0 < u["REG"] <= 255 and u["e4m3_cvt"], u
        assert u["loads_before_wait"] >= 3 and u["loads_after_wait"] >= 2, u
