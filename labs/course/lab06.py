"""Lab 06 (speculative decoding): the three workloads, side-by-side runs of plain and speculative
decoding on the same prompts, the live board that shows them, and the exercises' checks. The
notebook imports this module as ``ex``; the code lives in one module per concept:

- lab06_workloads.py: the workloads, their prompts, the engines (``make_engine``, ``spec_config``);
- lab06_measure.py: the counters, side-by-side runs, ``compare`` and its table;
- lab06_model.py: tokens per step from acceptance, acceptance by position, the roofline;
- lab06_board.py: the live board and the explorer panel;
- lab06_checks.py: the exercises' checks.

How a comparison is measured (:func:`compare`, after ``benchmarks/bench_spec.py``): two engines
that differ only in ``speculative_config`` get the same group of prompts, greedy, and are stepped
*in turn*, one step each, so that a burst of other work on a shared machine slows both alike.
Each engine's step records give its own time; only decode-only steps count (a prefill chunk is the
same work for both and would blur the comparison). From them:

- speed-up: output tokens per second of decode-only steps, speculative over plain (a step many
  times slower than its neighbours is capped, :func:`steady_time`, so that a hiccup of a shared
  machine does not decide the result);
- tokens per target step: output tokens a request got per forward pass of the target model;
- verify cost: the median time of a step that verified proposals over that of a plain step;
- the vLLM counters' deltas: drafts, draft tokens, accepted tokens, and accepted tokens by position.
"""

# The notebook's and the tests' names, from the modules that define them.
from course.lab06_board import Board, Explorer, panel  # noqa: F401
from course.lab06_checks import (  # noqa: F401
    q1_identical, q2_best_workload, q3_tokens_per_step, q4_speedup, q5_stops_paying)
from course.lab06_measure import (  # noqa: F401
    PER_POS, EngineRun, Pair, _zero, compare, decode_steps, run_side_by_side, spec_counters,
    steady_time, table)
from course.lab06_model import (  # noqa: F401
    adaptive_cost, contention_note, expected_tokens, explain_gaps, model_gaps, per_position,
    roofline_costs, roofline_curve, rule_stops, stops_paying)
from course.lab06_workloads import (  # noqa: F401
    WORKLOAD_TEXT, WORKLOADS, conversations, make_engine, prompt_ids, spec_config)
