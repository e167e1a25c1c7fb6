import traceback
import torch
from workbench import registry

fn = registry.get("sample", "torch_compile").fn
n, v = 8, 16384
logits = torch.randn(n, v, device="cuda") * 5
t = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 2.0, 1.0, 0.7], device="cuda")
k = torch.tensor([0, 0, 20, 0, 5, 50, 0, 20], device="cuda")
p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 0.95, 1.0, 1.0], device="cuda")
for label, kw in [("generator", dict(generator=torch.Generator(device="cuda").manual_seed(0))), ("no generator", {})]:
    torch._dynamo.reset()
    try:
        print(label, fn(logits, t, k, p, **kw))
    except Exception:
        print("FAILED", label)
        traceback.print_exc()
