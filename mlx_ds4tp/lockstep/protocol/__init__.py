"""The lockstep protocol: the commands (one class each), one rank's table they change, its
decode batch, and the leader's and the worker's sides (sessions)."""
