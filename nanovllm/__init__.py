"""Nano-vLLM: a small, fast LLM inference engine with vLLM's offline API."""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchSequence
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "Logprob", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
