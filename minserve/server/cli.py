"""`minserve serve`: build the engine from vLLM-style flags and serve it with uvicorn.

Shutdown drains: the first SIGINT/SIGTERM turns ``/health`` and new requests into 503 (so a load
balancer stops sending work), requests already admitted run to the end for up to
``--drain-timeout`` seconds; any still running then are failed with a 503 their clients can read
(a stream gets an error event and ``data: [DONE]``, not a cut connection), then uvicorn stops.
A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import types
import typing
from dataclasses import MISSING, fields

from minserve.config import (DEFAULT_CPU_KV_CACHE_MEMORY, FP32_MATMUL_PRECISIONS, KV_CACHE_DTYPES,
                             SCHEDULING_POLICIES, EngineConfig)
from minserve.quant.names import QUANTIZATION_METHODS
from minserve.server.admission import AdmissionConfig, ClassLimits
from minserve.server.connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                         DEFAULT_KEEP_ALIVE_S, ConnectionLimits, default_max_connections)
from minserve.server.limits import CHARS_PER_TOKEN_BOUND, RequestLimits
from minserve.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from minserve.server.tool_parsers.plan import ToolConfig

log = logging.getLogger("minserve.server")
FLUSH_S = 2.0  # after the drain timeout: how long failed streams get to send their last events


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minserve serve", description="OpenAI-compatible server.")
    # `minserve serve MODEL`, as `vllm serve MODEL`; --model stays for older scripts.
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help=f"the model to serve (default {DEFAULT_MODEL})")
    ap.add_argument("--model", default=None, help="the same as MODEL (give one of the two)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    ap.add_argument("--log-level", default="info")
    add_engine_arguments(ap.add_argument_group("engine (EngineConfig; unset flags keep its defaults)"))
    adm = ap.add_argument_group("admission (per priority class; batch defaults to interactive's)")
    adm.add_argument("--max-queued-requests", type=int, default=256)
    adm.add_argument("--max-queued-tokens", type=int)
    adm.add_argument("--max-queued-kv-bytes", type=int)
    adm.add_argument("--batch-max-queued-requests", type=int)
    adm.add_argument("--batch-max-queued-tokens", type=int)
    adm.add_argument("--batch-max-queued-kv-bytes", type=int)
    adm.add_argument("--tenant-max-inflight", type=int, help="in-flight requests per tenant")
    adm.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds to let admitted requests finish on shutdown")
    lim = ap.add_argument_group("request limits, checked before any tokenization")
    lim.add_argument("--max-request-body-bytes", type=int, default=RequestLimits.max_body_bytes,
                     help="larger bodies get 413 (default: %(default)s, 4 MiB)")
    lim.add_argument("--max-prompt-chars", type=int,
                     help=f"longer prompts (or message contents, summed) get 400 (default: "
                          f"max_model_len x {CHARS_PER_TOKEN_BOUND})")
    conn = ap.add_argument_group("connections, below HTTP requests (docs/serving/index.md)")
    conn.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                      help="close a kept-alive connection idle this long (default: %(default)s s)")
    conn.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                      help="close a connection whose request head is not complete this long after "
                           "it connected or got its last response (default: %(default)s s)")
    conn.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                      help="close a connection whose request body is not complete this long after "
                           "its head (default: %(default)s s)")
    conn.add_argument("--max-connections", type=int, default=None, metavar="N",
                      help="open connections at most; at the limit the oldest one without a complete "
                           "request head is closed to let a new one in (default: the fd limit "
                           f"less headroom, here {default_max_connections()})")
    routes = ap.add_argument_group("named routes, canary and downgrade (docs/serving/routes.md)")
    routes.add_argument("--route", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                        help="a named route with its own engine (engine flags as keys, e.g. "
                             "int4:quantization=int4); repeatable; the first is the default")
    routes.add_argument("--routes", metavar="PATH", help="JSON routes file: routes, default, canary, "
                                                         "downgrade, explicit_route")
    tools = ap.add_argument_group("tool calls (docs/serving/index.md)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice="auto"); '
                            "needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help=f"how tool calls are read from the output (the default model: "
                            f"{DEFAULT_TOOL_PARSER})")
    auth = ap.add_argument_group("authentication (docs/serving/index.md)")
    auth.add_argument("--api-key", action="append", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1/*; repeatable; admin keys, "
                           "one tenant each (default: $VLLM_API_KEY). Visible in `ps`: prefer a keys file")
    auth.add_argument("--api-keys-file", metavar="PATH",
                      help="JSON file mapping keys to tenant, priority class and admin flag")
    auth.add_argument("--metrics-require-admin", action=argparse.BooleanOptionalAction, default=True,
                      help="with keys configured, /metrics needs an admin key (default: yes)")
    return ap


# The engine flags are EngineConfig's fields (less ``model``, which is --model above), so a new engine
# argument gets its flag by being added there. Help text for each lives here; choices come from a
# Literal type or ENGINE_CHOICES; the default shown is always EngineConfig's own.
ENGINE_ARGS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")
ENGINE_HELP = {
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (decodes + prefill chunks)",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "KV cache size in blocks (overrides --kv-cache-memory and --gpu-memory-utilization)",
    "kv_cache_memory": "KV cache size, e.g. 512MiB (absolute, CPU and CUDA; default on CPU: "
                       f"{DEFAULT_CPU_KV_CACHE_MEMORY})",
    "gpu_memory_utilization": "on CUDA without --kv-cache-memory: share of free GPU memory for the KV cache",
    "max_model_len": "longest prompt + output (default: the model's context length)",
    "enable_prefix_caching": "reuse the KV blocks of a shared prompt prefix",
    "dtype": "weights and activations",
    "fp32_matmul_precision": "float32 products of 16+ rows: highest (exact) or high (three bf16 products "
                             "on AMX tiles, ~16 mantissa bits; default: torch's setting)",
    "device": "cpu or cuda[:N] (default: cuda when available)",
    "seed": "engine seed for sampling without a per-request seed",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "disable_log_stats": "no Prometheus metrics (request timelines are still kept)",
    "fused_decode": "decode-only steps in the fused C kernel (default: whenever it can run)",
    "batch_invariant": "a request's tokens and logprobs do not depend on the other requests (CPU, "
                       "float32; every step in the fused C step, or the PyTorch path with "
                       "--no-fused-decode)",
    "max_request_records": "finished requests kept for requests_frame() (memory stays flat)",
    "max_step_records": "steps kept for steps_frame()",
    "adaptive_threads": "on CPU, pick each decode step's thread count from measured step times",
    "scheduling_policy": "fcfs, or priority: interactive before batch, then lower 'priority' first; "
                         "lower-priority requests are preempted first; or a registered policy's name, "
                         "or package.module:Class (a SchedulingPolicy)",
    "quantization": "quantize the weights at start-up: int8 (per-channel), int4 (group-wise), int4-awq "
                    "(activation-aware int4); default: the model's dtype",
    "quantization_config": "JSON settings of --quantization, e.g. '{\"group_size\": 64}' (keys: group_size, "
                           "fallback, lm_head; int4-awq: calibration, max_calibration_tokens, n_grid)",
    "memory_budget": "weights + KV cache, e.g. 1GiB: the KV cache gets what the weights leave "
                     "(excludes --kv-cache-memory and --num-kv-blocks)",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype) or int8 (a float32 scale per token and "
                      "kv head: ~3.8x the tokens of fp32 at head_dim 64)",
    "logits_processors": "custom logits processors, qualified class names (package.module:Class); "
                         "clients pass their per-request arguments in vllm_xargs (docs/extending.md)",
}
ENGINE_CHOICES = {"dtype": ("float32", "bfloat16", "float16"), "fp32_matmul_precision": FP32_MATMUL_PRECISIONS,
                  "kv_cache_dtype": KV_CACHE_DTYPES, "quantization": QUANTIZATION_METHODS}


def scheduling_policy_arg(value: str) -> str:
    """--scheduling-policy: a registered name or an importable package.module:Class, checked now."""
    from minserve.engine.scheduling_policy import resolve_scheduling_policy
    try:
        resolve_scheduling_policy(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


# Flags whose values are not one scalar (vLLM spells --logits-processors as a list of names).
ENGINE_ARG_OPTIONS = {"logits_processors": {"nargs": "+", "metavar": "PKG.MOD:CLASS"},
                      "scheduling_policy": {"type": scheduling_policy_arg,
                                            "metavar": "{" + ",".join(SCHEDULING_POLICIES) + ",...}"}}


def add_engine_arguments(group) -> None:
    """One --flag per EngineConfig field, typed from its annotation. Every flag defaults to None
    (not given), so engine_kwargs passes only what the user set."""
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)  # X | None, int | str
        kinds = [t for t in (typing.get_args(hint) if union else (hint,)) if t is not type(None)]
        default = f.default if f.default is not MISSING else None
        help_text = ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}")
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        kw: dict = {"default": None, "help": help_text.replace("%", "%%")}
        if kinds == [bool]:
            kw["action"] = argparse.BooleanOptionalAction
        elif len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
            kw["choices"] = typing.get_args(kinds[0])
        elif len(kinds) == 1 and kinds[0] in (int, float):
            kw["type"] = kinds[0]
        # else str, and unions such as kv_cache_memory's int | str: EngineConfig parses the string
        if f.name in ENGINE_CHOICES:
            kw["choices"] = ENGINE_CHOICES[f.name]
        kw.update(ENGINE_ARG_OPTIONS.get(f.name, {}))
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """Only the flags given, so EngineConfig's defaults stay the one source of defaults."""
    names = (f.name for f in fields(EngineConfig) if f.name != "model")
    return {k: getattr(a, k) for k in names if getattr(a, k, None) is not None}


