"""Speculative decoding (E20): proposers draft tokens, one target pass verifies them.

config.py     SpeculativeConfig (--speculative-config)
ngram.py      prompt-lookup proposer
rejection.py  speculative rejection sampling for drafts with a distribution
control.py    how many draft tokens pay for their share of the pass
eagle.py      the EAGLE-style draft head (`pdserve draft train` trains one)
speculator.py what the engine calls: proposals before scheduling, acceptance after the pass;
              the proposers (n-gram, self-draft, draft model, eagle head)
"""
