"""Sampling (E19): the batched token sampler and the incremental detokenizer with stop strings."""

from pdserve.engine.sampling.detokenizer import DetokenizerStep, IncrementalDetokenizer, special_token_ids
from pdserve.engine.sampling.sampler import SampleLogprobs, Sampler, SamplerOutput, TokenLogprob, token_seed

__all__ = [
    "DetokenizerStep",
    "IncrementalDetokenizer",
    "SampleLogprobs",
    "Sampler",
    "SamplerOutput",
    "TokenLogprob",
    "special_token_ids",
    "token_seed",
]
