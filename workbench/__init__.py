"""beam-workbench: fusion-point registry, gates, timing, search and lock files for the Beam model.

Importing this package must stay cheap: the model imports `workbench.registry` at start-up.
"""
