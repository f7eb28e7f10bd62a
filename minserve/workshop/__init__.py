"""Workshop mode: many participants, one box. ``prepare`` fills a cache that sessions only read;
``doctor`` checks a session (the first cell of every lab runs ``doctor.run_checks(short=True)``).
See docs/workshop.md."""

from minserve.workshop.doctor import Check, checks_frame, format_checks, run_checks
from minserve.workshop.prepare import Step, prepare

__all__ = ["run_checks", "format_checks", "checks_frame", "Check", "prepare", "Step"]
