"""lm-eval against the HTTP server, as a vLLM user runs it, and against the in-process model.

lm-eval's ``local-completions`` model talks to ``minserve serve`` exactly as to vLLM's server:
multiple-choice loglikelihoods through completions with ``echo=true`` and ``logprobs``, answers
through plain completions, ``--batch_size 2`` as a list of prompts per request, and its tokenizer
from the server itself (``/tokenizer_info`` + ``/tokenize``, lm-eval's ``remote`` backend), so
nothing comes from the Hugging Face hub. The in-process minserve model (``MinserveLM``, through
``prompt_logprobs``) must give the same accuracy on the same offline tasks.
"""

import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it (minserve[eval] installs it)

import lm_eval  # noqa: E402
import lm_eval.models.openai_completions  # noqa: E402,F401  (registers local-completions)

from live_server import live_server  # noqa: E402
from minserve import LLM  # noqa: E402
from minserve.eval.lm_eval_adapter import MinserveLM, shipped_tasks, task_manager  # noqa: E402
from minserve.server import create_app  # noqa: E402

pytestmark = pytest.mark.slow  # the real SmolLM2-135M: accuracy must mean something

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval_tasks"
TASKS = ("minserve_test_choice", "minserve_test_answer")
METRICS = {"minserve_test_choice": ("acc,none", "acc_norm,none"),
           "minserve_test_answer": ("exact_match,none",)}


@pytest.fixture(scope="module", autouse=True)
def offline():
    """The task data is local; lm-eval's datasets loader must never ask the hub."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory="256MiB")


def scores(out: dict) -> dict:
    return {task: {m: out["results"][task][m] for m in names} for task, names in METRICS.items()}


def evaluate(model, **kw) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=shipped_tasks(TASKS_DIR, names=TASKS),
                                   task_manager=task_manager(), bootstrap_iters=0,
                                   log_samples=False, **kw)


class RequestCounter:
    """ASGI middleware counting the completions requests that reach the server."""

    def __init__(self, app, counts: dict):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            self.counts["http"] += 1
        await self.app(scope, receive, send)


def test_local_completions_against_the_server_matches_in_process(llm):
    inprocess = scores(evaluate(MinserveLM(llm=llm)))
    engine = llm.llm_engine
    done_before = engine.snapshot()["vllm:request_success"]
    counts = {"http": 0}
    app = create_app(engine, served_model_name="smollm2-135m")
    app.add_middleware(RequestCounter, counts=counts)
    with live_server(app) as base:
        served = scores(evaluate("local-completions", batch_size=2, model_args={
            "base_url": f"{base}/v1/completions", "model": "smollm2-135m",
            "tokenizer_backend": "remote", "tokenized_requests": True,
            "num_concurrent": 1, "max_retries": 1}))
    assert served == inprocess
    # Not a vacuous match: the model answers these easy items well above chance (1/4, 0).
    assert served["minserve_test_choice"]["acc,none"] >= 0.5
    assert served["minserve_test_answer"]["exact_match,none"] >= 0.2
    # 40 choices + 10 answers were asked in batches of two prompts per HTTP request.
    engine_requests = engine.snapshot()["vllm:request_success"] - done_before
    assert engine_requests == 50 and counts["http"] <= 30
