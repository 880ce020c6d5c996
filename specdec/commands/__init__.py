"""The `specdec` subcommands that belong to no subsystem: generate, serve, models, bench, drafts.

Each module has `register(subparsers)`, which adds its parser and sets `func`; cli.py calls every
subcommand's register (the eval, check-lossless and profile-drafts commands register from
quality/ and bench/) and dispatches. Heavy imports stay inside the command functions, so building
the parser stays cheap.
"""
