"""Each lab's exercises, built from that lab's measurements (``lab00``, ``lab01``, ...).

They live here rather than in the notebooks so a learner does not read the answer while reading
the question; ``q.solution()`` shows the reference code when asked.
"""
