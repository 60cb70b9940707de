"""Who may change the state of ``opencomposer serve``: the bearer token and signed session ids.

    OPENCOMPOSER_SERVE_TOKEN=... opencomposer serve --model smollm2-135m --log-dir runs/serve-logs
    curl -H "Authorization: Bearer $OPENCOMPOSER_SERVE_TOKEN" http://127.0.0.1:8000/admin/arms

Two rules, both applied by ``front.FrontDoor``:

* **The token.** The endpoints that change state (``/admin/*``: weight hot-swap; ``POST
  /v1/feedback``: rewards the real-time loop trains on) need ``Authorization: Bearer TOKEN``
  when ``serve --api-token`` / ``OPENCOMPOSER_SERVE_TOKEN`` is set; a missing or wrong
  token is a 401. The comparison is constant-time (``hmac.compare_digest``). Without a token,
  ``/admin/*`` answers loopback clients only, ``/v1/feedback`` anyone who can reach the port,
  and ``serve`` says so at start (``open_warning``).
* **Signed sessions.** Every chat completion that names a session (``X-Session-Id`` or
  ``user``) comes back with the header ``X-Signed-Session-Id: <session id>.<signature>``,
  the signature being HMAC-SHA256 of the session id under a secret drawn when the server
  starts (first 32 hex digits; ids of printable ASCII only, the rest cannot go in a header).
  A feedback event must give that value as its ``session_id``; an unsigned, forged or
  altered id, or one signed by an earlier server process, is a 403. So feedback can only name a session the caller was served in: the signature is what the
  server told that caller, and nobody can compute it without the secret.

What signing does not stop: session ids are chosen by clients, so whoever knows (or
guesses) another session's id can send a chat request in it and be given its signature.
Clients should use random, unguessable session ids (e.g. 128 bits from ``secrets``).

Test: ``pytest tests/integration/test_serve_auth.py tests/unit/inference/test_front.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

SIGNED_HEADER = "X-Signed-Session-Id"
TOKEN_ENV = "OPENCOMPOSER_SERVE_TOKEN"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
_SIG_HEX = 32  # 128 bits of HMAC-SHA256: out of reach of guessing


class Refused(Exception):
    """A request without the credential it needs; ``status`` is 401 or 403, the message says what is expected."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


def changes_state(path: str) -> bool:
    """The paths that need the token (when one is set): admin calls and feedback."""
    return path == "/v1/feedback" or path.startswith("/admin/")


def check_bearer(path: str, headers: Mapping[str, str], client_host: str, token: str | None) -> None:
    """Raise ``Refused`` unless this caller may use ``path`` (``headers`` lower-cased)."""
    if token:
        sent = headers.get("authorization", "")
        scheme, _, value = sent.partition(" ")
        if not sent:
            raise Refused(401, f"{path} changes server state and needs the header 'Authorization: Bearer <token>' "
                          f"with the token the server was started with (serve --api-token or {TOKEN_ENV}); "
                          f"none was sent", "missing_token")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise Refused(401, f"{path}: the 'Authorization' header does not carry the server's token; expected "
                          f"'Authorization: Bearer <token>' with the token of serve --api-token or {TOKEN_ENV}",
                          "invalid_token")
        return
    if path.startswith("/admin/") and client_host not in LOOPBACK:
        raise Refused(403, f"{path}: this server has no token (serve --api-token / {TOKEN_ENV}), so admin calls "
                      f"are taken from loopback clients only; got a call from {client_host or 'an unknown address'}",
                      "loopback_only")


class SessionSigner:
    """Signs the session ids the server served, and checks the ones feedback names."""

    def __init__(self, secret: bytes | None = None):
        self._key = secret if secret is not None else secrets.token_bytes(32)

    def _mac(self, sid: str) -> str:
        return hmac.new(self._key, sid.encode(), hashlib.sha256).hexdigest()[:_SIG_HEX]

    def sign(self, sid: str) -> str:
        return f"{sid}.{self._mac(sid)}"

    def verify(self, signed: str) -> str:
        """The session id inside ``signed``; ``Refused`` (403) if this server did not sign it."""
        sid, dot, sig = signed.rpartition(".")
        if not dot or not sid or len(sig) != _SIG_HEX:
            raise Refused(403, f"session_id: {signed[:80]!r} is not signed; send the value of the "
                          f"{SIGNED_HEADER} header this server returned with the session's chat completion",
                          "session_not_signed")
        if not hmac.compare_digest(sig, self._mac(sid)):
            raise Refused(403, f"session_id: the signature of session {sid[:80]!r} is not this server's (forged, "
                          f"altered, or signed before the server restarted); send the {SIGNED_HEADER} header of "
                          f"a chat completion this server returned in that session", "session_not_signed")
        return sid


def open_warning(token: str | None, host: str, port: int) -> str | None:
    """What ``serve`` prints at start when the state-changing endpoints have no token; None with one."""
    if token:
        return None
    if host in LOOPBACK:
        who = (f"POST /v1/feedback and /admin/* (weight hot-swap) are open to every process on this machine "
               f"(listening on {host}:{port} only)")
    else:
        who = (f"POST /v1/feedback is open to everyone who can reach {host}:{port}, and /admin/* (weight "
               f"hot-swap) to every process on this machine (loopback clients)")
    return (f"warning: no --api-token / {TOKEN_ENV}, so the endpoints that change state are open: {who}. "
            f"Feedback still needs a session id signed by this server ({SIGNED_HEADER}). "
            f"Set {TOKEN_ENV} to require 'Authorization: Bearer <token>'.")
