"""When speculation pays, measured rather than assumed.

A verify step costs more than a plain decode step (k more rows through every layer) and pays only
if enough proposals are accepted. At batch 1 on a CPU the step is bound by reading the weights, so
extra rows are nearly free and a 50 % acceptance rate already wins; in a large batch the rows are
no longer free (the arithmetic, not the weight stream, sets the pace) and the same acceptance rate
loses. Rather than model that, the controller measures it: per batch-size bucket it keeps the
output tokens per second of decode steps with proposals and of decode steps without, and proposes
while the first is at least the second. Every ``probe_every`` steps it does the other thing once,
so that a stale estimate (the workload changed) gets corrected. Only decode-only steps count:
a prefill chunk in a step makes its time incomparable.

Re-enabling must be quick, or a batch that shrank back to where speculation pays would decode
plainly for a long time on an old verdict. Two rules see to it: when the batch shrinks into
another bucket, the side not chosen is probed at once (the bucket's estimates may date from a
different workload); and a probe's measurement replaces a stale estimate (one not updated within
the last ``probe_every`` steps) instead of nudging it by ``smoothing``, so a single probe that wins
flips the choice.
"""

from __future__ import annotations


def _bucket(batch: int) -> int:
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


class AdaptiveSpeculation:
    def __init__(self, enabled: bool = True, probe_every: int = 16, smoothing: float = 0.2):
        self.enabled = enabled
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.rate: dict[tuple[int, bool], float] = {}   # (bucket, with proposals) -> tokens / s
        self._updated: dict[tuple[int, bool], int] = {}  # the step each estimate was last updated
        self._steps = 0
        self._last_bucket: int | None = None
        self.last_choice = True

    def should_propose(self, batch: int) -> bool:
        """Whether this step's decoding requests should get proposals."""
        if not self.enabled:
            return True
        self._steps += 1
        b = _bucket(batch)
        shrank = self._last_bucket is not None and b < self._last_bucket
        self._last_bucket = b
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if spec is None or plain is None:
            choice = spec is None  # measure the side not seen yet (proposals first)
        else:
            choice = spec >= plain
            if shrank or self._steps % self.probe_every == 0:
                choice = not choice  # refresh the other side's estimate
        self.last_choice = choice
        return choice

    def record(self, stats, batch: int) -> None:
        """Fold a finished decode-only step (its StepStats) into the estimates."""
        if not self.enabled or stats.num_prefill_tokens or not stats.num_decode_tokens or batch == 0:
            return
        with_proposals = stats.num_spec_tokens > 0
        produced = stats.num_decode_tokens - stats.num_spec_tokens + stats.num_accepted_spec_tokens
        rate = produced / max(stats.step_time_s, 1e-9)
        key = (_bucket(batch), with_proposals)
        old = self.rate.get(key)
        stale = self._steps - self._updated.get(key, self._steps) >= self.probe_every
        self.rate[key] = rate if old is None or stale else old + self.smoothing * (rate - old)
        self._updated[key] = self._steps
