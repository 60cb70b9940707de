"""Credentials of ``opencomposer serve`` (``inference/server/auth.py``), through the real CLI and real
HTTP on loopback: without a token, a start-up warning saying who can reach the endpoints that
change state; with one (``OPENCOMPOSER_SERVE_TOKEN``, not in argv), 401 without it or with a
wrong one on ``/admin/*`` and ``/v1/feedback``, 200 with it; feedback naming an unsigned,
forged or another caller's session refused with 403."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from conftest import run_cli

from opencomposer.inference.server.auth import (
    SIGNED_HEADER,
    Refused,
    check_bearer,
    open_warning,
)
from opencomposer.inference.server.process import serve_process
from opencomposer.inference.server.session_log import read_window
from opencomposer.realtime.deploy import ServerClient, ServerRefused

TOKEN = "t0ken-for-tests-7d1e"
MSG = [{"role": "user", "content": "Fix the bug in utils.py"}]


def args(tmp) -> tuple[str, ...]:
    return ("--model", "tiny-random", "--port", "0", "--max-num-seqs", "2", "--log-dir", str(tmp / "logs"))


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("open")
    with open(tmp / "stderr.txt", "w") as err, serve_process(*args(tmp), stderr=err, stop_timeout=20) as ready:
        yield ready["serving"].removesuffix("/v1"), tmp


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("locked")
    env = {**os.environ, "OPENCOMPOSER_SERVE_TOKEN": TOKEN}  # the token is not in argv
    with open(tmp / "stderr.txt", "w") as err, serve_process(*args(tmp), env=env, stderr=err,
                                                             stop_timeout=20) as ready:
        yield ready["serving"].removesuffix("/v1"), tmp


def chat(base: str, user: str | None = None, **kw) -> httpx.Response:
    body = {"model": "tiny-random", "messages": MSG, "max_tokens": 4, "temperature": 0.0, **kw}
    if user:
        body["user"] = user
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def feedback(base: str, session_id: str, token: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(base + "/v1/feedback", json={"session_id": session_id, "kind": "edit_kept", **kw},
                      headers=headers, timeout=30)


def test_without_a_token_serve_warns_who_can_reach_the_open_endpoints(open_server):
    base, tmp = open_server
    err = (tmp / "stderr.txt").read_text()
    assert "no --api-token / OPENCOMPOSER_SERVE_TOKEN" in err, err
    assert "POST /v1/feedback and /admin/*" in err and "every process on this machine" in err
    port = re.search(r"listening on 127\.0\.0\.1:(\d+) only", err)
    assert port and base.endswith(f":{port.group(1)}")  # the real port, not --port 0
    assert httpx.get(base + "/admin/arms", timeout=30).status_code == 200  # loopback: today's rule


def test_the_warning_names_everyone_when_bound_beyond_loopback_and_admin_stays_local():
    wide = open_warning(None, "0.0.0.0", 8000)
    assert "POST /v1/feedback is open to everyone who can reach 0.0.0.0:8000" in wide
    assert "/admin/* (weight hot-swap) to every process on this machine" in wide
    assert open_warning("t", "0.0.0.0", 8000) is None
    with pytest.raises(Refused, match="loopback clients only; got a call from 10.0.0.5") as e:
        check_bearer("/admin/weights", {}, "10.0.0.5", None)
    assert e.value.status == 403
    check_bearer("/v1/feedback", {}, "10.0.0.5", None)  # feedback: open, but needs a signed session


def test_feedback_needs_the_session_id_this_server_signed(open_server):
    base, tmp = open_server
    r = chat(base, "alice-5b2c")
    signed = r.headers[SIGNED_HEADER]
    assert re.fullmatch(r"alice-5b2c\.[0-9a-f]{32}", signed)
    streamed = httpx.post(base + "/v1/chat/completions", json={"model": "tiny-random", "messages": MSG,
                          "max_tokens": 2, "stream": True}, headers={"X-Session-Id": "alice-5b2c"}, timeout=60)
    assert streamed.headers[SIGNED_HEADER] == signed  # same session, same signature, streaming or not
    assert SIGNED_HEADER not in chat(base).headers  # no session named: nothing to sign
    assert SIGNED_HEADER not in chat(base, "jörg\r\nX-Evil: 1").headers  # not printable ASCII: never a header

    ok = feedback(base, signed, completion_id=f"{r.json()['id']}:0")
    assert ok.status_code == 200 and ok.json()["session_id"] == "alice-5b2c", ok.text

    bob = chat(base, "bob-91ad").headers[SIGNED_HEADER]
    bob_sig = bob.rsplit(".", 1)[1]
    for sid, says in (("alice-5b2c", "is not signed; send the value of the X-Signed-Session-Id header"),
                      ("alice-5b2c." + "0" * 32, "is not this server's"),
                      (f"alice-5b2c.{bob_sig}", "is not this server's"),  # another caller's signature
                      (signed[:-1] + ("1" if signed[-1] != "1" else "2"), "is not this server's"),
                      (f"carol-0000.{bob_sig}", "is not this server's")):  # a session never served
        refused = feedback(base, sid)
        assert refused.status_code == 403, (sid, refused.text)
        err = refused.json()["error"]
        assert says in err["message"] and err["param"] == "session_id" and err["code"] == "session_not_signed"

    w = read_window(tmp / "logs")
    kept = [f for f in w.feedback if f["kind"] == "edit_kept"]
    assert [f["session_id"] for f in kept] == ["alice-5b2c"]  # logged under the plain id; refusals not at all
    assert kept[0]["completion_id"] in {c["id"] for c in w.completions if c["session_id"] == "alice-5b2c"}


def test_with_a_token_state_changing_endpoints_need_it(locked_server):
    base, tmp = locked_server
    assert "warning" not in (tmp / "stderr.txt").read_text()
    signed = chat(base, "dana-77f0").headers[SIGNED_HEADER]  # chat itself needs no token
    calls = (("GET", "/admin/arms", None), ("POST", "/admin/weights", {"path": str(tmp / "none")}),
             ("POST", "/v1/feedback", {"session_id": signed, "kind": "edit_kept"}))
    for method, path, body in calls:
        for headers, says in (({}, "needs the header 'Authorization: Bearer <token>'"),
                              ({"Authorization": "Bearer wrong"}, "does not carry the server's token"),
                              ({"Authorization": TOKEN}, "does not carry the server's token")):
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert says in r.json()["error"]["message"] and "OPENCOMPOSER_SERVE_TOKEN" in r.json()["error"]["message"]
            assert r.headers["WWW-Authenticate"] == "Bearer"
    assert feedback(base, signed, TOKEN).status_code == 200
    assert feedback(base, "dana-77f0", TOKEN).status_code == 403  # the token does not replace the signature
    client = ServerClient(base, token=TOKEN)  # the real-time loop's client
    assert "a" in client.arms()["arms"]
    with pytest.raises(ServerRefused, match="HTTP 400: path: .*no \\*.safetensors"):  # past auth: the body is read
        client.swap(tmp / "none")
    assert [f["session_id"] for f in read_window(tmp / "logs").feedback] == ["dana-77f0"]


def test_simulated_users_send_feedback_with_the_token_and_the_signed_session(locked_server):
    """``realtime users --token``: the harness's chat turns bring back the signed session id,
    and the users' feedback (bearer token + signed id) is taken and logged under the plain id."""
    base, tmp = locked_server
    r = run_cli("realtime", "users", "--base-url", base + "/v1", "--model", "tiny-random", "--suite", "smoke",
                "--sessions", "1", "--max-turns", "1", "--max-tokens", "8", "--seed", "3", "--token", TOKEN,
                timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sim = json.loads(r.stdout.strip().splitlines()[-1])
    assert sim["errors"] == 0 and sum(sim["events"].values()) >= 1, sim  # tiny-random fails: the user replies
    w = read_window(tmp / "logs")
    served = {c["session_id"] for c in w.completions if (c["session_id"] or "").startswith("sim-")}
    sent = [f for f in w.feedback if (f["session_id"] or "").startswith("sim-")]
    assert len(served) == 1 and len(sent) == sum(sim["events"].values())
    assert {f["session_id"] for f in sent} == served
