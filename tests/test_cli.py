"""The `minserve` command dispatches to its subcommands and reports misuse with exit code 2."""

import pytest

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


def test_every_engine_config_field_has_a_serve_flag():
    """serve's engine flags are derived from EngineConfig: each field but `model` (--model) has one,
    typed from its annotation, and none is passed unless given."""
    import argparse
    from dataclasses import fields

    from minserve.config import EngineConfig
    from minserve.server.cli import ENGINE_ARGS, build_parser, engine_kwargs
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    names = [f.name for f in fields(EngineConfig) if f.name != "model"]
    assert list(ENGINE_ARGS) == names
    for name in names:
        assert "--" + name.replace("_", "-") in flags[name].option_strings, name
        assert flags[name].default is None and flags[name].help, name
    assert isinstance(flags["adaptive_threads"], argparse.BooleanOptionalAction)
    from minserve.server.cli import parse_args
    assert parse_args([]).model == EngineConfig.model   # MODEL / --model default to the engine's
    args = parser.parse_args(["--max-step-records", "9", "--no-adaptive-threads", "--disable-log-stats",
                              "--dtype", "bfloat16", "--device", "cpu", "--block-size", "32"])
    assert engine_kwargs(args) == {"max_step_records": 9, "adaptive_threads": False,
                                   "disable_log_stats": True, "dtype": "bfloat16", "device": "cpu",
                                   "block_size": 32}
    config = EngineConfig.from_kwargs("tiny-llama", **engine_kwargs(args))
    assert (config.max_step_records, config.adaptive_threads, config.block_size) == (9, False, 32)


def test_a_new_engine_config_field_gets_its_flag(monkeypatch):
    """Adding a field to EngineConfig is enough for `minserve serve` to accept it."""
    from dataclasses import dataclass
    from typing import Literal

    import minserve.server.cli as serve_cli
    from minserve.config import EngineConfig

    @dataclass
    class Extended(EngineConfig):
        new_knob: int | None = None
        new_switch: bool = False
        new_mode: Literal["a", "b"] = "a"

    monkeypatch.setattr(serve_cli, "EngineConfig", Extended)
    args = serve_cli.build_parser().parse_args(["--new-knob", "3", "--new-switch", "--new-mode", "b"])
    names = [a.dest for a in serve_cli.build_parser()._actions]
    assert {"new_knob", "new_switch", "new_mode"} <= set(names)
    assert serve_cli.engine_kwargs(args) == {"new_knob": 3, "new_switch": True, "new_mode": "b"}
    flags = {a.dest: a for a in serve_cli.build_parser()._actions}
    assert tuple(flags["new_mode"].choices) == ("a", "b") and flags["new_knob"].type is int


def test_serve_takes_the_model_as_vllm_does():
    """`vllm serve MODEL`: the model as a positional argument (issue 20, item 9); --model still works,
    and giving two different models is refused."""
    from minserve.server.cli import DEFAULT_MODEL, parse_args
    assert parse_args(["tiny-llama", "--max-num-seqs", "4"]).model == "tiny-llama"
    assert parse_args(["--model", "tiny-llama"]).model == "tiny-llama"
    assert parse_args(["tiny-llama", "--model", "tiny-llama"]).model == "tiny-llama"
    assert parse_args([]).model == DEFAULT_MODEL
    with pytest.raises(SystemExit):
        parse_args(["tiny-llama", "--model", "smollm2-135m"])
