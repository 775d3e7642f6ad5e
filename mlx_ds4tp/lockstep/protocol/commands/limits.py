"""How much one lockstep command carries at most: the counts each command's unpack checks and
its frame's bound (its class's `bound`, which the transport checks before reading a frame)
is sized from. The flags and requests that feed a command are checked against these too
(cli/serve.py, serve/engine/prefill.py, serve/dialects/structured.py), so a command never
outgrows them."""

# Tokens in one frame: a PREFILL_BATCH's rows together, a SAMPLER's context, a DISK_SAVE's tokens.
MAX_TOKENS_PER_FRAME = 1 << 20
# One PREFILL_BATCH: at most this many sessions, all their tokens together at most
# MAX_TOKENS_PER_FRAME (the padded forward is rows x the longest row's tokens).
MAX_PREFILL_ROWS = 256
# Rows of one decode step (EVAL_BATCH, VERIFY_BATCH, COMMIT_BATCH).
MAX_BATCH_ROWS = 1024
# A VERIFY_BATCH row: the input token and at most 64 drafts (--num-draft-tokens <= 64).
MAX_VERIFY_WIDTH = 65
# A SAMPLER's sampling options (JSON): at most 64 KiB.
MAX_SAMPLER_OPTIONS_BYTES = 64 * 1024
