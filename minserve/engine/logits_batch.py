"""The engine side of logits processors: rows kept at stable indices, and the processors applied.

The model runner gives :class:`LogitsProcessors` each step's sampling rows in its own order (the
scheduled requests, a verify step's k + 1 rows each, forked samples last). Processors index their
state by row, so each row is kept at one *slot* for as long as it samples: a row that is gone
frees its slot, a new row takes the lowest free slot, and the batch is then made dense again by
moving the highest rows into the holes (vLLM's condense). The logits are gathered into slot order
for the processors and scattered back, so the sampler never sees the difference.

A row is named by (request id, its place in a verify step) and bound to the request's params and
output list; when either object changes (a verify row's list is built per step) the row is
re-added in its slot. See engine/logits_processor.py for what processors see and when.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.engine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from minserve.sampling_params import SamplingParams


@dataclass
class ProcessorRow:
    key: tuple                 # (request id, index of the row in the request's verify step)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    def same_binding(self, other: "ProcessorRow") -> bool:
        return self.params is other.params and self.output_token_ids is other.output_token_ids


def processor_rows(reqs: list, proposed_before: list[list[int]]) -> list[ProcessorRow]:
    """One ProcessorRow per logits row: row j of a verify step sees the output and the j
    proposals before it (a new list); any other row sees the request's own output list."""
    return [ProcessorRow((r.request_id, len(ahead)), r.params, r.prompt_token_ids,
                         r.output_token_ids + ahead if ahead else r.output_token_ids)
            for r, ahead in zip(reqs, proposed_before)]


class RowSlots:
    """Which row sits at which index of the processors' batch, and the BatchUpdate of each step."""

    def __init__(self) -> None:
        self.slots: list[ProcessorRow | None] = []
        self.index: dict[tuple, int] = {}

    def update(self, rows: list[ProcessorRow]) -> tuple[BatchUpdate | None, list[int]]:
        """Place this step's rows; return the update (None: same rows as last step) and, per
        slot, the row it holds (the gather order)."""
        wanted = {row.key: row for row in rows}
        removed = []
        for key, slot in list(self.index.items()):
            row = wanted.get(key)
            if row is None or not row.same_binding(self.slots[slot]):
                removed.append(slot)
                self.slots[slot] = None
                del self.index[key]
        holes = sorted(removed, reverse=True)  # pop() takes the lowest
        added = []
        for row in rows:
            if row.key in self.index:
                continue
            slot = holes.pop() if holes else len(self.slots)
            if slot == len(self.slots):
                self.slots.append(None)
            self.slots[slot] = row
            self.index[row.key] = slot
            added.append((slot, row.params, row.prompt_token_ids, row.output_token_ids))
        moved = self._condense(len(rows))
        update = BatchUpdate(len(rows), removed, added, moved) if removed or added or moved else None
        position = {row.key: i for i, row in enumerate(rows)}
        return update, [position[row.key] for row in self.slots]

    def _condense(self, size: int) -> list[tuple[int, int, MoveDirectionality]]:
        """Move the highest occupied slots into the holes below ``size``; drop the tail."""
        holes = [s for s in range(size) if self.slots[s] is None]
        tail = [s for s in range(len(self.slots) - 1, size - 1, -1) if self.slots[s] is not None]
        moved = []
        for hole, src in zip(holes, tail):
            row = self.slots[src]
            self.slots[hole], self.slots[src] = row, None
            self.index[row.key] = hole
            moved.append((src, hole, MoveDirectionality.UNIDIRECTIONAL))
        del self.slots[size:]
        return moved


class LogitsProcessors:
    """An engine's processor instances and their row slots; built only when some are configured."""

    def __init__(self, classes: list[type[LogitsProcessor]], config, device: torch.device):
        pin = device.type == "cuda"
        self.processors = [cls(config, device, pin) for cls in classes]
        self.argmax_invariant = [p.is_argmax_invariant() for p in self.processors]
        self.slots = RowSlots()
        self._order: list[int] = []

    def update(self, rows: list[ProcessorRow]) -> None:
        """Tell every processor how this step's rows differ from the last step's."""
        update, self._order = self.slots.update(rows)
        for p in self.processors:
            p.update_state(update)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The processed copy of ``logits`` (the rows of the last :meth:`update`, in its order);
        ``logits`` itself is never changed (the sampler's logprobs read it)."""
        all_greedy = all(p.is_greedy for p in params)
        active = [p for p, inv in zip(self.processors, self.argmax_invariant) if not (inv and all_greedy)]
        identity = self._order == list(range(len(self._order)))
        x = logits.clone() if identity else logits[self._order]
        for p in active:
            x = p.apply(x)
        if identity:
            return x
        out = torch.empty_like(x)
        out[self._order] = x
        return out
