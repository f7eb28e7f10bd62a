"""Prompt-lookup (n-gram) proposals: guess the next tokens by finding the request's latest tokens
earlier in its own text, and proposing what followed them there.

Copy-heavy work (editing or summarizing a document in the prompt, code refactoring, quoting)
repeats long runs of the prompt, so the guess is often right for several tokens; free-form chat
rarely repeats, so lookups mostly find nothing and nothing is proposed. The search tries the
longest suffix first (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) and takes the
latest earlier occurrence, the one most likely to continue the same way.

The search runs in C: tokens are kept as 4-byte integers in a bytes buffer and ``bytes.rfind``
scans it (a match must start on a 4-byte boundary to be a token match). A Python loop over a few
thousand tokens per request per step would cost more than the step it tries to save.
"""

from __future__ import annotations

from array import array

from minserve.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min
        self._buffers: dict[str, tuple[int, bytearray]] = {}  # request id -> (tokens in it, bytes)

    def propose(self, req) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the request's last n
        tokens (n from n_max down to n_min); [] when none occurs."""
        data = self._tokens_bytes(req)
        total = len(data) // 4
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            # An earlier occurrence with at least one token after it: it ends by token total - 1.
            at = _rfind_aligned(data, bytes(data[(total - n) * 4:]), (total - 1) * 4)
            if at is not None:
                start = at // 4 + n
                return array("i", data[start * 4:min(total, start + self.k) * 4]).tolist()
        return []

    def propose_batch(self, reqs: list) -> list[list[int]]:
        """The engine's interface: each request's proposals, in order (lookups are per request)."""
        return [self.propose(r) for r in reqs]

    def _tokens_bytes(self, req) -> bytearray:
        """The request's tokens as int32 bytes, extended by its new tokens since the last call."""
        seen, buf = self._buffers.get(req.request_id, (0, bytearray()))
        if seen > req.num_tokens:  # cannot happen for a live request; start over to be safe
            seen, buf = 0, bytearray()
        buf += array("i", req.token_ids(seen, req.num_tokens)).tobytes()
        self._buffers[req.request_id] = (req.num_tokens, buf)
        return buf

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)


def _rfind_aligned(data: bytearray, pattern: bytes, hi: int) -> int | None:
    """Byte offset of the latest occurrence of ``pattern`` inside ``data[:hi]`` that starts on a
    4-byte boundary (a whole-token match), or None."""
    while True:
        at = data.rfind(pattern, 0, hi)
        if at < 0:
            return None
        if at % 4 == 0:
            return at
        hi = at + len(pattern) - 1
