"""Kernels that more than one variant module runs (Triton, CuTe DSL, FlashInfer wrappers), with public
names. A kernel module imports nothing from a point package: points import kernels, never the reverse."""