def admission_config(a: argparse.Namespace) -> AdmissionConfig:
    interactive = ClassLimits(a.max_queued_requests, a.max_queued_tokens, a.max_queued_kv_bytes)

    def pick(batch_value, default):
        return default if batch_value is None else batch_value

    batch = ClassLimits(pick(a.batch_max_queued_requests, a.max_queued_requests),
                        pick(a.batch_max_queued_tokens, a.max_queued_tokens),
                        pick(a.batch_max_queued_kv_bytes, a.max_queued_kv_bytes))
    return AdmissionConfig(interactive=interactive, batch=batch,
                           tenant_max_inflight=a.tenant_max_inflight)


def auth_config(a: argparse.Namespace):
    """The Auth of --api-key / $VLLM_API_KEY / --api-keys-file, or None (no keys: open server)."""
    from minserve.server.auth import Auth
    env_key = os.environ.get("VLLM_API_KEY")
    keys = a.api_key if a.api_key is not None else ([env_key] if env_key else [])
    return Auth.from_options(keys, a.api_keys_file, a.metrics_require_admin)


def routes_config_of(a: argparse.Namespace):
    """The RoutesConfig of --routes or --route flags, or None (one engine, as without them)."""
    from minserve.server.routes import RoutesConfig, load_routes_file, parse_route_flag
    if a.routes and a.route:
        raise ValueError("--route and --routes: give one of the two (a routes file holds its routes)")
    if a.routes:
        return load_routes_file(a.routes, a.model if getattr(a, "model_given", True) else None)
    if not a.route:
        return None
    pairs = [parse_route_flag(text) for text in a.route]
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--route: each name once, got {names}")
    return RoutesConfig(a.model, dict(pairs), names[0])


