"""`dense_mlp`: the SwiGLU MLP of the first dense layers.

Contract: `dense_mlp(x, w) -> y`; x [N, hidden]; w {"gate_proj", "up_proj": [ff, hidden],
"down_proj": [hidden, ff]}; y = down(silu(gate x) * up x), activation in FP32 rounded once.
"""

from beam_model.functional import swiglu
from workbench.registry import register


@register("dense_mlp", "torch", "torch")
def dense_mlp(x, w):
    return swiglu(x, w["gate_proj"], w["up_proj"], w["down_proj"])
