"""Speculative decoding (E20): proposers draft tokens, one target pass verifies them.

config.py     SpeculativeConfig (--speculative-config)
ngram.py      prompt-lookup proposer
rejection.py  speculative rejection sampling for drafts with a distribution
speculator.py what the engine calls: proposals before scheduling, acceptance after the pass
"""
