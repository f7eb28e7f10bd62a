"""Soak: thousands of mixed requests against `minserve serve`, good and bad, while the server's
memory and KV usage are sampled. A long-running server must stay flat: every request ends with an
answer (or its client is gone), errors are the bad requests' own, memory does not grow with the
number of requests served, and every KV block is back at the end.

The mix (weights in KINDS): plain and streamed completions, chat, logprobs requests (completions
and chat), clients that disconnect mid-stream, and malformed requests (a lone surrogate in
cache_salt and in the prompt, broken JSON, max_tokens past the context, min_tokens with every
token a stop token, an unknown model) that must each get their 4xx without touching the others.

    .venv/bin/python benchmarks/bench_soak.py [--num-requests 3000 --concurrency 16 --model tiny-llama]

tiny-llama is the default: the soak is about bookkeeping (records, queues, blocks), which does not
depend on the model's size, and it lets a few thousand requests run in minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import free_port  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while engines batch tokens and caches keep "
         "prefixes of prompts that tenants send to the server every second").split()
KINDS = {  # kind: weight
    "plain": 30, "stream": 20, "chat": 10, "logprobs": 8, "chat_logprobs": 4, "disconnect": 8,
    "bad_salt": 4, "bad_prompt": 3, "bad_json": 3, "bad_max_tokens": 3, "bad_min_tokens": 3,
    "bad_model": 4,
}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 80)))


def _body(kind: str, rng: random.Random, model: str, vocab: int) -> tuple[str, str | dict, bool]:
    """(path, JSON body or raw text, stream?) of one request of ``kind``."""
    comp = {"model": model, "prompt": _prompt(rng), "max_tokens": rng.randint(4, 32), "temperature": 0.7}
    chat = {"model": model, "messages": [{"role": "user", "content": _prompt(rng)}],
            "max_tokens": rng.randint(4, 24)}
    table = {
        "plain": ("/v1/completions", comp, False),
        "stream": ("/v1/completions", {**comp, "stream_options": {"include_usage": True}}, True),
        "chat": ("/v1/chat/completions", chat, False),
        "logprobs": ("/v1/completions", {**comp, "logprobs": 2}, False),
        "chat_logprobs": ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}, True),
        "disconnect": ("/v1/completions", {**comp, "max_tokens": 64}, True),
        "bad_salt": ("/v1/completions", {**comp, "cache_salt": "\ud800"}, False),
        "bad_prompt": ("/v1/completions", {**comp, "prompt": "x \udcff y"}, False),
        "bad_json": ("/v1/completions", '{"model": "m", "prompt": "x", ', False),
        "bad_max_tokens": ("/v1/completions", {**comp, "max_tokens": 10**7}, False),
        "bad_min_tokens": ("/v1/completions", {**comp, "min_tokens": 1,
                                               "stop_token_ids": list(range(vocab))}, False),
        "bad_model": ("/v1/completions", {**comp, "model": "no-such-model"}, False),
    }
    return table[kind]


async def _one(client: httpx.AsyncClient, base: str, kind: str, path: str, body, stream: bool) -> str:
    """Send one request; return its outcome, e.g. "200", "200 stream done", "400 cache_salt"."""
    content = body if isinstance(body, str) else json.dumps(body)  # json escapes lone surrogates
    headers = {"content-type": "application/json"}
    if not stream:
        r = await client.post(base + path, content=content, headers=headers)
        return _outcome(r.status_code, r.text)
    payload = json.loads(content)
    payload["stream"] = True
    async with client.stream("POST", base + path, json=payload) as r:
        if r.status_code != 200:
            return _outcome(r.status_code, (await r.aread()).decode())
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if '"error"' in line:
                    return "200 stream error event"
                if line == "data: [DONE]":
                    return "200 stream done"
                if kind == "disconnect" and events >= 2:
                    return "client disconnected"  # leaving the block closes the connection
        return "200 stream cut (no [DONE])"


def _outcome(status: int, text: str) -> str:
    if status == 200:
        return "200"
    try:
        err = json.loads(text)["error"]
        return f"{status} {err.get('param') or err.get('code') or err.get('type')}"
    except (ValueError, KeyError, TypeError):
        return f"{status} (no OpenAI error body)"


class Sampler(threading.Thread):
    """RSS of the server process (from /proc) and its KV usage (from /metrics), every period."""

    def __init__(self, pid: int, base: str, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.base, self.period_s = pid, base, period_s
        self.samples: list[tuple[float, int, float, int]] = []  # (t, rss bytes, kv usage, done)
        self.done = 0
        self.stop = threading.Event()

    def rss(self) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024

    def kv_usage(self) -> float:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", text, re.M).group(1))

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.wait(self.period_s):
            self.samples.append((time.perf_counter() - t0, self.rss(), self.kv_usage(), self.done))


async def _drive(base: str, args, vocab: int, sampler: Sampler) -> collections.Counter:
    rng = random.Random(args.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.num_requests)
    outcomes: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def task(kind: str) -> None:
            path, body, stream = _body(kind, rng, args.served_model_name, vocab)
            async with sem:
                try:
                    outcome = await _one(client, base, kind, path, body, stream)
                except httpx.HTTPError as e:
                    outcome = f"transport error {type(e).__name__}"
            outcomes[(kind, outcome)] += 1
            sampler.done += 1
            if sampler.done % 500 == 0:
                print(f"  {sampler.done}/{args.num_requests} requests", flush=True)
        await asyncio.gather(*(task(k) for k in kinds))
    return outcomes


def _wait_idle(base: str, timeout_s: float = 60) -> dict[str, float]:
    """The server's gauges once nothing is running or waiting."""
    deadline = time.time() + timeout_s
    while True:
        text = httpx.get(base + "/metrics", timeout=10).text
        gauges = {m.group(1): float(m.group(2)) for m in re.finditer(
            r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)",
            text, re.M)}
        if (gauges["vllm:num_requests_running"] == gauges["vllm:num_requests_waiting"] == 0
                or time.time() > deadline):
            return gauges
        time.sleep(0.5)


