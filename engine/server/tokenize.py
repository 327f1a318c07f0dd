"""POST /tokenize, POST /detokenize, GET /tokenizer_info, as vLLM serves them: clients that
count tokens or build token-id prompts (lm-eval's remote tokenizer) use the server's own
tokenizer instead of loading one."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..chat import encode_chat
from .errors import bad_request
from .schemas import Message
from .state import ServerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True       # prompt: put BOS first, as completions do
    add_generation_prompt: bool = True    # messages: end with the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def unsupported(self):
        return None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]

    def unsupported(self):
        return None


def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if req.prompt is not None:
        ids = state.tokenizer.encode(req.prompt, add_bos=req.add_special_tokens)
    else:
        kw = req.chat_template_kwargs or {}
        thinking = kw.get("thinking", False)
        if not isinstance(thinking, bool):
            raise bad_request("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
        try:
            ids = encode_chat(state.tokenizer, [m.model_dump(exclude_unset=True) for m in req.messages],
                              thinking=thinking, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
    strs = [state.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    if any(not 0 <= t < state.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {state.vocab_size})", "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def tokenizer_info(state: ServerState) -> dict:
    tok = state.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token": None,
            "add_bos_token": True, "model_max_length": state.max_model_len, "vocab_size": state.vocab_size,
            "chat_template": None}  # the chat format is DeepSeek-V4's encoder (engine.chat), not a template
