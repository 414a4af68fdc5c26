"""Exceptions with a code a caller can act on; the code matches `ErrorReply.code` on the wire."""

from __future__ import annotations


class TensorHubError(RuntimeError):
    """Base of every error TensorHub raises on purpose."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.retry_after = retry_after


class CoordinatorError(TensorHubError):
    """The coordinator answered with a typed error (see `.code`)."""


class CoordinatorUnavailable(TensorHubError):
    """No reply from the coordinator within the timeout."""

    code = "unavailable"


class TransferError(TensorHubError):
    """A read from a holder failed or timed out; `.source` names the holder."""

    code = "transfer_failed"

    def __init__(self, message: str, source: str | None = None):
        super().__init__(message)
        self.source = source


class IntegrityError(TensorHubError):
    """Bytes arrived but do not match the version's checksums."""

    code = "checksum_mismatch"
    items: tuple[int, ...] | list[int] = ()  # the items that failed, where known


class LayoutError(TensorHubError):
    """Local tensors do not match the layout (names, dtypes, shapes)."""

    code = "layout_mismatch"


class AddressError(TensorHubError, ValueError):
    """A coordinator address that is not a ZeroMQ address (`tcp://HOST:PORT`)."""

    code = "bad_address"
