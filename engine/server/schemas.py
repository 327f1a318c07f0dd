"""Request bodies of the OpenAI API, as far as this engine reads them.

Unknown fields are ignored (clients send vendor extras). Known OpenAI fields the engine
cannot honour are declared here only so `unsupported()` can refuse them by name: a
request must never get a silently different answer than the one it asked for.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None              # vLLM extension
    min_p: float | None = None            # vLLM extension
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    ignore_eos: bool = False              # vLLM extension
    prompt_logprobs: int | None = None    # vLLM extension: per prompt token, with this many alternatives
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None               # accepted, not used

    # known, not honoured
    logit_bias: dict[str, float] | None = None
    store: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something this engine cannot do."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.store:
            return "store", "store=true is not supported (this server keeps no completions)"
        return None


class CompletionRequest(_Sampling):
    # smart-mode union: each form matches its exact type first
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of must equal n ({self.n}): ranking candidates is not supported"
        return super().unsupported()


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    """One chat message, typed as OpenAI types it (a tool_call_id that is an object is a 400,
    not a crash in the encoder); engine.chat reads it back as a dict, vendor keys kept."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: FunctionDef


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: only the first call is returned
    chat_template_kwargs: dict[str, Any] | None = None  # thinking, reasoning_effort
    reasoning_effort: str | None = None

    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    def message_dicts(self) -> list[dict]:
        """The messages as the client sent them (typed fields checked; vendor keys kept)."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump(exclude_unset=True) for t in self.tools]

    def unsupported(self) -> tuple[str, str] | None:
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            return "response_format", f"response_format {fmt!r} is not supported (only 'text')"
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice must be 'auto' or 'none': forcing a tool call is not supported"
        if self.functions is not None or self.function_call is not None:
            param = "functions" if self.functions is not None else "function_call"
            return param, f"{param} is deprecated and not supported; use tools"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        if self.modalities is not None and list(self.modalities) != ["text"]:
            return "modalities", "only the 'text' modality is supported"
        if self.prediction is not None:
            return "prediction", "predicted outputs are not supported"
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported"
        return super().unsupported()
