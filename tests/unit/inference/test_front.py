"""``opencomposer serve``'s front door with real tiny-random engines over real HTTP: session
logging, A/B routing by session, feedback validation, weight hot-swap and its auth."""

from __future__ import annotations

import time

import httpx
import pytest
from testkit.live_server import serve_in_thread
import torch

from opencomposer.inference.server.auth import SIGNED_HEADER
from opencomposer.inference.server.front import arm_for, build_front
from opencomposer.inference.server.app import ServeConfig
from opencomposer.inference.server.session_log import read_window
from opencomposer.realtime.deploy import ServerClient, ServerRefused, ServerUnreachable

MSG = [{"role": "user", "content": "Fix the bug in utils.py"}]


class Running:
    def __init__(self, cfg: ServeConfig):
        self.front = build_front(cfg)
        self.uv, self.thread, self.base = serve_in_thread(self.front)

    def chat(self, session: str | None = None, header: bool = False, **kw) -> dict:
        body = {"model": "tiny-random", "messages": MSG, "max_tokens": 6, "temperature": 0.0, "logprobs": True, **kw}
        headers = {}
        if session and header:
            headers["X-Session-Id"] = session
        elif session:
            body["user"] = session
        r = httpx.post(self.base + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return {"sse": r.text} if kw.get("stream") else r.json()

    def signed(self, session: str) -> str:
        """The session id as this server signs it: what a feedback event for it must send."""
        r = httpx.post(self.base + "/v1/chat/completions", json={"model": "tiny-random", "messages": MSG,
                       "max_tokens": 2, "user": session}, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers[SIGNED_HEADER]

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)
        self.front.stop()


def sessions_for(arm: str, fraction: float, n: int = 2) -> list[str]:
    return [s for s in (f"user-{i}" for i in range(200)) if arm_for(s, fraction) == arm][:n]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    s = Running(ServeConfig(model="tiny-random", ab_model="tiny-random", ab_fraction=0.5, log_dir=str(logs),
                            max_num_seqs=4, max_model_len=1024))
    s.logs = logs
    yield s
    s.close()


def test_split_is_deterministic_and_close_to_the_fraction():
    ids = [f"s{i}" for i in range(4000)]
    share = sum(arm_for(s, 0.2) == "b" for s in ids) / len(ids)
    assert 0.17 < share < 0.23
    assert [arm_for(s, 0.2) for s in ids[:50]] == [arm_for(s, 0.2) for s in ids[:50]]
    assert arm_for(None, 0.9) == "a" and arm_for("x", 0.0) == "a"


def test_every_completion_is_logged_with_its_session_arm_and_tokens(srv):
    a, b = sessions_for("a", 0.5)[0], sessions_for("b", 0.5)[0]
    ra = srv.chat(a)
    rb = srv.chat(b, header=True)
    srv.chat(a, stream=True, stream_options={"include_usage": True})
    srv.chat(None)
    w = read_window(srv.logs)
    assert not w.warnings
    by_session = {}
    for c in w.completions:
        by_session.setdefault(c["session_id"], []).append(c)
    assert [c["arm"] for c in by_session[a]] == ["a", "a"] and [c["stream"] for c in by_session[a]] == [False, True]
    assert by_session[b][0]["arm"] == "b" and by_session[None][0]["arm"] == "a"
    for rec, resp in ((by_session[a][0], ra), (by_session[b][0], rb)):
        assert len(rec["prompt_ids"]) == resp["usage"]["prompt_tokens"]
        assert len(rec["token_ids"]) == resp["usage"]["completion_tokens"] == len(rec["logprobs"])
        assert rec["logprobs"] == pytest.approx([t["logprob"] for t in resp["choices"][0]["logprobs"]["content"]])
        assert rec["messages"] == MSG and rec["checkpoint"] == "tiny-random" and rec["policy_version"] == 0
        assert rec["latency_s"] > 0 and rec["temperature"] == 0.0


def test_feedback_is_logged_and_bad_events_name_the_field(srv):
    signed = srv.signed("user-1")
    ok = httpx.post(srv.base + "/v1/feedback", json={"session_id": signed, "kind": "edit_kept", "diff": "+x"})
    assert ok.status_code == 200 and ok.json()["ok"] and ok.json()["session_id"] == "user-1"
    unsigned = httpx.post(srv.base + "/v1/feedback", json={"session_id": "user-1", "kind": "edit_kept"})
    assert unsigned.status_code == 403 and SIGNED_HEADER in unsigned.json()["error"]["message"]
    for body, field in (({"session_id": "s", "kind": "liked"}, "kind"),
                        ({"kind": "edit_kept"}, "session_id"),
                        ({"session_id": "s", "kind": "follow_up"}, "text"),
                        ({"session_id": "s", "kind": "edit_kept", "extra": 1}, "extra")):
        r = httpx.post(srv.base + "/v1/feedback", json=body)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
    kinds = [f["kind"] for f in read_window(srv.logs).feedback if f["session_id"] == "user-1"]
    assert kinds == ["edit_kept"]


def test_hot_swap_changes_what_one_arm_serves(srv, tmp_path):
    from opencomposer.models.registry import load_model

    model, tok = load_model("tiny-random")
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path / "ck")
    tok.save_pretrained(tmp_path / "ck")
    b = sessions_for("b", 0.5)[1]
    a = sessions_for("a", 0.5)[1]
    before_b, before_a = srv.chat(b), srv.chat(a)
    client = ServerClient(srv.base + "/v1")
    out = client.swap(tmp_path / "ck", arm="b", version=7)
    assert out["policy_version"] == 7 and out["checkpoint"] == str((tmp_path / "ck").resolve())
    arms = client.arms()["arms"]
    assert arms["b"]["policy_version"] == 7 and arms["a"]["policy_version"] == 0
    after_b, after_a = srv.chat(b), srv.chat(a)
    lp = lambda r: [t["logprob"] for t in r["choices"][0]["logprobs"]["content"]]
    assert lp(after_b) != pytest.approx(lp(before_b))  # new weights
    assert lp(after_a) == pytest.approx(lp(before_a))  # the other arm untouched
    rec = [c for c in read_window(srv.logs).completions if c["session_id"] == b][-1]
    assert rec["checkpoint"] == out["checkpoint"] and rec["policy_version"] == 7
    with pytest.raises(ServerRefused, match="path: .*no \\*.safetensors"):
        client.swap(tmp_path / "missing")
    with pytest.raises(ServerRefused, match="arm: 'c' is not served"):
        client.swap(tmp_path / "ck", arm="c")