def request_limits(a: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_body_bytes=a.max_request_body_bytes, max_prompt_chars=a.max_prompt_chars)


def connection_limits(a: argparse.Namespace) -> ConnectionLimits:
    kw = {} if a.max_connections is None else {"max_connections": a.max_connections}
    return ConnectionLimits(header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
                            timeout_keep_alive_s=a.timeout_keep_alive, **kw)


def make_server(app, host: str, port: int, drain_timeout_s: float, log_level: str = "info",
                connections: ConnectionLimits | None = None):
    """A uvicorn Server whose first exit signal drains before stopping (see module docstring),
    speaking HTTP through the guarded protocol of connections.py (deadlines for request heads and
    bodies, the connection limit) with ConnectionCloseMiddleware around the whole app."""
    import uvicorn

    from minserve.server.connections import (ConnectionCloseMiddleware, accept_backlog, protocol_class,
                                             widen_listen_queue)

    st = app.state.minserve

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            widen_listen_queue(self.servers)  # small accept bursts, the kernel's queue as before

        def handle_exit(self, sig, frame) -> None:
            loop = getattr(self, "_loop", None)
            if st.admission.draining or self.should_exit or loop is None:
                return super().handle_exit(sig, frame)
            log.info("draining: refusing new requests, letting admitted ones finish")
            st.begin_drain()  # every route's admission
            # A signal handler runs between bytecodes; hand the work to the loop properly.
            loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            clock = asyncio.get_running_loop().time
            deadline = clock() + drain_timeout_s
            # The server's own count of admitted, unclosed requests: the engine's state belongs
            # to the engine thread, never read from the event loop.
            while st.open_flights and clock() < deadline:
                await asyncio.sleep(0.1)
            if st.open_flights:
                log.warning("drain timeout of %g s passed: failing %d requests still in flight",
                            drain_timeout_s, st.open_flights)
                from minserve.server.async_engine import RequestFailed
                st.fail_all(RequestFailed(
                    f"the server is shutting down: the drain timeout of {drain_timeout_s:g} s passed "
                    "before this request finished; retry it on another replica", 503, "draining"))
                # Uvicorn's exit would cut the streams; let them write the error and [DONE] first.
                flush_until = clock() + FLUSH_S
                while st.open_flights and clock() < flush_until:
                    await asyncio.sleep(0.02)
            self.should_exit = True

    limits = connections or ConnectionLimits()
    config = uvicorn.Config(ConnectionCloseMiddleware(app), host=host, port=port, log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=5, http=protocol_class(limits),
                            timeout_keep_alive=limits.timeout_keep_alive_s,
                            backlog=accept_backlog(limits.max_connections))
    server = DrainingServer(config)
    server.connection_guard = config.http.guard  # its counters: for tests and the drill
    return server


