"""``opencomposer serve``: an OpenAI-compatible HTTP server over the built-in engine.

    opencomposer serve --model smollm2-135m --port 8000

``app.py`` the process (``ServeConfig``, ``build_server``, ``serve``); ``handlers.py`` the routes
(``OpenAIServer``); ``streaming.py`` the server-sent events of ``stream: true``; ``schema.py`` the
wire format; ``chat_format.py`` messages + tools <-> prompt text and tool calls; ``text_stream.py``
tokens -> the text a client may see; ``front.py`` the front door of the real-time loop (session
logs from ``session_log.py``, feedback, A/B arms, weight hot-swap); ``auth.py`` who may change its
state; ``process.py`` the server in a child process.

Test: ``pytest tests/unit/inference/test_server.py tests/unit/inference/test_server_backpressure.py
tests/unit/inference/test_server_chat_format.py -q``; ``pytest tests/integration/test_serve_auth.py -q``.
"""
