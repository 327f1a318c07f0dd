"""A from-scratch decode engine for DeepSeek-V4-Flash.

    from engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")          # no path: the embedded tiny checkpoint
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""
from .sampler import SamplingParams


def __getattr__(name):
    # LLM pulls in the model and tokenizer: import it lazily so `engine.sampler` etc. stay light.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from . import core

        return getattr(core, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
