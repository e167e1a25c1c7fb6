"""FlashInfer's SM90 CuTe-DSL fused-MoE GEMMs as the experts variants `flashinfer` and `flashinfer_down`
call them: where they run (`cute_moe_limits`, `cluster_supports`), the routing maps both GEMMs read
(`Routing`) and GEMM2, the grouped down projection (`down_rows`).

Imports no FlashInfer nor CUTLASS DSL: they are optional backends, imported on a variant's first call
(docs/decisions.md #25).
"""

import importlib.util
from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """moe_sort's maps: the pairs grouped by expert, each expert's rows padded to whole tiles."""
    tile_expert: torch.Tensor     # [max_tiles] int32: the expert of each tile (past num_tiles: unused)
    tile_row_limit: torch.Tensor  # [max_tiles] int32: rows of a tile at or past this are padding
    row_pair: torch.Tensor        # [max_tiles * tile] int32: the pair (token * top_k + k) of each row, -1 padding
    num_tiles: torch.Tensor       # [1] int32: tiles in use

    @property
    def rows(self) -> int:
        return self.row_pair.numel()


def _cutlass_installed() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def cute_moe_limits(wl, ff_multiple: int) -> bool | str:
    """True, or why FlashInfer's SM90 CuTe-DSL MoE GEMMs cannot run at `wl` (their constraints: 16-byte
    rows, BF16/FP16, Hopper; GEMM1's interleave also needs ff a multiple of 32)."""
    c = wl.config
    if not _cutlass_installed():
        return "FlashInfer's CuTe-DSL MoE GEMMs need the CUTLASS DSL package ('cutlass'), which is not installed"
    if wl.dtype not in ("bf16", "fp16"):
        return f"FlashInfer's CuTe-DSL MoE GEMMs take bf16 or fp16, not {wl.dtype}"
    if c.moe_intermediate_size % ff_multiple or c.hidden_size % 8:
        return (f"ff {c.moe_intermediate_size} must be a multiple of {ff_multiple} and hidden {c.hidden_size} "
                "of 8 (FlashInfer's CuTe-DSL MoE GEMMs)")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return f"FlashInfer's CuTe-DSL MoE GEMMs run on SM90 (Hopper) only, not sm_{major}{minor}"
    return True


def cluster_supports(config, wl):
    """GEMM2's (1, 2) cluster pairs N tiles: hidden must split into an even count of them."""
    tiles = -(-wl.config.hidden_size // config["gemm2_n"])
    if config["cluster_n"] == 2 and tiles % 2:
        return (f"a (1, 2) cluster needs an even count of {config['gemm2_n']}-wide N tiles over hidden "
                f"{wl.config.hidden_size}, not {tiles} (GEMM2)")
    return True


def down_rows(act, down, r: Routing, weights, top_k: int, *, tile: int, gemm2_n: int, cluster_n: int):
    """GEMM2: each routed pair's down projection [pairs, hidden] at row token * top_k + k, unscaled and
    rounded to the model dtype (the deterministic mode: `weights` [tokens, top_k] only sizes the rows
    here; the combine applies them)."""
    from flashinfer.fused_moe.cute_dsl.sm90_contiguous_grouped_gemm_finalize_fusion import (
        sm90_contiguous_grouped_gemm_finalize_fusion as gemm2,
    )

    rows = torch.empty((weights.numel(), down.shape[1]), dtype=act.dtype, device=act.device)
    gemm2(act, down, r.tile_expert, r.tile_row_limit, r.row_pair, r.num_tiles, weights, rows, topk=top_k,
          use_fused_finalize=False, tile_shape_mn=(tile, gemm2_n), cluster_shape_mn=(1, cluster_n), enable_pdl=False)
    return rows

