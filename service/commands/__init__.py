"""One module per ``ledger`` subcommand; each exposes ``register(subparsers)``.

A command's handler returns the process exit code. Usage errors exit 2 with a message that names
the offending option.
"""
