"""The agent protocol: scaffold a variant, load variants from outside the package, judge candidates.

- `scaffold`: `workbench variant new` (a variant module that starts as the point's reference).
- `plugins`: variant modules from a user directory, registered like the package's own.
- `static_check`: rejects a candidate's banned tricks before it runs (AST only).
- `worker`: runs candidate code in a child process with a time and memory limit.
- `judge`: static check -> isolated gates and checked timing -> the roofline sanity check.
- `loop`: `workbench optimize --agent CMD`: task folders, rounds, `attempts.jsonl`.

Nothing here edits the package's own variants, and no candidate from outside the package is
imported into the workbench's process before the judge has accepted it.
"""
