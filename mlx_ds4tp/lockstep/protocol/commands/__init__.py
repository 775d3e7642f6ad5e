"""The lockstep commands, each defined once: its frame type, the bound of its payload, its
layout, packing, unpacking and application (lockstep.protocol.commands.base says what a
command is). Only the frame numbers are link/wire.py's; a command registers its bound there as
it is defined (the transport checks a bound before it reads a frame). A new command is one
class in one of these modules and its number in FrameType; the leader sends it with
LeaderSessions.send (a query: .ask), both ranks apply it with SessionTable.apply.

  lifecycle  SESSION_CREATE, REWIND, SESSION_DESTROY, INVALIDATE
  steps      PREFILL_BATCH, EVAL_BATCH, VERIFY_BATCH, COMMIT_BATCH
  sampler    SAMPLER
  stored     DISK_SAVE, DISK_LOAD
  queries    HASH, KV_ROOM
  rank_stats RANK_STATS (the cluster page's figures of a worker)
  limits     what one command carries at most
(STOP, which carries nothing, ends the worker's loop in lockstep.protocol.sessions.)
"""

from .base import COMMANDS, Command, check_tokens
from .lifecycle import Create, Destroy, Invalidate, Rewind
from .limits import MAX_BATCH_ROWS
from .queries import Hash, KvRoom, check_in_step
from .rank_stats import RankStats, rank_figures
from .sampler import Sampler
from .steps import EVAL_PENDING, CommitBatch, EvalBatch, PrefillBatch, VerifyBatch, pad_rows
from .stored import DiskLoad, DiskSave

__all__ = ["COMMANDS", "Command", "CommitBatch", "Create", "Destroy", "DiskLoad", "DiskSave", "EVAL_PENDING",
           "EvalBatch", "Hash", "Invalidate", "KvRoom", "MAX_BATCH_ROWS",
           "PrefillBatch", "RankStats", "Rewind", "Sampler", "VerifyBatch", "check_in_step", "check_tokens",
           "pad_rows", "rank_figures"]
