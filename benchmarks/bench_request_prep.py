"""What one request body costs before it reaches the engine: parsing on the event loop and
preparation on the tokenizer threads (issue 20, item 2). Both hold the GIL, so while they run every
stream waits (the event loop) or every step slows (the engine thread's GIL hand-offs).

1. Validating a 4 MiB body of empty chat messages: with the schema's bound (protocol.MAX_MESSAGES,
   pydantic stops at the first item past it) and, for comparison, the same model without it.
2. ``serving.prepare`` of a request with a whole-vocabulary ``logit_bias`` and one with a
   whole-vocabulary ``allowed_token_ids`` (SamplingParams' checks and the prepared tensors).

    .venv/bin/python benchmarks/bench_request_prep.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pydantic import create_model

from minserve.engine.llm_engine import LLMEngine
from minserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from minserve.server.serving import prepare


def best_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def validate(model, doc) -> None:
    try:
        model.model_validate(doc)
    except ValueError:
        pass  # the bounded model refuses it: what is timed is how soon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    doc = json.loads(json.dumps({"messages": [{"role": "user", "content": ""}] * 110_000}))
    unbounded = create_model("Unbounded", messages=(list[ChatMessage], ...))
    print(f"110 k empty messages (3.6 MB): validated in {best_ms(lambda: validate(unbounded, doc), args.runs):.0f} ms "
          f"unbounded, refused in {best_ms(lambda: validate(ChatCompletionRequest, doc), args.runs):.0f} ms "
          "with the schema's bound")
    engine = LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=16)
    vocab = engine.model_config.vocab_size
    for name, extra in (("logit_bias", {"logit_bias": {str(t): 0.1 for t in range(vocab)}}),
                        ("allowed_token_ids", {"allowed_token_ids": list(range(vocab))})):
        body = CompletionRequest.model_validate_json(json.dumps({"prompt": "hello", "max_tokens": 4, **extra}))
        ms = best_ms(lambda: prepare(body, "completion", engine, "tiny-llama"), args.runs)
        print(f"prepare() with a whole-vocabulary {name} ({vocab} entries): {ms:.1f} ms")


if __name__ == "__main__":
    main()
