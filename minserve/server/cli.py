"""`minserve serve`: build the engine from vLLM-style flags and serve it with uvicorn.

Shutdown drains: the first SIGINT/SIGTERM turns ``/health`` and new requests into 503 (so a load
balancer stops sending work), requests already admitted run to the end for up to
``--drain-timeout`` seconds, then uvicorn stops. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from minserve.server.admission import AdmissionConfig, ClassLimits

log = logging.getLogger("minserve.server")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minserve serve", description="OpenAI-compatible server.")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    ap.add_argument("--log-level", default="info")
    eng = ap.add_argument_group("engine")
    eng.add_argument("--max-num-seqs", type=int)
    eng.add_argument("--max-num-batched-tokens", type=int)
    eng.add_argument("--num-kv-blocks", type=int)
    eng.add_argument("--kv-cache-memory", help="KV cache size, e.g. 512MiB")
    eng.add_argument("--max-model-len", type=int)
    eng.add_argument("--block-size", type=int)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    eng.add_argument("--seed", type=int)
    eng.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    eng.add_argument("--device")
    eng.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=None,
                     help="decode-only steps in the fused C kernel (default: whenever it can run)")
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
    return ap


ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory",
               "max_model_len", "block_size", "enable_prefix_caching", "seed", "dtype", "device",
               "fused_decode")


def engine_kwargs(a: argparse.Namespace) -> dict:
    """Only the flags given, so EngineConfig's defaults stay the one source of defaults."""
    return {k: getattr(a, k) for k in ENGINE_ARGS if getattr(a, k) is not None}


def admission_config(a: argparse.Namespace) -> AdmissionConfig:
    interactive = ClassLimits(a.max_queued_requests, a.max_queued_tokens, a.max_queued_kv_bytes)

    def pick(batch_value, default):
        return default if batch_value is None else batch_value

    batch = ClassLimits(pick(a.batch_max_queued_requests, a.max_queued_requests),
                        pick(a.batch_max_queued_tokens, a.max_queued_tokens),
                        pick(a.batch_max_queued_kv_bytes, a.max_queued_kv_bytes))
    return AdmissionConfig(interactive=interactive, batch=batch,
                           tenant_max_inflight=a.tenant_max_inflight)


def make_server(app, host: str, port: int, drain_timeout_s: float, log_level: str = "info"):
    """A uvicorn Server whose first exit signal drains before stopping (see module docstring)."""
    import uvicorn

    st = app.state.minserve

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            loop = getattr(self, "_loop", None)
            if st.admission.draining or self.should_exit or loop is None:
                return super().handle_exit(sig, frame)
            log.info("draining: refusing new requests, letting admitted ones finish")
            st.admission.begin_drain()
            # A signal handler runs between bytecodes; hand the work to the loop properly.
            loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            deadline = asyncio.get_running_loop().time() + drain_timeout_s
            while (st.engine.has_unfinished_requests()
                   and asyncio.get_running_loop().time() < deadline):
                await asyncio.sleep(0.1)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    return DrainingServer(config)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from minserve.engine.llm_engine import LLMEngine
    from minserve.server.app import create_app
    try:
        engine = LLMEngine.from_engine_args(a.model, **engine_kwargs(a))
        admission = admission_config(a)
    except ValueError as e:
        print(f"minserve serve: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, served_model_name=a.served_model_name, admission=admission)
    server = make_server(app, a.host, a.port, a.drain_timeout, a.log_level.lower())
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
