"""`POST /tokenize` and `POST /detokenize` request contracts, in vLLM's shapes (strict allow-list)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from gateway.contracts.chat import ChatTemplateKwargs
from gateway.contracts.chat_messages import ChatMessage
from gateway.contracts.common import ContractModel, NonEmptyStr, validate_body, violation
from gateway.contracts.tools import MAX_TOOLS, Tool
from gateway.domain import TokenizerTask

MAX_DETOKENIZE_IDS = 1_000_000


class TokenizeRequest(ContractModel):
    """vLLM's two forms: `{model, prompt}` (raw text) or `{model, messages}` (through the chat template)."""

    model: NonEmptyStr
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true with a prompt, false with messages (vLLM)
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None  # messages only; default false
    return_token_strs: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if self.prompt is not None and self.messages is not None:
            raise violation("cannot be combined with 'prompt'; send one of them", "messages")
        if self.prompt is None and self.messages is None:
            raise violation("is required (or 'messages', for chat)", "prompt")
        if self.prompt is not None:
            for key in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
                if getattr(self, key) is not None:
                    raise violation("is allowed only with 'messages'", key)
        if self.add_generation_prompt and self.continue_final_message:
            raise violation("cannot be combined with 'add_generation_prompt: true'", "continue_final_message")
        return self

    def task(self) -> TokenizerTask:
        chat = self.messages is not None
        options: dict[str, Any] = {
            "add_special_tokens": self.add_special_tokens if self.add_special_tokens is not None else not chat,
            "return_token_strs": bool(self.return_token_strs),
        }
        if chat:
            continue_final = bool(self.continue_final_message)
            options["add_generation_prompt"] = (self.add_generation_prompt if self.add_generation_prompt is not None
                                                else not continue_final)
            options["continue_final_message"] = continue_final
            if self.chat_template_kwargs is not None:
                options["chat_template_kwargs"] = self.chat_template_kwargs.model_dump(exclude_none=True)
            if self.tools:
                options["tools"] = [t.as_dict() for t in self.tools]
            return TokenizerTask(messages=tuple(m.as_dict() for m in self.messages or ()), options=options)
        return TokenizerTask(prompt=self.prompt, options=options)


class DetokenizeRequest(ContractModel):
    model: NonEmptyStr
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_DETOKENIZE_IDS)]

    def task(self) -> TokenizerTask:
        return TokenizerTask(detokenize=tuple(self.tokens))


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    return validate_body(TokenizeRequest, body)


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    return validate_body(DetokenizeRequest, body)
