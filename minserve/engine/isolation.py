"""Running a step so that one request's fault stays that request's own.

Two kinds of fault, two costs. A request whose constraints leave nothing to sample (allowed ids,
bad words, ``min_tokens`` and a grammar that together forbid every token) is found by the sampler
row by row: the runner returns it in ``errors`` (and ``client_errors``: the client asked for the
impossible) beside the other requests' tokens, in the same single pass. Anything else that raises
out of the step (a bug, bad data no check foresaw) says nothing of whose it is, so each request is
rerun alone to find out: writing the same K/V into the same slots again is harmless; a seeded
request's noise is keyed by its output position (engine/draws.py), and the draft method's
stream is rewound first, so a retried request samples exactly what it would have. That costs
the step's neighbours one serial pass, which is why the foreseeable faults never take this path.
"""

from __future__ import annotations

import logging

from minserve.engine.step_io import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("minserve")


def execute_isolating_faults(runner, kv, sched: SchedulerOutput) -> ModelRunnerOutput:
    """``runner.execute(sched, kv)``; if it raises, every request of the step alone."""
    rngs = {r.request_id: r.generator.get_state() for s in sched.scheduled if s.needs_sampling
            for r in (s.request, *s.forks) if r.generator is not None}
    try:
        return _runner_output(runner.execute(sched, kv))
    except Exception as e:
        if len(sched.scheduled) == 1:
            return ModelRunnerOutput(errors={sched.scheduled[0].request.request_id: f"{type(e).__name__}: {e}"})
        log.warning("step of %d requests failed (%s: %s); retrying them one by one",
                    len(sched.scheduled), type(e).__name__, e)
    out = ModelRunnerOutput()
    for s in sched.scheduled:
        for r in (s.request, *s.forks):
            if r.request_id in rngs:
                r.generator.set_state(rngs[r.request_id])
        try:
            alone = _runner_output(runner.execute(SchedulerOutput(scheduled=[s]), kv))
        except Exception as e:
            out.errors[s.request.request_id] = f"{type(e).__name__}: {e}"
            continue
        out.sampled.update(alone.sampled)
        out.errors.update(alone.errors)
        out.client_errors |= alone.client_errors
        out.prompt_logprobs.update(alone.prompt_logprobs)
    return out


def _runner_output(out) -> ModelRunnerOutput:
    """A runner's result; a stand-in runner (a test's) may return the bare ``sampled`` dict."""
    return out if isinstance(out, ModelRunnerOutput) else ModelRunnerOutput(out)
