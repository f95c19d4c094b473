"""``-m openai:URL`` against servers that say their context elsewhere or not at all: llama-server's
``/props``, vLLM's ``max_model_len``, and a server that only refuses a prompt too long, after which
the dialog goes again without its oldest turns. The servers are small stand-ins on a real socket
that answer as llama-server and vLLM do."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest

from llama_chat.inference.remote import UNKNOWN_CONTEXT, DialogCarrier, RemoteSource, connect
from llama_chat.inference.types import GenerationState, Request
from llama_chat.model.chat_format import Message

LLAMA_SERVER_REFUSAL = {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9000,
                                  "n_ctx": 4096, "message": "the request exceeds the available context size, "
                                                            "try increasing it"}}


class StandIn(BaseHTTPRequestHandler):
    """``models``: the /v1/models entry; ``props``: /props, or None for a 404; ``most``: the most
    messages a chat may have before it is refused as too long."""

    models: dict = {"id": "m", "object": "model"}
    props: dict | None = None
    most = 99
    seen: list = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [self.models]}).encode())
        elif self.path == "/props" and self.props is not None:
            self._send(200, json.dumps(self.props).encode())
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append(body["messages"])
        if len(body["messages"]) > self.most:
            self._send(400, json.dumps(LLAMA_SERVER_REFUSAL).encode())
            return
        chunks = [{"choices": [{"index": 0, "delta": {"content": "fits"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        self._send(200, b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n",
                   "text/event-stream")


@pytest.fixture
def stand_in():
    handler = type("Handler", (StandIn,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"openai:http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_context_is_read_where_the_server_says_it(stand_in):
    handler, spec = stand_in
    assert connect(spec).max_seq_len == UNKNOWN_CONTEXT
    handler.props = {"default_generation_settings": {"n_ctx": 4096}}  # llama-server
    assert connect(spec).max_seq_len == 4096
    handler.props = {"n_ctx": 8192, "default_generation_settings": {"n_ctx": 4096}}  # a newer one
    assert connect(spec).max_seq_len == 8192
    handler.models = {"id": "m", "object": "model", "max_model_len": 2048}  # vLLM
    assert connect(spec).max_seq_len == 2048


def test_a_dialog_too_long_for_the_server_goes_again_without_its_oldest_turns(stand_in):
    handler, spec = stand_in
    handler.most = 3
    dialog = [Message("system", "Be brief."), Message("user", "one"), Message("assistant", "1"),
              Message("user", "two"), Message("assistant", "2"), Message("user", "three")]
    request = Request(tuple(DialogCarrier().encode_dialog(dialog)), max_tokens=8, chat_reply=True)

    async def run():
        async with RemoteSource(connect(spec)).stream(request) as stream:
            return [r async for r in stream], stream.completion()

    _, completion = anyio.run(run)
    assert completion.text == "fits" and completion.finish_reason is GenerationState.EOS
    assert [len(m) for m in handler.seen] == [6, 4, 2]
    assert handler.seen[-1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "three"}]

    handler.most, handler.seen[:] = 1, []  # not even the last question fits: the server's own words
    with pytest.raises(BaseException) as info:
        anyio.run(run)
    assert "exceeds the available context size" in str(info.value.exceptions[0] if hasattr(info.value, "exceptions")
                                                        else info.value)
    assert [len(m) for m in handler.seen] == [6, 4, 2]
