"""Speculative-decoding counters, under vLLM's names.

- ``vllm:spec_decode_num_drafts``: verify attempts (one per request per step that had proposals);
- ``vllm:spec_decode_num_draft_tokens``: proposals verified;
- ``vllm:spec_decode_num_accepted_tokens``: proposals the model accepted;
- ``vllm:spec_decode_num_accepted_tokens_per_pos{position=i}``: attempts whose i-th proposal was
  accepted (so position 0 over drafts is the acceptance rate of the first guess, and the curve
  shows how fast confidence decays along a proposal).
Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts.

``LLMEngine.snapshot()`` gives the per-position counter as Prometheus does: one value per label,
``vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}``, and, under the bare name, their
sum over positions (what PromQL's ``sum()`` gives), which equals the accepted tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from minserve.spec.config import MAX_SPECULATIVE_TOKENS


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 max_positions: int = MAX_SPECULATIVE_TOKENS):
        labels = ["model_name"]

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        self._drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self._draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self._accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", labels + ["position"], registry=registry)
        self._per_pos = [per_pos.labels(model_name, str(i)) for i in range(max_positions)]

    def by_position(self) -> dict[str, float]:
        """Snapshot entries of the per-position counter, one per position label (as exported)."""
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        return {f'{name}{{position="{i}"}}': c._value.get() for i, c in enumerate(self._per_pos)}

    def record(self, verified: list[tuple[int, int]]) -> None:
        """``verified``: (proposals, accepted) of each request verified in a step."""
        if not verified:
            return
        self._drafts.inc(len(verified))
        self._draft_tokens.inc(sum(p for p, _ in verified))
        self._accepted.inc(sum(a for _, a in verified))
        for _, accepted in verified:
            for pos in range(min(accepted, len(self._per_pos))):
                self._per_pos[pos].inc()
