"""The command line: one module per command, shared flags in flags.py; `python -m flowjam` dispatches here."""
