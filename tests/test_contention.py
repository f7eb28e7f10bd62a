"""Decode steps use as many threads as there are free cores (engine/threads.py, issue 8 item 10).

Timing never decides a test here: the controller takes made-up step times through an injected
clock, and the engine tests make each step's "duration" a function of the thread count the step
really ran with (the fused kernel reports its OpenMP team size; the PyTorch path is observed
inside the model call). A machine where another process holds a core is one where 2-thread
steps cost far more than 1-thread steps.
"""

import shutil

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine.threads import ENV_SWITCH, CpuLoadHint, ThreadController, adaptive_threads_enabled

QUIET = {2: 0.020, 1: 0.028}     # seconds per step: two threads win on a quiet machine
BUSY = {2: 0.400, 1: 0.030}      # one core taken: the 2-thread team waits for time slices
KEY = (True, 1)
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler: the fused decode kernel cannot be built")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def simulate(ctl, clock, costs, steps, key=KEY):
    """Run `steps` steps; each takes costs[threads it ran with]. Returns the thread counts used."""
    used = []
    for _ in range(steps):
        n = ctl.choose(key)
        clock.now += costs[n]
        ctl.record(key, n, costs[n])
        used.append(n)
    return used


def test_a_busy_core_makes_the_controller_drop_a_thread():
    clock = FakeClock()
    ctl = ThreadController(2, clock=clock)
    quiet = simulate(ctl, clock, QUIET, 400)
    assert ctl.threads == 2 and quiet[-50:] == [2] * 50
    assert quiet.count(1) <= 0.03 * len(quiet)       # probing costs little on a quiet machine
    busy = simulate(ctl, clock, BUSY, 100)
    # The jump in step time triggers a probe of fewer threads, which wins at once.
    assert ctl.threads == 1 and busy[12:].count(2) <= 2
    assert sum(BUSY[n] for n in busy) < 0.4 * 100 * BUSY[2]


def test_losing_probes_stop_early_and_back_off_by_their_cost():
    clock = FakeClock()
    ctl = ThreadController(2, clock=clock, budget=0.02, max_interval_s=60.0)
    simulate(ctl, clock, BUSY, 20)
    assert ctl.threads == 1
    start, used = clock.now, simulate(ctl, clock, BUSY, 4000)   # ~2 minutes of contended steps
    probe_steps = used.count(2)
    assert probe_steps >= 1                        # it does look again now and then ...
    # ... one step per probe (twice the baseline: stop), at most `budget` of the time lost.
    lost = probe_steps * (BUSY[2] - BUSY[1])
    assert lost <= 0.02 * (clock.now - start) + BUSY[2]
    assert ctl.threads == 1


def test_cores_coming_back_are_noticed_through_the_load_hint():
    def contended_then_quiet(hint):
        clock, free = FakeClock(), [2.0]
        ctl = ThreadController(2, clock=clock, load_hint=(lambda: free[0]) if hint else None)
        simulate(ctl, clock, QUIET, 50)
        free[0] = 1.0                              # another process takes a core
        simulate(ctl, clock, BUSY, 2000)           # a minute: losing probes back off
        assert ctl.threads == 1
        free[0] = 2.0                              # ... and leaves
        return ctl, clock, free, simulate(ctl, clock, QUIET, 300)   # 8.4 s

    ctl, clock, free, used = contended_then_quiet(hint=True)
    assert ctl.threads == 2 and used[-150:] == [2] * 150
    # A wrong hint is probed once, not on every step: timings decide.
    free[0] = 1.0
    used = simulate(ctl, clock, QUIET, 1000)
    assert ctl.threads == 2 and used.count(1) <= 0.03 * len(used)
    # Without the hint, only the rate-limited periodic probe would find the free core, later.
    assert contended_then_quiet(hint=False)[0].threads == 1


def test_steps_of_different_shapes_are_compared_only_with_their_own_shape():
    clock = FakeClock()
    ctl = ThreadController(2, clock=clock)
    for _ in range(300):                           # batch 1 and batch 8 steps interleaved
        for key, scale in (((True, 1), 1.0), ((True, 8), 2.5)):
            n = ctl.choose(key)
            clock.now += QUIET[n] * scale
            ctl.record(key, n, QUIET[n] * scale)
    assert ctl.threads == 2 and ctl.switches == 0
    simulate(ctl, clock, BUSY, 3, key=(True, 8))      # contention seen on batch-8 steps ...
    assert ctl._probe is not None and ctl._probe["key"] == (True, 8)
    simulate(ctl, clock, BUSY, 20, key=(True, 1))     # ... which stop coming: batch 1 takes over the probe
    assert ctl.threads == 1


