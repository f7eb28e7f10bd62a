"""The Triton decode backend (minserve/attention/triton_decode.py), on the CPU under Triton's
interpreter: a decode step through the engine's runner gives the torch backend's logits and writes
the same K/V (float and int8 caches), other steps fall through to the torch op, and the runner
installs the backend only where it can run (CUDA with Triton, a supported head size)."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minserve import LLM, SamplingParams  # noqa: E402
from minserve.attention import StepSequences  # noqa: E402
from minserve.attention.triton_decode import (TritonDecodeBackend, TritonDecodeMetadata,  # noqa: E402
                                              head_dim_supported)
from minserve.engine.model_runner import _triton_decode_backend  # noqa: E402
from minserve.models.loader import _smollm2_tokenizer_dir  # noqa: E402
from minserve.models.tiny import write_tiny_model  # noqa: E402
from test_fused_quant import SIZES, _fill_cache  # noqa: E402
from test_triton_kernels import tk  # noqa: E402,F401  (the interpreted kernels, module-scoped)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("triton-decode") / "llama", seed=3,
                            tokenizer_dir=_smollm2_tokenizer_dir(), overrides=SIZES)


def _runner(path, kv_cache_dtype):
    llm = LLM(str(path), num_kv_blocks=64, fused_decode=False, max_model_len=512, block_size=16,
              device="cpu", kv_cache_dtype=kv_cache_dtype)
    return llm.llm_engine.runner


def _logits(runner, backend, seqs, ids, positions):
    meta = backend.build_metadata(seqs)
    return runner.model(ids, positions, runner.kv_caches, meta, torch.arange(len(ids)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_decode_step_matches_the_torch_backend(kv_cache_dtype, tiny, tk):  # noqa: F811
    runner = _runner(tiny, kv_cache_dtype)
    triton = TritonDecodeBackend(16, "cpu")
    runner.model.use_attention(triton)   # its op serves torch metadata as well
    _fill_cache(runner.kv_caches, seed=5)
    before = [tuple(t.clone() for t in layer) for layer in runner.kv_caches]
    # Contexts crossing block boundaries, tables out of order, one sequence at position 0.
    seqs = StepSequences([1, 1, 1, 1], [37, 0, 16, 70], [[9, 3, 12], [20], [5, 6], [1, 40, 2, 30, 7]])
    ids, positions = torch.tensor([11, 220, 3, 901]), torch.tensor(seqs.context_lens)
    assert triton.unsupported_reason(seqs) is None
    assert isinstance(triton.build_metadata(seqs), TritonDecodeMetadata)
    out = _logits(runner, triton, seqs, ids, positions)
    written = [tuple(t.clone() for t in layer) for layer in runner.kv_caches]
    for layer, old in zip(runner.kv_caches, before):
        for t, t0 in zip(layer, old):
            t.copy_(t0)
    ref = _logits(runner, runner.layer_backend, seqs, ids, positions)   # falls through to torch
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # The same K/V written. Layer 0's are bit-identical; later layers' come from an attention
    # output summed in another order (kernel vs SDPA), so they agree to fp32 error and an int8
    # code may round one step the other way.
    for i, (layer, other) in enumerate(zip(runner.kv_caches, written)):
        for t, t2 in zip(layer, other):
            if i == 0:
                assert torch.equal(t, t2)
            elif t.dtype == torch.int8:
                assert (t.int() - t2.int()).abs().max() <= 1
            else:
                torch.testing.assert_close(t, t2, rtol=1e-5, atol=1e-5)


def test_it_takes_decode_steps_only():
    backend = TritonDecodeBackend(16, "cpu")
    assert backend.unsupported_reason(StepSequences([1, 3], [4, 8], [[0], [1]])) is not None
    assert backend.unsupported_reason(StepSequences([], [], [])) is not None


def test_the_runner_installs_it_only_where_it_runs(tiny):
    runner = _runner(tiny, "auto")
    assert runner.decode_backend is None   # a CPU engine: the fused step and torch
    cfg = runner.model.config
    assert _triton_decode_backend(cfg, runner.config, torch.device("cpu")) is None
    assert head_dim_supported(64) and not head_dim_supported(80) and not head_dim_supported(8)


def test_greedy_decoding_through_it_matches_torch(tiny, tk):  # noqa: F811
    """The whole engine loop: prefill through the torch op, decodes through the kernel."""
    prompts = [[5, 80, 301, 9, 14], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny), num_kv_blocks=64, fused_decode=False, max_model_len=512, block_size=16, device="cpu")
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
    llm = LLM(str(tiny), num_kv_blocks=64, fused_decode=False, max_model_len=512, block_size=16, device="cpu")
    runner = llm.llm_engine.runner
    triton = TritonDecodeBackend(16, "cpu")
    runner.model.use_attention(triton)
    runner.backends = [triton, runner.layer_backend]
    calls = []
    original = triton.build_metadata
    triton.build_metadata = lambda seqs: calls.append(len(seqs.query_lens)) or original(seqs)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == want
    assert calls and all(n >= 1 for n in calls)   # decode steps went through the Triton backend
