"""The transport between the two ranks: control channel, hello, the RDMA
device, and the exchange the collectives run. This module is the public face of the transport package,
``link/``, where each idea lives in its own module, in layer order (each
imports only those above it):

- ``wire``: every frame type, struct layout, magic and size bound;
- ``fingerprint``: a model directory's fingerprint, compared at the hello
  (its safetensors headers read by ``checkpoint/header.py``);
- ``control``: socket helpers, listen / dial / accept, ``ControlChannel``;
- ``hello``: ``ModelIdentity``, ``Hello``, the checks on it, the transport
  choice, the shared-secret proofs;
- ``config``: ``LinkSettings``, whose ``resolved()`` reads every ``DS4_TP_*`` knob once, and
  ``pair_address``, the one check of the role/listen/coordinator triple;
- ``native``: the compiled ``_verbs`` module;
- ``exchange``: the exchange the MLX backend calls (csrc/exchange.c), from
  Python on a group's link, and the raw socket floor;
- ``rdma``: the RDMA device (slab, queue pair, raw work requests);
- ``joined``: the ranks after the hello, before any gate (seen by connect and
  the bring-up only);
- ``bringup``: the RDMA bring-up (barriers, warm-up, re-creation);
- ``advice``: what a rank without RDMA tells its user, for its platform;
- ``pair``: ``Pair``, complete: its queue pair proven or TCP chosen;
- ``handshake``: ``connect()``, which makes one.

The transport never sees MLX: an exchange moves bytes between buffers the caller owns.
"""

from __future__ import annotations

from .errors import (
    AuthenticationError,
    DesyncError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    RdmaError,
    RdmaUnavailableError,
    TransportError,
    TransportTimeoutError,
)
from .link.config import (
    DEFAULT_HELLO_TIMEOUT_SEC,
    DEFAULT_TIMEOUT_SEC,
    MAX_TCP_SPIN_US,
    VERBS_LIBRARY_ENV,
    LinkSettings,
    PairAddress,
    default_hello_timeout,
    default_tcp_spin_us,
    default_timeout,
    pair_address,
    secret_bytes,
    tcp_spin_us,
    verbs_library,
)
from .link.control import (
    ControlChannel,
    accept,
    decode_frame_header,
    dial,
    listen_socket,
    recv_exact_into,
    send_all,
    set_kernel_timeout,
    tune_socket,
)
from .link.exchange import Exchange, raw_floor
from .link.fingerprint import Fingerprint, first_difference, model_fingerprint, summary_label
from .link.handshake import connect
from .link.hello import (
    Hello,
    ModelIdentity,
    auth_proof,
    authenticate,
    check_hello,
    choose_transport,
    data_proof,
)
from .link.native import load_verbs
from .link.pair import Pair
from .link.rdma import UCSIM, RdmaDevice, rdma_probe
from .link.wire import (
    DATA_HELLO,
    DATA_MAGIC,
    FINGERPRINT_SUMMARY,
    FRAME_HEADER,
    FRAME_MAX_BYTES,
    GATE_MAX_BYTES,
    HELLO_FIXED,
    LEADER,
    MAGIC,
    MAX_REASON_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    RDMA_INFO,
    RDMA_MAX_MSG,
    ROLE_NAMES,
    TRANSPORT_CODES,
    TRANSPORT_NAMES,
    WARM_WR_ID,
    WORKER,
    FrameType,
)

__all__ = [
    # configuration
    "LinkSettings", "PairAddress", "pair_address", "default_timeout", "default_hello_timeout", "tcp_spin_us",
    "default_tcp_spin_us",
    "secret_bytes", "verbs_library", "VERBS_LIBRARY_ENV", "DEFAULT_TIMEOUT_SEC",
    "DEFAULT_HELLO_TIMEOUT_SEC", "MAX_TCP_SPIN_US",
    # connection
    "Pair", "connect", "ControlChannel", "decode_frame_header", "listen_socket", "dial", "accept",
    "tune_socket", "set_kernel_timeout", "recv_exact_into", "send_all",
    # hello
    "Hello", "ModelIdentity", "check_hello", "choose_transport", "auth_proof", "authenticate",
    "data_proof", "Fingerprint", "model_fingerprint", "first_difference", "summary_label",
    # exchange and device
    "Exchange", "raw_floor", "RdmaDevice", "rdma_probe", "load_verbs", "UCSIM",
    # wire
    "FrameType", "FRAME_HEADER", "FRAME_MAX_BYTES", "DATA_HELLO",
    "HELLO_FIXED", "FINGERPRINT_SUMMARY", "RDMA_INFO", "MAGIC", "DATA_MAGIC", "WARM_WR_ID",
    "PROTOCOL_VERSION", "GATE_MAX_BYTES", "RDMA_MAX_MSG", "MAX_REASON_BYTES",
    "NONCE_BYTES", "TRANSPORT_CODES", "TRANSPORT_NAMES", "LEADER", "WORKER", "ROLE_NAMES",
    # errors
    "TransportError", "PeerClosedError", "TransportTimeoutError", "FrameError",
    "HelloMismatchError", "DesyncError", "RdmaUnavailableError", "RdmaError",
    "AuthenticationError",
]
