"""pdserve: disaggregated prefill/decode LLM serving.

    from pdserve import LLM, SamplingParams
    outs = LLM().generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
"""

from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing pdserve must not load torch models
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
