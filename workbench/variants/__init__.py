"""One module per fusion point. Each declares the point's contract in its docstring and registers
its variants on it, the plain-PyTorch reference (named `torch`) first. Variants never import the
search, the server or the CLI, and never import `beam_model` model code (only its math helpers)."""
