"""ZeroMQ CURVE on the control plane: only holders of the token connect at all, and no one
can read or alter requests, replies or announcements on the way.

With a token set (`TENSORHUB_TOKEN`), both of the coordinator's sockets (requests and the
version announcements) are CURVE servers, and a client proves the token in the handshake:
its keypair is derived from the token, and the coordinator's ZAP handler admits that public
key only. A party without the token never completes a handshake, so it can neither send a
request (libzmq drops it before a byte reaches Python) nor hear an announcement (which says
where every holder's memory is). The coordinator's own keypair is derived from the token
too, unless `tensorhub keygen` made one (`--curve-secret-file`): then clients pin its public
key, and a party that stole the token still cannot pose as the coordinator.

Without a token, an explicit keypair encrypts the traffic but admits any client that knows
the (public) server key. The data plane (NIXL, the zmq fallback transport) is not covered
here: see `core/transport/grants.py` and the README's Security section.

Keys are 40-character Z85 text, as libzmq prints them. `tensorhub keygen` writes a pair:
`NAME.key` (public: give it to every client) and `NAME.key_secret` (the coordinator's only,
mode 0600).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import zmq
from zmq.utils import z85

from tensorhub import settings
from tensorhub.core.errors import TensorHubError

KEY_CHARS = 40  # a 32-byte key in Z85, as libzmq reads and prints it


class CurveKeyError(TensorHubError):
    """A CURVE key is missing, malformed, or libzmq was built without CURVE."""

    code = "bad_key"


def available() -> bool:
    return bool(zmq.has("curve"))


def _require() -> None:
    if not available():
        raise CurveKeyError("this libzmq was built without CURVE (zmq.has('curve') is False)")


def check_key(key: str, what: str = "key") -> str:
    """The key, stripped, if it is 40 characters of Z85 (32 bytes); else a clear error."""
    key = key.strip()
    try:
        ok = len(key) == KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CurveKeyError(f"{what} is not a CURVE key ({KEY_CHARS} Z85 characters): "
                            f"{key[:12]!r}... ({len(key)} characters)")
    return key


def read_key(path: str | os.PathLike, what: str = "key file") -> str:
    """A key from a file written by `tensorhub keygen` (lines starting with # are comments)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CurveKeyError(f"cannot read {what} {path}: {exc}") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return check_key(lines[0] if lines else "", f"{what} {path}")


def generate_keypair() -> tuple[str, str]:
    """(public, secret), both Z85 text."""
    _require()
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def public_key_of(secret: str) -> str:
    _require()
    return zmq.curve_public(check_key(secret, "secret key").encode()).decode()


def write_keypair(directory: str | os.PathLike, name: str = "coordinator",
                  force: bool = False) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (0600) into `directory`; never overwrite a secret
    unless `force` (clients pinned to its public key would all be locked out)."""
    public, secret = generate_keypair()
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    if secret_path.exists() and not force:
        raise CurveKeyError(f"{secret_path} exists; pass --force to replace it (every client "
                            f"must then get the new public key)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(secret_path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(f"# TensorHub coordinator CURVE secret key: keep private\n{secret}\n")
    public_path.write_text(f"# TensorHub coordinator CURVE public key: give to clients\n"
                           f"{public}\n")
    return public_path, secret_path


def server_secret_from_env() -> str | None:
    """The coordinator's secret key from the file named by TENSORHUB_CURVE_SECRET_FILE."""
    path = settings.CURVE_SECRET_FILE.get()
    return read_key(path, "CURVE secret key file") if path else None


def server_key_from_env() -> str | None:
    """The coordinator's public key for clients: TENSORHUB_CURVE_SERVER_KEY, or the file
    TENSORHUB_CURVE_SERVER_KEY_FILE. None: plain (unencrypted) connections."""
    key = settings.CURVE_SERVER_KEY.get()
    if key:
        return check_key(key, settings.CURVE_SERVER_KEY.name)
    path = settings.CURVE_SERVER_KEY_FILE.get()
    return read_key(path, "CURVE server key file") if path else None


def secure_server(sock: zmq.Socket, secret: str) -> None:
    """Make a (not yet bound) socket a CURVE server with the coordinator's secret key."""
    _require()
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, check_key(secret, "secret key").encode())


def _derived_secret(token: str, purpose: bytes) -> str:
    """A CURVE secret key (any 32 bytes are one) derived from the token for `purpose`."""
    digest = hashlib.blake2b(token.encode(), digest_size=32, person=purpose).digest()
    return z85.encode(digest).decode()


def token_server_secret(token: str) -> str:
    """The coordinator's secret key when no keypair was given: derived from the token."""
    return _derived_secret(token, b"tensorhub-server")


def token_server_key(token: str) -> str:
    """The public key of `token_server_secret`: what a token holder pins."""
    return public_key_of(token_server_secret(token))


def token_client_keypair(token: str) -> tuple[str, str]:
    """(public, secret): the keypair every token holder connects with; the coordinator
    admits its public key only (`TokenGate`)."""
    secret = _derived_secret(token, b"tensorhub-client")
    return public_key_of(secret), secret


def secure_client(sock: zmq.Socket, server_key: str,
                  keypair: tuple[str, str] | None = None) -> None:
    """Make a (not yet connected) socket a CURVE client of the server with `server_key`,
    with `keypair` (public, secret), or a fresh one (a server that admits any client)."""
    _require()
    public, secret = (k.encode() for k in keypair) if keypair else zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, check_key(server_key, "server key").encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class TokenGate:
    """The coordinator's ZAP handler: a CURVE handshake completes only for a client whose
    public key is the one derived from the token. Runs a thread of pyzmq's authenticator on
    the coordinator's own ZeroMQ context (one handler per context)."""

    def __init__(self, context: zmq.Context, token: str):
        from zmq.auth.thread import ThreadAuthenticator  # (imports asyncio: only when used)

        self._admitted = token_client_keypair(token)[0].encode()
        self.refused = 0  # handshakes refused (a wrong token, or none)
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = hmac.compare_digest(client_key, self._admitted)
        self.refused += not ok
        return ok

    def stop(self) -> None:
        self._auth.stop()
