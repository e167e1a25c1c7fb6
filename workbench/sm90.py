"""Triton kernels compiled for the H200 (sm_90) on any machine, no GPU needed: Triton's own compiler
produces the PTX and the cubin, and `cuobjdump` (in the triton wheel) reads the cubin's registers,
spills and shared memory. For checks the CPU interpreter cannot make (memory ordering in the PTX,
register pressure of a tuning config). Run with TRITON_INTERPRET unset: interpreted kernels do not
compile.
"""

import os
import re
import subprocess
import tempfile


def compile_sm90(fn, signature: dict, constexprs: dict, **options):
    """`fn` (a @triton.jit kernel) compiled for sm_90: `signature` maps each runtime argument to its
    type ("*bf16", "i32", ...), `constexprs` the rest to values; `options`: num_warps, num_stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(kernel) -> dict[str, int]:
    """{"REG", "STACK", "SHARED", "LOCAL"} of a compiled kernel, from its cubin (STACK > 0: spills)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