def test_api_token_is_required_when_set(srv):
    signed = srv.signed("user-2")
    srv.front.api_token = "sekret"
    try:
        with pytest.raises(ServerRefused, match="HTTP 401: /admin/arms changes server state and needs"):
            ServerClient(srv.base).arms()
        with pytest.raises(ServerRefused, match="HTTP 401: /v1/feedback: the 'Authorization' header does not"):
            ServerClient(srv.base, token="wrong").feedback({"session_id": signed, "kind": "edit_kept"})
        assert "arms" in ServerClient(srv.base, token="sekret").arms()
        assert ServerClient(srv.base, token="sekret").feedback({"session_id": signed, "kind": "edit_kept"})["ok"]
    finally:
        srv.front.api_token = None


def test_an_unreachable_server_is_named():
    with pytest.raises(ServerUnreachable, match=r"server unreachable at http://127.0.0.1:9/admin/arms"):
        ServerClient("http://127.0.0.1:9/v1", timeout=5).arms()


def test_serve_follows_a_trainers_weight_store(tmp_path):
    """``serve --weights-from``: a trainer publishes deltas; arm a applies them in flight and
    then samples what an engine built from the trainer's weights samples."""
    from opencomposer.inference.engine.core import Engine, SamplingParams
    from opencomposer.models.registry import load_model
    from opencomposer.sync.publisher import WeightPublisher
    from opencomposer.sync.store import FileStore

    trainer, tok = load_model("tiny-random")
    pub = WeightPublisher(FileStore(tmp_path / "w"), dtype=torch.float32)
    pub.publish(trainer.state_dict(), 0)
    s = Running(ServeConfig(model="tiny-random", max_num_seqs=4, max_model_len=1024,
                            weights_from=str(tmp_path / "w"), weights_poll_s=0.05))
    try:
        def synced(version: int) -> dict:
            deadline = time.time() + 30
            while time.time() < deadline:
                m = httpx.get(s.base + "/metrics", timeout=10).json()
                if m["weights_sync"]["version"] == version:
                    return m
                time.sleep(0.05)
            raise AssertionError(f"server never reached version {version}: {m['weights_sync']}")

        synced(0)
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.05)
        pub.publish(trainer.state_dict(), 1)
        m = synced(1)
        assert m["engine"]["policy_version"] == 1 and m["weights_sync"]["errors"] == 0
        assert m["weights_sync"]["newest_in_store"] == 1 and m["weights_sync"]["versions_behind"] == 0
        assert m["weights_sync"]["last"]["chain"] == [1] and not m["weights_sync"]["last"]["from_full"]
        got = s.chat(None)["choices"][0]["logprobs"]["content"]
        ids = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = SamplingParams(max_tokens=6, temperature=0)
        want = Engine(trainer, tok, max_model_len=1024).generate([ids], params)[0]
        old = Engine(load_model("tiny-random")[0], tok, max_model_len=1024).generate([ids], params)[0]
        assert [t["token"] for t in got] == [tok.decode([t]) for t in want.token_ids]
        assert [t["logprob"] for t in got] == pytest.approx(want.logprobs, abs=1e-4)
        assert [t["logprob"] for t in got] != pytest.approx(old.logprobs, abs=1e-3)
        assert ServerClient(s.base).arms()["arms"]["a"]["weights_sync"]["version"] == 1
        # the answering version reaches a client (system_fingerprint) and the harness's policy output
        from openai import OpenAI

        from opencomposer.policies.openai import from_openai_response
        resp = OpenAI(base_url=s.base + "/v1", api_key="none").chat.completions.create(
            model="tiny-random", messages=MSG, max_tokens=4, temperature=0)
        assert resp.system_fingerprint == "opencomposer-policy-1"
        assert from_openai_response(resp).policy_version == 1
    finally:
        s.close()
