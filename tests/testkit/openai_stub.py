"""A stand-in for an OpenAI-compatible endpoint (a hosted API is an outside boundary): a real HTTP
server on 127.0.0.1 that answers POST .../chat/completions with queued replies, in the documented
chat.completion wire format, and keeps the requests.

    server = FakeServer(); server.replies.append((200, completion("hello", finish="stop")))
    OpenAIPolicy("m", base_url=server.url).act(messages, [])
    server.requests[-1]["body"]["model"] == "m"; server.close()
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def completion(content=None, calls=(), finish="tool_calls", usage=(11, 7)):
    """A chat.completion body; ``calls`` are (id, name, arguments-string)."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }


class FakeServer:
    """Answers POST .../chat/completions with queued (status, body) pairs; keeps the requests."""

    def __init__(self):
        self.replies: list[tuple[int, dict]] = []
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                status, reply = outer.replies.pop(0) if outer.replies else (500, {"error": {"message": "no reply queued"}})
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
