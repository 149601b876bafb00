"""`python -m kvpool ...` is the `kvpool` command."""

from kvpool.cli.main import entry

entry()
