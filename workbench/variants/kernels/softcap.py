"""The logit soft-cap `cap * tanh(z / cap)` as a Triton device function, applied by `head:triton`
in its GEMM epilogue and by `head:triton_softcap` in its own pass over the logits.

Imports without triton (`triton_common.jit` leaves a plain function); never imports a variant.
"""

from workbench.variants.kernels.triton_common import jit, tl


@jit
def tanh_softcap(z, cap):
    """cap * tanh(z / cap) in FP32. Triton has no portable tanh: an odd Taylor series for |u| < 0.3
    (error < 1e-7 relative), else 1 - 2 / (exp(2|u|) + 1), which has no cancellation there."""
    u = z / cap
    a = tl.abs(u)
    u2 = u * u
    small = u * (1.0 + u2 * (-1.0 / 3 + u2 * (2.0 / 15 + u2 * (-17.0 / 315 + u2 * (62.0 / 2835)))))
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return cap * tl.where(a < 0.3, small, tl.where(u < 0, -big, big))
