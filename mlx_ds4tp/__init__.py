"""mlx_ds4tp: one MLX model split across 2 to 8 Macs joined by Thunderbolt, one rank each
(an even share, or --split's: by measured speed and memory, or A:B[:C...]).

    import mlx_ds4tp as tp
    g = tp.init(role="leader", listen=("10.99.0.1", 9911))       # rank 0
    g = tp.init(role="worker", coordinator=("10.99.0.1", 9911))  # rank 1
    y = tp.all_sum(x, group=g)       # or tp.all_sum(x): the group init returned last

Over N ranks the leader passes size=N and each worker dials it as above (docs/nranks.md).
"""

from .errors import (
    AuthenticationError,
    DesyncError,
    FrameError,
    GroupNotFoundError,
    HelloMismatchError,
    LockstepDivergenceError,
    MissingCableError,
    PeerClosedError,
    RdmaError,
    RdmaUnavailableError,
    RegroupedError,
    TransportError,
    TransportTimeoutError,
    WarmupFailedError,
)
from .gate_ops import (
    Group,
    all_gather,
    all_max,
    all_min,
    all_sum,
    init,
    reconnect,
    recv,
    recv_like,
    send,
    sum_scatter,
)

# `ds4tp serve`'s errors live with the server; the package still names them.
from .serve.errors import ApiError, ClientGoneError, PairUnavailableError
from .transport import ModelIdentity, model_fingerprint

__version__ = "0.1.0"

__all__ = [
    "init",
    "reconnect",
    "all_sum",
    "all_gather",
    "all_max",
    "all_min",
    "sum_scatter",
    "send",
    "recv",
    "recv_like",
    "Group",
    "ModelIdentity",
    "model_fingerprint",
    "TransportError",
    "PeerClosedError",
    "TransportTimeoutError",
    "FrameError",
    "HelloMismatchError",
    "DesyncError",
    "RdmaUnavailableError",
    "MissingCableError",
    "RegroupedError",
    "RdmaError",
    "AuthenticationError",
    "GroupNotFoundError",
    "WarmupFailedError",
    "PairUnavailableError",
    "ApiError",
    "ClientGoneError",
    "LockstepDivergenceError",
]
