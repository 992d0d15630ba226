"""Triton Python-backend glue: tensors in, engine requests, responses out (decoupled).

`execute()` only parses and enqueues; the engine loop runs in its own thread and a sender thread
delivers responses, so a ~0.4 ms `send` never sits on the decode path. Every request ends with
the FINAL flag, errors and cancellations included. See docs/triton-contract.md.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the Python backend stub

from contract.error_codes import lookup
from contract.stop_call import CALL_PARAMETER, STOP_PARAMETER
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.triton import lora_control
from engine.triton.cancel_probe import CallStops, CancelProbe, ProbeRate
from engine.triton.intake import SlowLane, checked_cache_salt, checked_priority, checked_tenant
from engine.triton.metrics import EngineMetrics
from engine.triton.outbox import coalesce
from engine.triton.profile_config import cache_path, engine_config, engine_profile
from engine.triton.reply import FLAG_INPUTS, Reply

log = logging.getLogger(__name__)

def _input_str(request, name: str) -> str | None:
    """First element of a BYTES tensor, as UTF-8 text."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise EngineError("invalid_request", f"{name} is not valid UTF-8", name) from None


def _input_bytes_list(request, name: str) -> list[bytes]:
    """Every element of a BYTES tensor (e.g. `images`: raw image file bytes), or [] when absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [bytes(v) if not isinstance(v, str) else v.encode("latin-1") for v in tensor.as_numpy().reshape(-1)]


def _input_bool(request, name: str) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else False


def _request_parameters(request) -> dict[str, Any]:
    """The Triton request parameters (the gateway's call id, or the call a stop request names)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (TypeError, ValueError):
        return {}
    return params if isinstance(params, dict) else {}


def _input_flags(request) -> dict[str, bool]:
    """The vLLM backend's optional BOOL inputs that this request sent (engine/triton/reply.py)."""
    flags = {}
    for name in FLAG_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            flags[name] = bool(tensor.as_numpy().reshape(-1)[0])
    return flags


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        # a bad or unknown profile key raises here: Triton marks the model unavailable with the message naming it
        profile = engine_profile({k: v["string_value"] for k, v in config.get("parameters", {}).items()})
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        # args["model_repository"] is the model's folder
        self.engine = LLMEngine(engine_config(profile, model_dir=args["model_repository"], triton_name=config["name"],
                                              device=device, pod=os.environ.get("POD_NAME") or socket.gethostname()))
        self.defaults = profile.default_sampling
        # operator template settings win over the request's on conflict (e.g. enable_thinking)
        self.template_kwargs = profile.chat_template_kwargs
        self.outbox: queue.SimpleQueue[tuple[Reply, RequestOutput] | None] = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, name="response-sender", daemon=True)
        self.sender.start()
        self.metrics = EngineMetrics(pb_utils, self.engine, config["name"])
        self.slow_lane = SlowLane(limit=profile.max_queue)
        # is_cancelled round trips: a fixed rate for all live requests together
        self.cancel_rate = ProbeRate(lambda: self.engine.stats.running + self.engine.num_waiting)
        self.stops = CallStops()  # what the gateway's stop requests name (contract/stop_call.py)
        self.engine.on_fatal = self._die
        self.engine.start()

    def execute(self, requests):
        for request in requests:
            params = _request_parameters(request)
            if STOP_PARAMETER in params:  # ends the named generation at its next step; nothing to answer
                self.stops.stop(str(params[STOP_PARAMETER]))
                request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            call_id = params.get(CALL_PARAMETER)
            reply = Reply(request.get_response_sender(), str(call_id) if call_id is not None else None)
            try:
                if pb_utils.get_input_tensor_by_name(request, lora_control.INPUT) is not None:
                    lora_control.answer(pb_utils, self.engine, _input_str(request, lora_control.INPUT), reply.sender,
                                        partial(self._fail, reply), cache_path)
                    continue
                if self._is_tokenizer_request(request):
                    self._answer_tokenizer(request, reply)
                    continue
                build, slow = self._parse(request, reply)
                if slow:  # a grammar to compile or images to decode: off this thread (engine/triton/intake.py)
                    self.slow_lane.submit(lambda build=build: self.engine.submit(build()),
                                          partial(self._fail, reply))
                else:
                    self.engine.submit(build())
            except EngineError as exc:
                self.outbox.put((reply, RequestOutput("", 0, "", "error", final=True, error=exc)))
            except Exception as exc:  # never let one malformed request escape without a FINAL
                log.exception("could not parse request")
                err = EngineError("invalid_request", f"malformed request tensors: {type(exc).__name__}")
                self.outbox.put((reply, RequestOutput("", 0, "", "error", final=True, error=err)))
        return None

    @staticmethod
    def _is_tokenizer_request(request) -> bool:
        return any(pb_utils.get_input_tensor_by_name(request, name) is not None for name in ("tokenize", "detokenize"))

    def _answer_tokenizer(self, request, reply: Reply) -> None:
        """`tokenize` / `detokenize` (docs/triton-contract.md): one FINAL response, nothing generated. The
        tokenizer is fast enough to answer here, off the engine loop."""
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "detokenize")
        if ids_tensor is not None:
            text, extras = self.engine.detokenize([int(t) for t in ids_tensor.as_numpy().reshape(-1)])
        else:
            raw = _input_str(request, "tokenize") or "{}"
            try:
                options = json.loads(raw)
            except json.JSONDecodeError:
                raise EngineError("invalid_request", "tokenize is not JSON", "tokenize") from None
            messages_raw = _input_str(request, "messages")
            text = ""
            extras = self.engine.tokenize(options, _input_str(request, "text_input"),
                                          json.loads(messages_raw) if messages_raw else None, self.template_kwargs)
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("index", np.array([0], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([b"stop"], dtype=np.object_)),
            pb_utils.Tensor("prompt_tokens", np.array([len(extras["token_ids"])], dtype=np.int32)),
            pb_utils.Tensor("completion_tokens", np.array([0], dtype=np.int32)),
            pb_utils.Tensor("logprobs", np.array([b""], dtype=np.object_)),
            pb_utils.Tensor("is_final", np.array([True], dtype=np.bool_)),
            pb_utils.Tensor("extras", np.array([json.dumps(extras).encode()], dtype=np.object_)),
        ]
        reply.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                          flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _fail(self, reply: Reply, error: EngineError) -> None:
        self.outbox.put((reply, RequestOutput("", 0, "", "error", final=True, error=error)))

    def _parse(self, request, reply: Reply) -> tuple[Callable[[], EngineRequest], bool]:
        """Reads the request's tensors now; returns what builds its engine request (the prompt encoding and the
        grammar compile), and whether that is slow work (a grammar or images)."""
        raw = _input_str(request, "sampling_parameters")
        try:
            params_dict = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            raise EngineError("invalid_request", "sampling_parameters is not JSON", "sampling_parameters") from None
        priority = checked_priority(params_dict)  # taken out before SamplingParams, which refuses unknown keys
        params = SamplingParams.from_dict(params_dict, self.defaults)
        if self.template_kwargs:
            params.chat_template_kwargs = {**(params.chat_template_kwargs or {}), **self.template_kwargs}
        messages_raw = _input_str(request, "messages")
        messages = json.loads(messages_raw) if messages_raw else None
        images = _input_bytes_list(request, "images")
        text_input = _input_str(request, "text_input")
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "prompt_token_ids")
        token_ids = None if ids_tensor is None else [int(t) for t in ids_tensor.as_numpy().reshape(-1)]
        reply.configure(_input_flags(request), text_input if messages is None else None)
        request_id, stream = request.request_id() or "", _input_bool(request, "stream")
        cache_salt = checked_cache_salt(_input_str(request, "cache_salt"))
        tenant, tenant_weight = checked_tenant(_input_str(request, "tenant"))
        is_cancelled = CancelProbe(request.is_cancelled, self.cancel_rate)  # a server round trip: rate-limited
        if reply.call_id is not None:
            self.stops.add(reply.call_id, is_cancelled)

        def build() -> EngineRequest:
            prompt_ids, embeds = self.engine.encode_inputs(text_input, messages, params, images, token_ids)
            return EngineRequest(
                request_id=request_id,
                prompt_ids=prompt_ids,
                prompt_embeds=embeds,
                params=params,
                on_output=partial(self._enqueue, reply),
                stream=stream,
                is_cancelled=is_cancelled,
                grammar=self.engine.grammar_factory(params),
                prompt_param="messages" if messages is not None else "prompt",
                cache_salt=cache_salt,
                priority=priority,
                tenant=tenant,
                tenant_weight=tenant_weight,
            )

        return build, bool(images) or params.grammar is not None or params.forces_tool_call

    def _enqueue(self, reply: Reply, out: RequestOutput) -> None:
        self.outbox.put((reply, out))

    def _send_loop(self) -> None:
        while True:
            batch = [self.outbox.get()]
            while len(batch) < 1024:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            for sender, out in coalesce([item for item in batch if item is not None]):
                self._send(sender, out)
            if stop:
                return

    def _send(self, reply: Reply, out: RequestOutput) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.final else 0
        if out.final:
            self.stops.discard(reply.call_id)
        try:
            if out.error is not None or (out.final and out.finish_reason == "cancelled"):
                error = out.error or EngineError("cancelled", "request cancelled")
                code = getattr(pb_utils.TritonError, lookup(error.code).triton)
                usage = (out.prompt_tokens, out.completion_tokens) if out.prompt_tokens else None  # None: never ran
                reply.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error.to_json(usage), code)),
                                  flags=flags)
            else:
                reply.sender.send(self._response(out, reply), flags=flags)
        except Exception:  # the client may be gone; the engine has already moved on
            log.debug("send failed", exc_info=True)

    @staticmethod
    def _response(out: RequestOutput, reply: Reply):
        extras: dict[str, Any] = {}
        if out.tool_calls:
            extras["tool_calls"] = out.tool_calls
        if out.reasoning:
            extras["reasoning_content"] = out.reasoning
        if out.stop_reason is not None:  # a stop string, or a stop token id (0 is an id too)
            extras["stop_reason"] = out.stop_reason
        if out.cached_tokens and out.finish_reason:
            extras["cached_tokens"] = out.cached_tokens  # usage.prompt_tokens_details.cached_tokens
        if out.ttft_ms is not None:
            extras["ttft_ms"], extras["tpot_ms"] = out.ttft_ms, out.tpot_ms
        tensors = [
            pb_utils.Tensor("text_output", np.array([reply.text(out).encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("index", np.array([out.index], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([(out.finish_reason or "").encode()], dtype=np.object_)),
            pb_utils.Tensor("prompt_tokens", np.array([out.prompt_tokens], dtype=np.int32)),
            pb_utils.Tensor("completion_tokens", np.array([out.completion_tokens], dtype=np.int32)),
            pb_utils.Tensor(
                "logprobs", np.array([json.dumps(out.logprobs).encode() if out.logprobs else b""], dtype=np.object_)
            ),
            pb_utils.Tensor("is_final", np.array([out.final], dtype=np.bool_)),
            pb_utils.Tensor("extras", np.array([json.dumps(extras).encode() if extras else b""], dtype=np.object_)),
        ]
        tensors += [pb_utils.Tensor(name, value) for name, value in reply.extra_outputs(out).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _die(self) -> None:
        """A dead engine ends this stub process once its error responses are out. Triton keeps the model
        READY even so (server #7862): the gateway's supervision finds the dead process within seconds, as
        for a kill -9 or an OOM kill, and reloads the model (gateway/supervisor.py)."""
        log.error("engine loop died; exiting the model process (the gateway reloads the model)")
        threading.Timer(1.0, os._exit, args=(1,)).start()

    def finalize(self) -> None:
        self.slow_lane.shutdown()
        self.engine.stop()
        self.metrics.stop()
        self.outbox.put(None)
        self.sender.join(timeout=5)
        # Backend objects (custom metrics, requests: a finished request's `is_cancelled` probe sits in the
        # engine's sequence <-> group reference cycles) must be freed now, while the stub's shared memory
        # exists: left to the interpreter's final collection, each one segfaulted the stub at every shutdown.
        self.engine.on_fatal = None  # the model <-> engine cycle
        gc.collect()