DEFAULT_MODEL = EngineConfig.model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed flags, with ``model`` resolved from MODEL or --model (a conflict is an error)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.model_tag and a.model and a.model_tag != a.model:
        ap.error(f"the model is given twice: MODEL {a.model_tag!r} and --model {a.model!r}; give one")
    a.model_given = bool(a.model_tag or a.model)  # a routes file names its model otherwise
    a.model = a.model_tag or a.model or DEFAULT_MODEL
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from minserve.engine.llm_engine import LLMEngine
    from minserve.server.app import create_app
    from minserve.server.routed_app import create_routed_app
    try:
        auth = auth_config(a)  # first: a bad keys file should not wait for the model to load
        connections = connection_limits(a)
        tools = ToolConfig(a.enable_auto_tool_choice, a.tool_call_parser)
        routes = routes_config_of(a)
        if routes:  # each route's engine: the common flags, then the route's own arguments
            engines = {n: LLMEngine.from_engine_args(routes.model, **{**engine_kwargs(a), **kw})
                       for n, kw in routes.routes.items()}
            engine = engines[routes.default]
        else:
            engine = LLMEngine.from_engine_args(a.model, **engine_kwargs(a))
        admission = admission_config(a)
        limits = request_limits(a)
    except ValueError as e:
        print(f"minserve serve: {e}", file=sys.stderr)
        return 2
    kw = dict(served_model_name=a.served_model_name, admission=admission, auth=auth, limits=limits, tools=tools)
    app = create_routed_app(engines, routes, **kw) if routes else create_app(engine, **kw)
    server = make_server(app, a.host, a.port, a.drain_timeout, a.log_level.lower(), connections)
    # After uvicorn.Config, which sets up uvicorn's log handlers: an fd-exhaustion flood (asyncio's
    # accept errors, "Too many open files") must not fill the disk.
    from minserve.server.connections import install_log_rate_limit
    install_log_rate_limit()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
