"""Issue 8, item 4: API keys decide who a caller is (tenant, priority class, admin), not the body.

Unit tests for the keys file and the class cap, then a live server with keys configured: 401
without a valid key on /v1/*, /metrics for admin keys only, and quotas, cache isolation and
priority classes following the authenticated tenant.
"""

import hashlib
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import AdmissionConfig, Auth, Principal, create_app
from minserve.server.admission import BATCH, INTERACTIVE, Ticket, classify
from minserve.server.auth import load_keys_file
from minserve.server.cli import auth_config, build_parser
from minserve.server.cli import main as serve_main

PROMPT = "The quick brown fox"
KEYS = {"sk-acme-1": Principal("acme"), "sk-acme-2": Principal("acme"),
        "sk-bulk": Principal("bulk", BATCH), "sk-ops": Principal("ops", admin=True)}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=256,
                                        num_kv_blocks=128)
    app = create_app(engine, admission=AdmissionConfig(tenant_max_inflight=1), auth=Auth(KEYS))
    with live_server(app) as base:
        yield SimpleNamespace(base=base, engine=engine, st=app.state.minserve)


def post(srv, key: str | None, path="/v1/completions", headers=None, **body) -> httpx.Response:
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(srv.base + path, headers=headers, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 1, **body})


# ---- the keys file and the class cap (no server) ------------------------------------------------

def write(tmp_path, doc) -> str:
    path = tmp_path / "keys.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_keys_file_plain_and_hashed_keys(tmp_path):
    digest = hashlib.sha256(b"sk-hashed").hexdigest()
    path = write(tmp_path, {"keys": [
        {"key": "sk-plain", "tenant": "acme"},
        {"key_sha256": digest.upper(), "tenant": "bulk", "priority_class": "batch", "admin": True}]})
    auth = Auth.from_options(keys_file=path)
    assert auth.authenticate("Bearer sk-plain") == Principal("acme", INTERACTIVE, False)
    assert auth.authenticate("bearer  sk-hashed ") == Principal("bulk", BATCH, True)
    for bad in (None, "", "Bearer", "Basic sk-plain", "Bearer sk-other", "sk-plain"):
        assert auth.authenticate(bad) is None
    assert len(load_keys_file(path)) == 2


@pytest.mark.parametrize("doc, where", [
    ("{not json", "not valid JSON"),
    ({"keys": []}, "at least one entry"),
    ([{"key": "sk-secret-1", "tenant": "a"}], "at least one entry"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "a"}, {"key": "sk-secret-2"}]}, "keys[1].tenant"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "a", "priority": 1}]}, "keys[0]: unknown field"),
    ({"keys": [{"key": "sk-secret-1", "key_sha256": "ab", "tenant": "a"}]}, "exactly one of"),
    ({"keys": [{"key_sha256": "sk-secret-1", "tenant": "a"}]}, "keys[0].key_sha256"),
    ({"keys": [{"key": " sk-secret-1", "tenant": "a"}]}, "keys[0].key"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "a", "priority_class": "vip"}]}, "keys[0].priority_class"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "a", "admin": "yes"}]}, "keys[0].admin"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "key-1"}]}, "reserved"),
    ({"keys": [{"key": "sk-secret-1", "tenant": "a"}, {"key": "sk-secret-1", "tenant": "b"}]},
     "keys[1]: this key is already listed"),
])
def test_keys_file_errors_name_the_file_and_entry_never_the_key(tmp_path, doc, where):
    path = write(tmp_path, doc)
    with pytest.raises(ValueError) as e:
        load_keys_file(path)
    assert path in str(e.value) and where in str(e.value) and "sk-secret" not in str(e.value)


def test_missing_keys_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--api-keys-file .*nope.json: cannot read it"):
        load_keys_file(tmp_path / "nope.json")


