"""SamplingParams: vLLM defaults, normalization, and clear errors for bad values."""

from __future__ import annotations

import pytest

from minserve.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_normalization():
    p = SamplingParams(temperature=0, stop="###", stop_token_ids=(2, 3), max_tokens=None,
                       output_kind=1)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert p.stop == ["###"] and p.stop_token_ids == [2, 3]
    assert p.max_tokens is None
    assert p.output_kind is RequestOutputKind.DELTA
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1e-6).is_greedy
    assert [int(k) for k in RequestOutputKind] == [0, 1, 2]


def test_edges_are_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, logprobs=0, min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=20, top_k=1, min_p=0.0, max_tokens=1, seed=2**64 - 1)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    q.max_tokens = 99
    assert p.stop == ["a"] and p.max_tokens == 16


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=129), "n"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(seed="1"), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=False), "logprobs"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output"),
    (dict(output_kind=3), "output_kind"),
    (dict(output_kind="DELTA"), "output_kind"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must") as info:
        SamplingParams(**kwargs)
    assert ", got " in str(info.value)  # ... and shows what was passed


def test_message_names_value_and_range():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
