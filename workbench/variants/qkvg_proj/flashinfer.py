"""`qkvg_proj:flashinfer`: decode rows of the packed q/k/v/gate weight (`kernels/packed_qkvg.py`)
through FlashInfer's `tinygemm_bf16` (`kernels/tinygemm.py`: its semantics and limits); a prompt's
rows through `qkvg_proj:packed` on the same packed weight, so a decode-searched lock also serves
prefill steps. Its "pdl" configs launch tinygemm_bf16 with programmatic dependent launch.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.packed_qkvg import pack_qkvg
from workbench.variants.kernels.tinygemm import MAX_TOKENS, tinygemm, tinygemm_limits
from workbench.variants.qkvg_proj.packed import qkvg_packed


def _supports(wl):
    c = wl.config
    return tinygemm_limits(wl, c.hidden_size, 2 * c.q_width + 2 * c.kv_width)


def _qkvg_flashinfer_at(x, w, *, pdl=False):
    if not 0 < x.shape[0] <= MAX_TOKENS:
        return qkvg_packed(x, w)
    y = tinygemm(x, w["qkvg"], pdl)
    if y.shape[0] == 1:  # one row: each segment is a contiguous view
        return tuple(t.view(1, -1) for t in y.view(-1).split(w["sizes"]))
    return tuple(t.contiguous() for t in y.split(w["sizes"], dim=1))


@register("qkvg_proj", "flashinfer", "flashinfer", prepare=pack_qkvg, supports=_supports, pdl=True,
          configure=lambda cfg: functools.partial(_qkvg_flashinfer_at, pdl=cfg.get("pdl", False)))
def qkvg_flashinfer(x, w):
    """Decode rows through tinygemm_bf16 on the packed weight; more rows through `packed`."""
    return _qkvg_flashinfer_at(x, w)
