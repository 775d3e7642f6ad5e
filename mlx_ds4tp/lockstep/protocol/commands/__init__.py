"""The lockstep commands, each defined once: its frame type, payload layout, packing, unpacking
and application (lockstep.protocol.commands.base says what a command is). The frame numbers and the
transport's byte bound of each are link/wire.py's (the transport checks a bound before it reads
a frame); everything else about a command is its class here, so a new command is one class in
one of these modules (and its number in the wire's table).

  lifecycle  SESSION_CREATE, REWIND, SESSION_DESTROY, INVALIDATE
  steps      PREFILL_BATCH, EVAL_BATCH, VERIFY_BATCH, COMMIT_BATCH
  sampler    SAMPLER
  stored     DISK_SAVE, DISK_LOAD
  queries    HASH, KV_ROOM
(STOP, which carries nothing, ends the worker's loop in lockstep.protocol.sessions.)
"""

from .base import COMMANDS, Command, check_tokens
from .lifecycle import Create, Destroy, Invalidate, Rewind
from .queries import Hash, KvRoom, check_in_step
from .sampler import Sampler
from .steps import EVAL_PENDING, MAX_BATCH_ROWS, CommitBatch, EvalBatch, PrefillBatch, VerifyBatch, pad_rows
from .stored import DiskLoad, DiskSave

__all__ = ["COMMANDS", "Command", "CommitBatch", "Create", "Destroy", "DiskLoad", "DiskSave", "EVAL_PENDING",
           "EvalBatch", "Hash", "Invalidate", "KvRoom", "MAX_BATCH_ROWS",
           "PrefillBatch", "Rewind", "Sampler", "VerifyBatch", "check_in_step", "check_tokens", "pad_rows"]
