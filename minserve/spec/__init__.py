"""Speculative decoding: proposers and the exact verification of their proposals."""
