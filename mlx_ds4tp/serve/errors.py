"""The errors of `ds4tp serve`'s HTTP face: what a request is answered with when it cannot be
served, the client that left before its answer, and the 503 of a pair that is down."""

from __future__ import annotations

from typing import Any, Dict, Optional

# The code of the error a request gets when its own generation failed (its sampling or grammar
# on a token), the server going on: a streamed answer ends with it as an event, first token too.
GENERATION_FAILED = "generation_failed"


class PairUnavailableError(RuntimeError):
    """`ds4tp serve`: the pair is down (worker dead, link dropped): the server answers 503."""


class ClientGoneError(Exception):
    """`ds4tp serve`: the client closed its connection before its answer was complete."""


class ApiError(Exception):
    """`ds4tp serve`: an HTTP error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def unavailable(reason: str) -> ApiError:
    """The 503 every request gets once the group is down."""
    return ApiError(503, f"the group of machines is down ({reason}); start the stopped rank's `ds4tp "
                    "serve` again (the leader (rank 0) takes it back, no restart needed) and retry",
                    None, "pair_unavailable", "server_error")
