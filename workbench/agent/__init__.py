"""The agent protocol: scaffold a variant, load variants from outside the package, judge candidates.

- `scaffold`: `workbench variant new` (a variant module that starts as the point's reference).
- `plugins`: variant modules from a user directory, registered like the package's own.
- `static_check`: the candidate keeps to an allowlist (`allowlist`), read from its AST before it runs;
  `module_source` resolves dotted names through the modules' source, never importing them.
- `worker`: runs a command or the judge in a child process with a time and memory limit, and ends
  everything it started.
- `sandbox`: the only process that imports a candidate: calls it on tensors in shared memory.
- `judge`: static check -> sandboxed gates and paired timing -> the sanity checks.
- `loop`: `workbench optimize --agent CMD`: task folders, rounds, `attempts.jsonl`.

Nothing here edits the package's own variants, and no candidate from outside the package is
imported into the workbench's process or the judge's worker before the judge has accepted it.
"""
