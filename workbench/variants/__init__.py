"""The op layer's implementations: one package per fusion point. A point's `__init__.py` declares its
contract (docstring), its plain-PyTorch reference (named `torch`) and its `PointSpec`; each other
module of the package registers one variant, named after the module. `kernels/` holds the kernels
several modules run, `inputs.py` the specs' input builders. Nothing here imports the harness (gates,
search, lock), the server, the CLI or `beam_model`'s model code (only its config, math and cache)."""
