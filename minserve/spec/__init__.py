"""Speculative decoding: proposers and the exact verification of their proposals."""


def make_speculation(config):
    """The proposer and the adaptive rule for a parsed ``speculative_config`` (None, None without)."""
    if config is None:
        return None, None
    from minserve.spec.adaptive import AdaptiveSpeculation
    from minserve.spec.ngram import NgramProposer
    return NgramProposer(config), AdaptiveSpeculation(enabled=config.adaptive)
