"""An opened generation: its events under the request's timeouts and the drain deadline, and its one close."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.drain import DeadlineWait, Drain, ShuttingDown
from gateway.endpoint import Endpoint, InFlight
from gateway.errors import GatewayError, MalformedWorkerResponse, UpstreamTimeout, WorkerError, worker_error
from gateway.profile import ModelProfile
from gateway.timeouts import Timeouts
from gateway.triton.client import UpstreamUnavailable

_IMAGE_PARAM = re.compile(r"images\[(\d+)\]")  # how the engine names one of a request's images


@dataclass
class GenerationSession:
    """An opened generation: the first event has arrived; iterate `events()` for all of them."""

    profile: ModelProfile
    request: GenerationRequest
    request_id: str
    claim: InFlight  # the endpoint's in-flight count and the stream; released once, by close()
    first: GenerationEvent
    timeouts: Timeouts
    started: float
    ttft_s: float
    deadline: float
    drain: Drain
    wait: DeadlineWait  # the drain deadline ends it with server_shutting_down (gateway/drain.py)
    outage_retry_after_s: float = 60.0  # one Retry-After for every answer of one Triton outage

    @property
    def endpoint(self) -> Endpoint:
        return self.claim.endpoint

    @property
    def stream(self) -> AsyncGenerator[GenerationEvent, None]:
        return self.claim.stream

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        # A blocking request hears from the engine only at its first token (a progress marker) and when a
        # choice closes: the inter-chunk timeout would cut a long generation, or the wait between the
        # closures of n>1 choices, so only the overall deadline governs it after the first token.
        inter_chunk = self.timeouts.inter_chunk_s if self.request.stream else float("inf")
        try:
            yield self.first
            while True:
                self.wait.check()
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise UpstreamTimeout("the request exceeded the overall timeout", code="overall_timeout")
                try:
                    # asyncio.timeout costs a timer handle; wait_for would cost a task per token
                    async with asyncio.timeout(min(inter_chunk, remaining)) as self.wait.timeout:
                        event = await anext(self.stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if self.wait.cut_short:
                        raise ShuttingDown() from None
                    # which bound was the binding one, not the clock after the fact: a loop timer may fire a
                    # little before the deadline, and that is still the overall timeout
                    if remaining <= inter_chunk:
                        raise UpstreamTimeout("the request exceeded the overall timeout",
                                              code="overall_timeout") from None
                    raise UpstreamTimeout("no output from the model in time", code="inter_chunk_timeout",
                                          status=502) from None
                except asyncio.CancelledError:
                    if we_are_cancelled():
                        raise
                    raise upstream_cancelled() from None
                except UpstreamUnavailable as exc:  # Triton went away mid-request: the outage's Retry-After
                    exc.retry_after = self.outage_retry_after_s
                    raise
                except WorkerError as exc:
                    attribute(exc, self.request, self.attempt_id)
                    raise
                yield event
        finally:
            await self.close()

    @property
    def attempt_id(self) -> str:
        return attempt_id(self.request_id, self.endpoint)

    async def close(self) -> None:
        self.drain.untrack(self.wait)
        await self.claim.release()

    async def collect(self) -> GenerationResult:
        """Accumulate every choice (blocking responses)."""
        choices: dict[int, dict] = {}
        prompt_tokens = cached_tokens = 0
        last_at = time.monotonic()
        engine_timing: tuple[float, float | None] | None = None
        async for event in self.events():
            if event.is_progress:
                continue  # the engine's first-token marker on blocking requests (docs/triton-contract.md)
            if event.ttft_ms is not None and engine_timing is None:
                engine_timing = (event.ttft_ms, event.tpot_ms)
            last_at = time.monotonic()
            choice = choices.setdefault(
                event.index, {"text": [], "finish_reason": None, "logprobs": [], "tool_calls": None,
                              "completion_tokens": 0, "reasoning": []}
            )
            choice["text"].append(event.text)
            if event.logprobs:
                choice["logprobs"].extend(event.logprobs)
            if event.reasoning:
                choice["reasoning"].append(event.reasoning)
            if event.finish_reason is not None:
                choice["finish_reason"] = event.finish_reason
                choice["tool_calls"] = event.tool_calls
                choice["completion_tokens"] = event.completion_tokens
                choice["stop_reason"] = event.stop_reason
            prompt_tokens = max(prompt_tokens, event.prompt_tokens)
            cached_tokens = max(cached_tokens, event.cached_tokens)
        if any(c["finish_reason"] is None for c in choices.values()) or len(choices) < self.request.n:
            raise MalformedWorkerResponse("the model ended without closing every choice")
        for choice in choices.values():
            choice["text"] = "".join(choice["text"])
            choice["reasoning"] = "".join(choice["reasoning"]) or None
        completion = sum(c["completion_tokens"] for c in choices.values())
        if engine_timing is not None:
            # blocking requests get one event per choice: the engine measured the real TTFT/TPOT
            return GenerationResult(choices, prompt_tokens, completion, *engine_timing, cached_tokens=cached_tokens)
        decode_s = max(last_at - self.started - self.ttft_s, 0.0)
        tpot = decode_s / (completion - 1) * 1000 if completion > 1 else None
        return GenerationResult(choices, prompt_tokens, completion, self.ttft_s * 1000, tpot, cached_tokens)




def attempt_id(request_id: str, endpoint: Endpoint) -> str:
    """One try of a request on one endpoint: native blocking bodies and worker errors carry it."""
    return f"{request_id}.{endpoint.name}"


def attribute(exc: WorkerError, req: GenerationRequest, attempt: str) -> None:
    """A worker error names its attempt (docs/contract.md, "Errors"), and an error about the grammar, an image or the
    conversation names the client's field it came from (`response_format` / `text.format`, `images[i].data`,
    `input`: the engine only knows them as `grammar`, `images[i]`, `messages`)."""
    exc.extra.setdefault("attempt_id", attempt)
    if exc.param == "grammar" and req.grammar is not None:
        exc.param = req.grammar.param
    elif (image := _IMAGE_PARAM.fullmatch(exc.param or "")) and int(image[1]) < len(req.image_data_params):
        exc.param = req.image_data_params[int(image[1])]
    elif exc.param == "messages":
        exc.param = req.messages_param


def we_are_cancelled() -> bool:
    """Whether a CancelledError is ours (the client left, the task is being cancelled) rather than
    the upstream call ending with gRPC CANCELLED, which must end the request with an error."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def upstream_cancelled() -> GatewayError:
    return worker_error("cancelled", "the model server cancelled the request")
