"""The KV caches a rank holds for the lockstep: sessions' caches before they decode, stored
prompt caches (in memory, the leader's index of them, on disk), mlx-lm's quantized cache
batched, and the KV budget a machine's memory allows."""
