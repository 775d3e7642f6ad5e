"""The leader drives the worker in lockstep. At this root, what drives a generation (batch,
generate, run, speculative drafting, the bring-up); below it, the protocol (protocol/: the
commands, a rank's table, the leader's and the worker's sides), the KV caches (caches/) and
how tokens are drawn (sampling/)."""
