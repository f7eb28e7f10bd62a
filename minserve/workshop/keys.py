"""API keys for a workshop over one server: one key per participant, one admin key for the instructor.

``minserve serve --api-keys-file`` (:mod:`minserve.server.auth`) makes the key decide who a request
belongs to: its tenant's quota (``--tenant-max-inflight``), its tenant's prefix cache (a participant
only ever hits blocks its own prompts filled) and whether it may read ``/metrics`` (admin only: the
server-wide counters there move with everyone's traffic). This module writes such a file for N
participants, and apart from it the handout: who gets which key.

The server's file holds only SHA-256 digests (``key_sha256``), so the keys are not on the server's
disk; the plaintext keys are in the handout alone, for the instructor to hand out::

    python -m minserve.workshop.keys --participants 20 --out keys.json --handout handout.csv
    minserve serve --host 0.0.0.0 --api-keys-file keys.json --tenant-max-inflight 4

One key per tenant: a participant who loses a key gets a new file and the server a restart (a key
file is read once, at start-up).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import secrets
import sys
from pathlib import Path

INSTRUCTOR = "instructor"


def participant_names(n: int) -> list[str]:
    """``participant-01`` ... ``participant-NN``: zero-padded so they sort in order."""
    if n < 1:
        raise ValueError(f"participants must be >= 1, got {n}")
    width = max(2, len(str(n)))
    return [f"participant-{i:0{width}d}" for i in range(1, n + 1)]


def make_keys(names: list[str], instructor: str | None = INSTRUCTOR) -> tuple[dict, dict[str, str]]:
    """``(keys file document, handout)`` for tenants ``names`` plus, unless None, an admin tenant
    ``instructor``. The handout maps each tenant to its plaintext key; the document holds digests."""
    tenants = list(names) + ([instructor] if instructor else [])
    if len(set(tenants)) != len(tenants) or not all(t and t == t.strip() for t in tenants):
        raise ValueError("participant names must be distinct, non-empty and without surrounding "
                         f"spaces (and differ from the instructor's {instructor!r})")
    handout = {t: "sk-" + secrets.token_urlsafe(24) for t in tenants}  # 192 random bits each
    entries = [{"key_sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": t,
                **({"admin": True} if t == instructor else {})} for t, key in handout.items()]
    return {"keys": entries}, handout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minserve.workshop.keys",
                                 description="Write a keys file for `minserve serve --api-keys-file` "
                                             "and the handout of plaintext keys.")
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--participants", type=int, help="how many (tenants participant-01, ...)")
    who.add_argument("--names", help="comma list of tenant names instead")
    ap.add_argument("--out", default="keys.json", help="the server's keys file (digests only)")
    ap.add_argument("--handout", default="handout.csv", help="tenant,key per line (keep it private)")
    a = ap.parse_args(argv)
    try:
        names = (participant_names(a.participants) if a.names is None
                 else [n.strip() for n in a.names.split(",")])
        doc, handout = make_keys(names)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    # Owner-only from its creation (and if it existed, before the keys go in).
    fd = os.open(a.handout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.chmod(a.handout, 0o600)
    with os.fdopen(fd, "w", newline="") as f:
        csv.writer(f).writerows([("tenant", "key"), *handout.items()])
    print(f"{a.out}: {len(doc['keys'])} keys ({len(names)} participants + {INSTRUCTOR!r}, admin); "
          f"{a.handout}: the plaintext keys, to hand out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
