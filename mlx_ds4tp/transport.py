"""The transport between the ranks: control channel, hello, the RDMA device, and the
exchange the collectives run; a mesh of N ranks is one such pair per two ranks (form_mesh).
This module is the public face of the transport package,
``link/``, where each idea lives in its own module (docs/architecture.md's module map names them).

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
    VERBS_LIBRARY_ENV,
    LinkSettings,
    PairAddress,
    default_tcp_spin_us,
    default_timeout,
    pair_address,
    tcp_spin_us,
    verbs_library,
)
from .link.connection import Pair
from .link.control import ControlChannel, decode_frame_header, dial, listen_socket, set_kernel_timeout
from .link.door import Door
from .link.exchange import raw_floor
from .link.fingerprint import model_fingerprint
from .link.handshake import connect
from .link.hello import Hello, ModelIdentity, auth_proof, check_hello, choose_transport
from .link.mesh import Mesh, form_mesh
from .link.native import load_verbs
from .link.rdma import UCSIM, RdmaDevice, rdma_probe
from .link.wire import (
    DATA_HELLO,
    DATA_MAGIC,
    FINGERPRINT_SUMMARY,
    FRAME_HEADER,
    FRAME_MAX_BYTES,
    GATE_MAX_BYTES,
    HELLO_FIXED,
    MAGIC,
    MAX_REASON_BYTES,
    PROTOCOL_VERSION,
    TRANSPORT_CODES,
    WARM_WR_ID,
    WORKER,
    FrameType,
)

__all__ = [
    # configuration
    "LinkSettings", "PairAddress", "pair_address", "default_timeout", "tcp_spin_us", "default_tcp_spin_us",
    "verbs_library", "VERBS_LIBRARY_ENV",
    # connection
    "Pair", "connect", "Mesh", "form_mesh", "Door",
    "ControlChannel", "decode_frame_header", "listen_socket", "dial", "set_kernel_timeout",
    # hello
    "Hello", "ModelIdentity", "check_hello", "choose_transport", "auth_proof", "model_fingerprint",
    # exchange and device
    "raw_floor", "RdmaDevice", "rdma_probe", "load_verbs", "UCSIM",
    # wire
    "FrameType", "FRAME_HEADER", "FRAME_MAX_BYTES", "DATA_HELLO", "HELLO_FIXED", "FINGERPRINT_SUMMARY", "MAGIC",
    "DATA_MAGIC", "WARM_WR_ID", "PROTOCOL_VERSION", "GATE_MAX_BYTES", "MAX_REASON_BYTES", "TRANSPORT_CODES",
    "WORKER",
    # errors
    "TransportError", "PeerClosedError", "TransportTimeoutError", "FrameError",
    "HelloMismatchError", "DesyncError", "RdmaUnavailableError", "RdmaError",
    "AuthenticationError",
]
