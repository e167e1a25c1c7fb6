"""CLI subcommands; see workbench/cli.py."""
