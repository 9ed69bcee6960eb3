"""Nano-vLLM: a small, fast LLM inference engine with vLLM's offline API."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
