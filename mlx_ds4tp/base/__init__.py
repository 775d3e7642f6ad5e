"""Used by every layer: the one writer of diagnostics, and SIGTERM taken as Ctrl-C."""