def _report(args, outcomes, sampler: Sampler, gauges, wall_s: float) -> dict:
    s = sampler.samples
    warm = next((x for x in s if x[3] >= min(200, args.num_requests // 10)), s[0])
    half = [x for x in s if x[3] >= args.num_requests // 2]
    per_1k = None
    if len(half) >= 2 and half[-1][3] > half[0][3]:
        per_1k = (half[-1][1] - half[0][1]) / (half[-1][3] - half[0][3]) * 1000
    served = sum(n for (k, o), n in outcomes.items() if o.startswith("200") and "error" not in o)
    result = {
        "model": args.model, "requests": args.num_requests, "concurrency": args.concurrency,
        "wall_s": round(wall_s, 1), "served_ok": served,
        "outcomes": {f"{k}: {o}": n for (k, o), n in sorted(outcomes.items())},
        "rss_start_mib": warm[1] / 2**20, "rss_end_mib": s[-1][1] / 2**20,
        "rss_max_mib": max(x[1] for x in s) / 2**20,
        "rss_growth_kib_per_1k_requests_second_half": None if per_1k is None else per_1k / 1024,
        "kv_usage_max": max(x[2] for x in s), "final_gauges": gauges,
    }
    print("\n| outcome (kind: result) | count |\n| --- | --- |")
    for key, n in result["outcomes"].items():
        print(f"| {key} | {n} |")
    print(f"\n{args.num_requests} requests in {wall_s:.0f} s, {served} served with 200; "
          f"RSS after warm-up {result['rss_start_mib']:.1f} MiB, end {result['rss_end_mib']:.1f} MiB, "
          f"max {result['rss_max_mib']:.1f} MiB; second-half growth "
          f"{'n/a' if per_1k is None else f'{per_1k / 1024:.0f} KiB per 1000 requests'}; "
          f"KV usage max {result['kv_usage_max']:.2f}, at the end {gauges['vllm:kv_cache_usage_perc']:.3f}; "
          f"running/waiting at the end {gauges['vllm:num_requests_running']:.0f}/"
          f"{gauges['vllm:num_requests_waiting']:.0f}")
    return result


def start_server(args, port: int) -> subprocess.Popen:
    """`minserve serve` with a small KV pool, so the soak also runs under KV pressure."""
    env = dict(os.environ)
    if args.server_src:  # another checkout's minserve first on the path: before/after comparisons
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.server_src, env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "minserve.cli", "serve", "--model", args.model,
                             "--port", str(port), "--log-level", "warning", "--max-num-seqs", "16",
                             "--num-kv-blocks", str(args.num_kv_blocks)], env=env,
                            cwd=args.server_src or None)
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy within 180 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--num-requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=96, help="KV pool of the server (16-token blocks)")
    ap.add_argument("--server-src", help="run the server from this checkout (e.g. a git worktree of an "
                                         "older commit) to compare before and after a change")
    ap.add_argument("--out", default="benchmarks/results/soak.json")
    args = ap.parse_args()
    args.served_model_name = args.model
    port = free_port()
    proc = start_server(args, port)
    base = f"http://127.0.0.1:{port}"
    try:
        vocab = 49152  # SmolLM2's tokenizer, which tiny-llama shares
        sampler = Sampler(proc.pid, base)
        sampler.start()
        t0 = time.perf_counter()
        outcomes = asyncio.run(_drive(base, args, vocab, sampler))
        wall = time.perf_counter() - t0
        gauges = _wait_idle(base)
        time.sleep(1.0)  # one more sample after the end
        sampler.stop.set()
        sampler.join()
        result = _report(args, outcomes, sampler, gauges, wall)
    finally:
        proc.terminate()
        proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**result, "samples": sampler.samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
