"""Speculative decoding (E20): proposers draft tokens, one target pass verifies them.
docs/speculative-handoff.md says how the pieces fit and how a decode node's draft head takes over
a prefill node's hidden states.

decoder.py     SpeculativeDecoder: the one interface the engine calls, and what crosses it
speculator.py  Speculator, the decoder: draft lengths, verification, emission, rollback, counters
proposers/     what drafts: n-gram, eagle head, self-draft, draft model (one module each)
loader.py      make_speculator: the config's proposer and what it loads
handoff.py     ContextTails: a prefill node's last hidden states for the context record
config.py      SpeculativeConfig (--speculative-config)
ngram.py       prompt-lookup matching
rejection.py   speculative rejection sampling for drafts with a distribution
control.py     how many draft tokens pay for their share of the pass
eagle.py       deprecated: the draft head moved to pdserve.model.eagle_head / eagle_config
"""
