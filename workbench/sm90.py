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


def compile_sm90(fn, signature: dict, constexprs: dict, ints: dict | None = None, **options):
    """`fn` (a @triton.jit kernel) compiled for sm_90: `signature` maps each runtime argument to its
    type ("*bf16", "i32", ...), `constexprs` the rest to values; `options`: num_warps, num_stages.
    `ints`: the values a launch passes for integer arguments. As a real launch does, pointers (torch
    allocations are 16-byte aligned) and integers divisible by 16 are compiled as such: that decides
    vector widths, and whether a loop's loads are pipelined (cp.async) at all. An integer not in
    `ints` gets no such hint."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Constexprs left out take their Python defaults, as a launch does (ASTSource applies none)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default
                     and p.name not in signature}, **constexprs}
    aligned = [name for name, kind in signature.items()
               if kind.startswith("*") or (ints or {}).get(name, 1) % 16 == 0]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(kernel) -> dict[str, int]:
    """{"REG", "STACK", "SHARED", "LOCAL"} of a compiled kernel, from its cubin (STACK > 0: spills),
    and "DYN_SHARED": the shared memory Triton requests at launch (its pipeline buffers), which the
    cubin's static SHARED does not count."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {**{k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)},
            "DYN_SHARED": kernel.metadata.shared}
