"""Issue 20 item 8: /openapi.json says what the server answers (400 and OpenAI's error body, never
FastAPI's 422), and the decision on /docs and /openapi.json under API keys holds: public, as vLLM.
"""

import json

import httpx
import jsonschema
import pytest

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app
from minserve.server.auth import Auth, Principal


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, num_kv_blocks=64)
    app = create_app(engine, auth=Auth({"sk-a": Principal("a")}))
    with live_server(app) as base:
        yield base, httpx.get(base + "/openapi.json").json()


def test_the_document_never_promises_a_422(server):
    _, doc = server
    assert '"422"' not in json.dumps(doc)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}, path


# Requests built to fail as a schema fuzzer would; each answer must be a status the document lists
# for that route, with a body that matches the documented error schema.
BAD = [
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}),
    ("/v1/completions", b"{not json"),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "other"}),
    ("/tokenize", {"prompt": ["a"]}),
    ("/detokenize", {"tokens": [True]}),
]


@pytest.mark.parametrize("path, body", BAD)
def test_errors_are_the_documented_statuses_and_shapes(server, path, body):
    base, doc = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + path, content=content, headers={"Authorization": "Bearer sk-a",
                                                          "Content-Type": "application/json"})
    documented = doc["paths"][path]["post"]["responses"]
    assert str(r.status_code) in documented and r.status_code >= 400, (r.status_code, r.text)
    schema = {**doc["components"]["schemas"]["ErrorResponse"], "components": doc["components"]}
    jsonschema.validate(r.json(), schema)


def test_docs_and_the_document_need_no_key_while_the_api_does(server):
    base, _ = server
    assert httpx.get(base + "/openapi.json").status_code == 200
    assert httpx.get(base + "/docs").status_code == 200
    assert httpx.get(base + "/v1/models").status_code == 401
    # The document is the same for every caller: nothing in it depends on who asks.
    assert httpx.get(base + "/openapi.json", headers={"Authorization": "Bearer sk-a"}).json() == server[1]


def test_a_405_names_every_method_and_health_and_metrics_say_what_they_send(server):
    """Found by schemathesis: GET routes answered HEAD through a second route, so a 405 said
    ``Allow: HEAD``; /health (empty) and /metrics (text) were documented as JSON."""
    base, doc = server
    for path in ("/health", "/v1/models", "/version"):
        r = httpx.request("OPTIONS", base + path, headers={"Authorization": "Bearer sk-a"})
        assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
        assert httpx.head(base + path, headers={"Authorization": "Bearer sk-a"}).status_code == 200
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert httpx.get(base + "/health").content == b""
    for path in ("/v1/completions", "/v1/chat/completions"):  # JSON, or SSE with "stream": true
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json", "text/event-stream"}
