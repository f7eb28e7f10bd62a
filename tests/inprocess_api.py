"""The OpenAI server in process (FastAPI's TestClient, lifespan and engine thread included),
recording what each request asked the engine for: tests of request fields check their effect on
the prompt ids, SamplingParams and submit arguments the engine got."""

import contextlib
from types import SimpleNamespace

from fastapi.testclient import TestClient

from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app


@contextlib.contextmanager
def recorded_server(model: str, tools=None, **engine_kwargs):
    """Yields ``client``, ``engine``, ``tok``, ``st`` (the app state) and ``seen``: one record per
    engine submission (``prompt``, ``params`` and the keyword arguments, e.g. ``cache_salt``)."""
    engine = LLMEngine.from_engine_args(model, **engine_kwargs)
    app = create_app(engine, tools=tools)
    st = app.state.minserve
    seen = []
    submit = st.async_engine.submit

    def spy(request_id, prompt, params, **kw):
        seen.append(SimpleNamespace(request_id=request_id, prompt=list(prompt), params=params, **kw))
        return submit(request_id, prompt, params, **kw)

    st.async_engine.submit = spy
    with TestClient(app) as client:
        yield SimpleNamespace(client=client, engine=engine, tok=engine.tokenizer, st=st, seen=seen)