def test_untimed_steps_and_a_disabled_controller_keep_the_thread_count(monkeypatch):
    clock = FakeClock()
    off = ThreadController(2, clock=clock, enabled=False)
    assert simulate(off, clock, BUSY, 50) == [2] * 50
    one = ThreadController(1, clock=clock)         # nothing to choose from
    assert simulate(one, clock, {1: 0.03}, 10) == [1] * 10
    ctl = ThreadController(2, clock=clock)
    simulate(ctl, clock, BUSY, 20)
    assert ctl.choose(None) == ctl.threads == 1    # prefill steps follow the decode decision
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not adaptive_threads_enabled(None)
    monkeypatch.delenv(ENV_SWITCH)
    assert adaptive_threads_enabled(None)
    assert not adaptive_threads_enabled(type("Cfg", (), {"adaptive_threads": False})())


def test_load_hint_reads_this_machine():
    free = CpuLoadHint()()
    assert free is None or 0.0 <= free <= len(CpuLoadHint().cpus)


# ---- the engine runs its steps with the chosen thread count --------------------------------

def _contended_engine(fused: bool):
    llm = LLM("tiny-llama", num_kv_blocks=32, fused_decode=fused, device="cpu")
    runner = llm.llm_engine.runner
    clock = FakeClock()
    runner.threads = ThreadController(2, clock=clock)
    return llm, runner, clock


@needs_cc
def test_fused_kernel_runs_its_parallel_regions_with_the_chosen_threads():
    llm, runner, clock = _contended_engine(fused=True)
    inner, teams = runner.fused, []

    class Timed:   # each step "takes" what a busy core makes a team of that size take
        def supports(self, query_lens):
            return inner.supports(query_lens)

        def __call__(self, *args):
            out = inner(*args)
            teams.append(inner.last_team_size)
            clock.now += BUSY[inner.last_team_size]
            return out

    runner.fused = Timed()
    before = torch.get_num_threads()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40
    assert teams[0] == 2 and teams[-20:] == [1] * 20 and runner.threads.threads == 1
    assert torch.get_num_threads() == before       # the caller's setting is left as it was


def test_pytorch_path_runs_with_the_chosen_threads():
    llm, runner, clock = _contended_engine(fused=False)
    model, seen = runner.model, []

    def timed_model(*args):
        seen.append(torch.get_num_threads())
        clock.now += BUSY[seen[-1]]
        return model(*args)

    runner.model = timed_model
    before = torch.get_num_threads()
    llm.generate({"prompt_token_ids": [5, 6, 7]},
                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert seen[1] == 2 and seen[-20:] == [1] * 20 and runner.threads.threads == 1
    assert torch.get_num_threads() == before


@needs_cc
def test_kernel_team_size_follows_the_argument_and_results_do_not_depend_on_it():
    llm = LLM("tiny-llama", num_kv_blocks=8, fused_decode=True, device="cpu")
    fused = llm.llm_engine.runner.fused
    args = (torch.tensor([1]), torch.tensor([3]), torch.tensor([[0]]), torch.tensor([0]))
    one = fused(*args, 1)
    assert fused.last_team_size == 1
    two = fused(*args, 2)
    assert fused.last_team_size == 2
    fused(*args)                                   # 0: PyTorch's thread count
    assert fused.last_team_size == torch.get_num_threads()
    # Threads split output rows, never a dot product: the logits are bit-identical.
    assert torch.equal(one, two)


def test_adaptive_threads_is_a_validated_engine_argument(monkeypatch):
    from minserve.config import EngineConfig
    with pytest.raises(ValueError, match="adaptive_threads must be True or False"):
        EngineConfig(adaptive_threads="yes")
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert adaptive_threads_enabled(EngineConfig()) and not adaptive_threads_enabled(
        EngineConfig(adaptive_threads=False))
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not adaptive_threads_enabled(EngineConfig())
