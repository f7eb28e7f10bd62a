"""Speculative decoding: proposers and the exact verification of their proposals."""


def make_speculation(config, engine):
    """The proposer and the adaptive rule for a parsed ``speculative_config`` (None, None without).
    ``engine``: the LLMEngine being built (a draft model sizes its KV pool and runner from it)."""
    if config is None:
        return None, None
    from minserve.spec.adaptive import AdaptiveSpeculation
    if config.method == "draft_model":
        from minserve.spec.draft import DraftModelProposer
        proposer = DraftModelProposer(config, engine)
    else:
        from minserve.spec.ngram import NgramProposer
        proposer = NgramProposer(config)
    return proposer, AdaptiveSpeculation(enabled=config.adaptive)
