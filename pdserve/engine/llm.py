"""The offline Python API: `LLM(model=None, **engine_options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput
from pdserve.engine.sampling_params import SamplingParams


class LLM:
    """A single-process engine for batch generation.

    model: a local Hugging Face checkpoint directory or .gguf file; None = the default model
    (SmolLM2-135M-Instruct). engine_options: any EngineConfig / CacheConfig / SchedulerConfig field
    (dtype, num_threads, page_size, num_blocks, max_batch_tokens, max_requests_per_batch,
    scheduler_type, safety_margin, max_memory_percent, max_model_len, tensor_parallel_size, ...).
    `close()` (or a with block) stops tensor-parallel worker ranks; they also stop at exit.
    """

    def __init__(self, model: str | None = None, kv_connector: KvConnector | None = None,
                 **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options), kv_connector)

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker ranks (nothing at TP 1; also done at exit)."""
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; one CompletionOutput per prompt, in order.

        A prompt is a string (tokenized as the tokenizer does by default, no chat template) or a
        list of token ids. Invalid prompts or parameters raise ValueError before anything runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for p in prompts:  # validate everything before queueing anything
            self._validate_prompt(p)
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, CompletionOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    done[out.request_id] = out.completion
        return [done[i] for i in ids]

    def _validate_prompt(self, prompt: object) -> None:
        ids = self.engine.tokenize(prompt)  # raises for bad token ids
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {self.engine.max_model_len}")
