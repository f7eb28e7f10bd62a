"""The `minserve` command dispatches to its subcommands and reports misuse with exit code 2."""

from minserve.cli import main


def test_generate_prints_each_prompt(capsys):
    assert main(["generate", "--model", "tiny-llama", "--max-tokens", "3", "Hello", "World"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[0].startswith("'Hello' -> ") and out[1].startswith("'World' -> ")


def test_usage_and_unknown_commands(capsys):
    assert main([]) == 0 and "usage" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err
    assert main(["bench"]) == 2 and "bench serve" in capsys.readouterr().err


def test_serve_flags_become_engine_arguments():
    from minserve.config import EngineConfig
    from minserve.server.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["--no-fused-decode", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"fused_decode": False, "max_num_seqs": 4, "enable_prefix_caching": False}
    assert EngineConfig.from_kwargs("tiny-llama", **kwargs).fused_decode is False
    assert engine_kwargs(build_parser().parse_args([])) == {}  # unset flags keep the engine's defaults


def test_every_serve_engine_flag_is_an_engine_argument():
    """Each name serve forwards exists in EngineConfig, and each has its --flag."""
    from dataclasses import fields

    from minserve.config import EngineConfig
    from minserve.server.cli import ENGINE_ARGS, build_parser, engine_kwargs
    assert set(ENGINE_ARGS) <= {f.name for f in fields(EngineConfig)}
    args = build_parser().parse_args(["--gpu-memory-utilization", "0.5", "--no-enable-chunked-prefill",
                                      "--max-request-records", "7", "--kv-cache-memory", "64MiB"])
    assert engine_kwargs(args) == {"gpu_memory_utilization": 0.5, "enable_chunked_prefill": False,
                                   "max_request_records": 7, "kv_cache_memory": "64MiB"}
    assert EngineConfig.from_kwargs("tiny-llama", **engine_kwargs(args)).max_request_records == 7
