"""Used by every layer: the one writer of diagnostics."""
