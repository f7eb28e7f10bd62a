"""Issue 8, item 3: the prefix cache is isolated per tenant by default, and usage reports the hits.

A shared prefix cache is a timing side channel: if tenant B's prompt hits blocks that tenant A
computed, B's TTFT tells B what A asked. So the server salts every request's cache key with its
tenant, whether or not the client sends a ``cache_salt``. Hits are asserted by counted tokens
(``usage.prompt_tokens_details.cached_tokens`` and the engine's ``vllm:prefix_cache_hits``).
"""

import uuid
from types import SimpleNamespace

import httpx
import openai
import pytest

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app
from minserve.server.auth import effective_salt

BLOCK = 16  # tiny-llama's default block size: hits come in whole blocks


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=256,
                                        num_kv_blocks=128)
    app = create_app(engine)  # no keys configured: tenants come from the bearer key / user field
    with live_server(app) as base:
        yield SimpleNamespace(base=base, engine=engine)


def long_prompt() -> str:
    """A fresh ~100-token prompt per test, so no test sees another's cached blocks."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"tenant {tag} secret number {i}" for i in range(16))


def engine_hits(srv) -> float:
    return srv.engine.metrics.snapshot()["vllm:prefix_cache_hits"]


def complete(srv, prompt: str, key: str | None = None, **extra) -> tuple[int, float]:
    """One non-streamed completion: (reported cached_tokens, the engine's counted hits)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    before = engine_hits(srv)
    r = httpx.post(f"{srv.base}/v1/completions", headers=headers, timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 3 * BLOCK
    return usage["prompt_tokens_details"]["cached_tokens"], engine_hits(srv) - before


def test_another_api_key_gets_no_hits_on_the_first_tenants_prompt(server):
    prompt = long_prompt()
    assert complete(server, prompt, key="sk-tenant-a") == (0, 0)
    # Before the fix, B hit all of A's full blocks here: its fast TTFT revealed A's prompt.
    assert complete(server, prompt, key="sk-tenant-b") == (0, 0)
    cached, counted = complete(server, prompt, key="sk-tenant-a")
    assert cached >= 3 * BLOCK and cached == counted  # the tenant still reuses its own blocks


def test_client_salt_of_another_tenant_gives_no_hits(server):
    prompt = long_prompt()
    assert complete(server, prompt, key="sk-tenant-a", cache_salt="shared") == (0, 0)
    cached, counted = complete(server, prompt, key="sk-tenant-a", cache_salt="shared")
    assert cached >= 3 * BLOCK and cached == counted
    assert complete(server, prompt, key="sk-tenant-b", cache_salt="shared") == (0, 0)
    # A salt still separates one tenant's own workloads, as in vLLM.
    assert complete(server, prompt, key="sk-tenant-a") == (0, 0)


def test_user_field_tenants_are_isolated_without_keys(server):
    prompt = long_prompt()
    assert complete(server, prompt, user="alice") == (0, 0)
    assert complete(server, prompt, user="bob") == (0, 0)
    cached, counted = complete(server, prompt, user="alice")
    assert cached > 0 and cached == counted


@pytest.mark.parametrize("chat", [False, True])
def test_cached_tokens_in_responses_and_stream_usage_chunk(server, chat):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-streamer", max_retries=0)
    prompt = long_prompt()
    if chat:
        def create(**kw):
            return client.chat.completions.create(model="tiny-llama", max_tokens=2, temperature=0,
                                                  messages=[{"role": "user", "content": prompt}], **kw)
    else:
        def create(**kw):
            return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2,
                                             temperature=0, **kw)
    first = create()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = engine_hits(server)
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == engine_hits(server) - before >= 3 * BLOCK
    again = create()
    assert again.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens_details.cached_tokens


def test_effective_salt_binds_the_tenant():
    assert effective_salt("a", None) == effective_salt("a", None)
    assert effective_salt("a", None) != effective_salt("b", None)
    assert effective_salt("a", "x") != effective_salt("b", "x")
    assert effective_salt("a", "x") != effective_salt("a", None)
    # No separator to forge: ("a", "b\0c") and ("a\0b", "c") stay apart.
    assert effective_salt("a", "b\0c") != effective_salt("a\0b", "c")
    assert effective_salt("a", None) != effective_salt("a", "null")
