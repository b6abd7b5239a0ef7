"""swaserve: an LLM serving engine that makes sliding windows first-class."""

from swaserve.engine.engine import Engine
from swaserve.outputs import CompletionOutput, Logprob, RequestOutput
from swaserve.sampling.params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