def test_cli_flags_build_auth(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert auth_config(parse([])) is None  # no keys: an open server, as before
    auth = auth_config(parse(["--api-key", "k1", "--api-key", "k2"]))
    assert auth.authenticate("Bearer k2").admin and auth.metrics_require_admin
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    auth = auth_config(parse(["--no-metrics-require-admin"]))
    assert auth.authenticate("Bearer from-env") and not auth.protects("/metrics")
    assert auth.protects("/v1/models") and not auth.protects("/health")
    # A bad keys file stops `minserve serve` before the model loads, naming the file.
    bad = write(tmp_path, {"keys": [{"key": "sk-secret"}]})
    assert serve_main(["--model", "tiny-llama", "--api-keys-file", bad]) == 2
    err = capsys.readouterr().err
    assert bad in err and "keys[0].tenant" in err and "sk-secret" not in err


def test_key_class_caps_the_requested_class():
    def cls(headers, priority=0, max_class=None):
        return classify(headers, user=None, priority=priority, deadline_ms=None, prompt_tokens=1,
                        max_tokens=1, tenant="t", max_class=max_class).priority_class
    assert cls({"x-priority-class": "interactive"}, max_class=BATCH) == BATCH
    assert cls({}, priority=-5, max_class=BATCH) == BATCH
    assert cls({"x-priority-class": "batch"}, max_class=INTERACTIVE) == BATCH  # asking for less is fine
    assert cls({}, max_class=INTERACTIVE) == INTERACTIVE
    t = classify({"authorization": "Bearer x"}, user="mallory", priority=0, deadline_ms=None,
                 prompt_tokens=1, max_tokens=1, tenant="acme")
    assert t.tenant == "acme"


# ---- a live server with keys --------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/nope"])
@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong", "Basic sk-acme-1", "sk-acme-1"])
def test_v1_routes_need_a_valid_key(server, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    if path == "/v1/models":
        r = httpx.get(server.base + path, headers=headers)
    else:
        r = post(server, None, path, headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert "Unauthorized" in err["message"] and r.headers["www-authenticate"] == "Bearer"


def test_valid_keys_are_served_and_health_stays_open(server):
    assert httpx.get(server.base + "/health").status_code == 200
    ok = openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-acme-1", max_retries=0)
    assert ok.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in ok.models.list().data] == ["tiny-llama"]
    bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_need_an_admin_key(server):
    get = lambda key: httpx.get(server.base + "/metrics",  # noqa: E731
                                headers={"Authorization": f"Bearer {key}"} if key else {})
    assert get(None).status_code == 401
    assert get("sk-acme-1").status_code == 403
    r = get("sk-ops")
    assert r.status_code == 200 and "vllm:prefix_cache_hits" in r.text


def test_quota_follows_the_keys_tenant_not_the_user_field(server):
    adm = server.st.admission
    held = Ticket("acme", INTERACTIVE, 1, 1)  # acme's one in-flight slot, taken for this test
    assert adm.try_admit(held).admitted
    try:
        same_tenant = post(server, "sk-acme-2", user="someone-else")
        other_tenant = post(server, "sk-bulk", user="acme")
    finally:
        adm.release(held)
    assert (same_tenant.status_code, same_tenant.json()["error"]["code"]) == (429, "tenant_quota")
    assert other_tenant.status_code == 200
    assert post(server, "sk-acme-2").status_code == 200 and adm.inflight("acme") == 0


def test_cache_is_shared_within_a_tenant_and_not_across(server):
    prompt = " ".join(f"acme internal memo line {i}" for i in range(16))

    def cached(key, **extra):
        r = post(server, key, prompt=prompt, user="acme", **extra)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("sk-acme-1") == 0
    assert cached("sk-acme-2") > 0          # another key of the same tenant: its own cache
    assert cached("sk-bulk") == 0           # claiming user=acme does not make bulk acme
    assert cached("sk-ops", cache_salt="x") == 0


def test_batch_key_cannot_promote_itself(server):
    reg = server.engine.metrics.registry

    def admitted(cls):
        return reg.get_sample_value("minserve:admission_admitted_total", {"priority_class": cls})

    before = admitted(BATCH), admitted(INTERACTIVE)
    assert post(server, "sk-bulk", headers={"x-priority-class": "interactive"}).status_code == 200
    assert post(server, "sk-bulk", priority=-10).status_code == 200
    assert (admitted(BATCH), admitted(INTERACTIVE)) == (before[0] + 2, before[1])
    assert post(server, "sk-acme-1", headers={"x-priority-class": "batch"}).status_code == 200
    assert admitted(BATCH) == before[0] + 3


def test_bench_client_sends_openai_api_key(server, monkeypatch):
    """`minserve bench serve` against a keyed server: the key comes from $OPENAI_API_KEY (as with
    `vllm bench serve`), for the requests and for the /metrics polling alike."""
    import asyncio

    from minserve.bench.client import Target, run_http
    from minserve.bench.datasets import SampleRequest
    from minserve.bench.results import BenchOptions
    reqs = [SampleRequest(PROMPT, 4, 3, str(i)) for i in range(2)]
    target = Target(server.base + "/v1/completions", server.base, "tiny-llama")
    tok = server.engine.tokenizer
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    res = asyncio.run(run_http(target, reqs, BenchOptions(max_concurrency=1), tok, 0.05))
    assert res.summary["completed"] == 0 and all(e.startswith("HTTP 401") for e in res.summary["errors"])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-ops")
    res = asyncio.run(run_http(target, reqs, BenchOptions(max_concurrency=1), tok, 0.05))
    assert res.summary["completed"] == 2
    assert len(res.server_metrics) >= 2  # /metrics polled as admin (it needs an admin key)



def test_a_stream_gives_its_quota_back_before_its_last_event(server):
    """A client with a quota of one may send its next request as soon as it has read a stream's
    ``[DONE]``: the seat is back by then, not only once the server has finished sending the
    response (which a client cannot see; a next request overtaking it got 429 'tenant_quota')."""
    adm = server.st.admission
    with httpx.Client(base_url=server.base, timeout=60,
                      headers={"Authorization": "Bearer sk-acme-1"}) as client:
        for _ in range(40):
            with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                                 "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(ln for ln in lines if ln == "data: [DONE]")
                assert adm.inflight("acme") == 0   # read at once: before the response has ended
