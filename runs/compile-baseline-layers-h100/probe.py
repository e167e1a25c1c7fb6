"""The decode-b1 step of beam-501b-tp8 cut to a few layers (it then fits an H100), graphed: the reference,
the whole step through torch.compile per mode, each also with `qkvg_proj:packed`, and every point's
torch_compile; probe.json holds the step times, kernels-*.txt the profiler's kernel tables of five steps.

    PYTHONPATH=. python3 runs/compile-baseline-layers-h100/probe.py OUT 8 default,max-autotune-no-cudagraphs
"""
import dataclasses, json, os, sys, time
import torch
from beam_model.config import BeamConfig
from beam_model.model import BeamForCausalLM
from workbench import timing
from workbench.targets import StepRunner, get_target

out = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["default"]
os.makedirs(out, exist_ok=True)
cfg = BeamConfig.from_preset(os.environ.get("PRESET", "beam-501b-tp8"))
cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=[])  # the default layer pattern again
print("layer types", cfg.layer_types, flush=True)
model = BeamForCausalLM.random(cfg, dtype=torch.bfloat16, device=os.environ.get("DEV", "cuda"))
target = get_target("decode-b1")
runner = StepRunner(model, target)
res = {"layers": layers, "layer_types": cfg.layer_types, "torch": torch.__version__}

def t(name, selection, mode=None):
    s = time.time()
    try:
        runner.rebind(selection, compile_mode=mode)
        r = timing.time_fn(runner, device=model.device, budget_s=2.0)
        res[name] = {"median_us": r["median_us"], "build_s": time.time() - s}
    except Exception as e:
        res[name] = {"error": repr(e)[:500]}
    print(name, res[name], flush=True)
    json.dump(res, open(f"{out}/probe.json", "w"), indent=1)

def prof(name):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        runner()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            runner()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    tab = p.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=110)
    open(f"{out}/kernels-{name}.txt", "w").write(tab)

t("reference", {})
t("packed", {"qkvg_proj": "packed"})
for mode in modes:
    t(f"compile-{mode}", {}, mode)
    prof(f"compile-{mode}")
    torch._dynamo.reset()
    t(f"compile-{mode}-packed", {"qkvg_proj": "packed"}, mode)
    torch._dynamo.reset()
t("points", {p: "torch_compile" for p in ("boundary", "qkvg_proj", "qk_prep", "attention", "attn_out", "route", "experts", "dense_mlp", "head")})
prof("points")
