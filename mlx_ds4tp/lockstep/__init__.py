"""The leader drives the worker in lockstep: sessions, prompt sync, decode steps."""
