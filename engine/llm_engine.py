"""LLMEngine: loads a model, runs the scheduler loop in its own thread, takes requests from any thread."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.engine_core import EngineCore
from engine.core.inbox import Inbox
from engine.core.kv_events import ZmqPublisher
from engine.core.kv_manager import BLOCK_TOKENS
from engine.core.postprocess import OutputPostprocessor
from engine.core.stats import EngineStats
from engine.core.step_timing import StepTiming
from engine.errors import EngineError, is_device_fault
from engine.inputs.tool_grammar import forced_tool_grammar
from engine.inputs.vision import VisionPrompter
from engine.lora_runtime import LoraLimits, LoraRuntime, requests_info
from engine.model.decoder import Decoder
from engine.model.kv_cache import kv_dtype_for, kv_tokens_for
from engine.model.loading import load_model, release_linear_weights
from engine.model.lora import load_adapters
from engine.model.selection import build_decoder
from engine.request import EngineRequest, RequestOutput
from engine.runner.host_memory import keep_freed_memory
from engine.runner.model_runner import ModelRunner
from engine.sampling.grammar import GrammarCompilerCache
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.text import tokenizer_task
from engine.text.chat import render_chat

log = logging.getLogger(__name__)

# On a GPU the host only launches kernels and handles small per-step lists. A full intra-op pool there is the
# suspect for launches ~5x slower inside the engine (its workers spin after host-side tensor work and compete
# with the launching thread); vLLM sets OMP_NUM_THREADS=1 by default against the same contention.
# To confirm on the device: bench/gpu.py's levers line (an eager step after host work with every thread).
CUDA_HOST_THREADS = 1


@dataclass
class EngineConfig:
    model_path: str
    max_slots: int = 64
    max_len: int = 2048
    # tokens a step computes, a token for each decode row and the rest for prompt chunks (vLLM's name; 2048 measured
    # no faster on the 2-core CPU)
    max_num_batched_tokens: int = 1024
    max_num_partial_prefills: int = 1  # prompts chunked at once (engine.core.scheduler)
    scheduling_policy: str = "fcfs"  # fcfs | priority | fair (engine.core.waiting_queue)
    check_scheduler_invariants: bool = False  # check them after every step (tests; a debug setting when served)
    max_queue: int = 256
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    threads: int | None = None  # intra-op host threads; None: torch's default on CPU, CUDA_HOST_THREADS on a GPU
    lora_paths: dict[str, str] | None = None  # served adapter name -> local adapter folder
    max_loras: int = 8  # adapters served at once, loaded at run time or not (engine.lora_runtime)
    max_lora_rank: int = 64  # the highest adapter rank a run-time load accepts
    kv_budget_tokens: int | None = None  # KV memory in positions, the prefix cache's included (None: slots x len)
    kv_memory: int | float | None = None  # KV memory in bytes, or a fraction of free memory: sets kv_budget_tokens
    quantization: str = "none"  # none | int8 | int4: the linears' weights, quantized at load (engine.model.decoder)
    kv_cache_dtype: str = "auto"  # K/V stored as: auto (the activations' dtype), bfloat16 or int8 (model.kv_cache)
    prefix_cache_tokens: int = 8192  # at most this much of it keeps past prompts for reuse (0: off); yields to running
    reasoning: bool = False  # the model thinks in <think>...</think>: split it from the content
    grammar_budget_s: float = 5.0  # the longest a request's grammar may compile before it is refused (400)
    cuda_graphs: bool = True  # on a GPU, replay decode steps from captured CUDA graphs (engine.runner.cuda_graphs)
    model_impl: str = "auto"  # auto | fused | transformers (engine.model.selection)
    chat_template: str | None = None  # Jinja chat template replacing the tokenizer's (a base model has none)
    stop_tokens: list[str] | None = None  # token strings that end a candidate like EOS (e.g. <end_of_turn>)
    # an idle engine that gets a request waits for the rest of a burst before its first step (engine.core.inbox)
    burst_window_ms: float = 20.0  # at most this long after the first arrival
    burst_quiet_ms: float = 3.0  # the burst is over once no request has come for this long
    # KV events in vLLM's format for KV-aware routers (engine.core.kv_events): ZMQ PUB endpoint (None: off), the
    # ROUTER endpoint that replays missed batches, and the topic (llm-d reads `kv@<pod>@<model>`)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""


@contextlib.contextmanager
def _one_thread_here_then(threads: int) -> Iterator[None]:
    """Build on the caller's thread with one intra-op thread, then let every later thread use `threads`.

    Why: libgomp gives each thread that runs parallel work a team of its own, and once a process holds more
    OpenMP threads than CPUs it cuts every worker's spin-wait to about 100 spins, so each of a decode step's
    ~1,000 parallel regions waits on a futex wake-up. Loading with a 2-thread team on Triton's thread left one
    behind, and the loop thread's steps ran 20-30 % slower (2-core box, SmolLM2, alternated runs: B=1 47-52 ->
    30-40 ms, B=16 73-88 -> 49-74 ms). The loop thread reads the count when it first runs parallel work (torch's
    lazy init)."""
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    return torch.bfloat16 if config.device.startswith("cuda") else torch.float32


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: tuple[torch.nn.Module, Any, Any] | None = None) -> None:
        """`loaded`: (model, tokenizer, processor) already in memory (benchmarks on random weights); else
        they are loaded from `config.model_path`."""
        self.config = config
        on_gpu = config.device.startswith("cuda")
        threads = config.threads or (CUDA_HOST_THREADS if on_gpu else None) or torch.get_num_threads()
        if not on_gpu:
            keep_freed_memory()  # a CPU forward's activations reuse mapped pages (engine.runner.host_memory)
        with _one_thread_here_then(threads):  # the forwards run on the loop thread's own OpenMP team
            self._build(config, loaded, on_gpu)
        self.inbox = Inbox(config.burst_window_ms / 1e3, config.burst_quiet_ms / 1e3)
        # work that must run between two steps on the loop thread (an adapter table change)
        self._between: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self.lora = LoraRuntime(self.runner, self.model, fused=isinstance(self.runner.decoder, Decoder),
                                limits=LoraLimits(config.max_loras, config.max_lora_rank),
                                between_steps=self.between_steps, users=self._adapter_users)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = True
        self.on_fatal: Callable[[], None] | None = None  # called once the loop has died and failed its requests

    def _build(self, config: EngineConfig, loaded: tuple[torch.nn.Module, Any, Any] | None, on_gpu: bool) -> None:
        # a vision-language model (config with vision_config) comes with its processor; text models with None
        self.vision: VisionPrompter | None = None
        model, self.tokenizer, processor = loaded or load_model(config.model_path, _resolve_dtype(config),
                                                                config.device)
        self.model = model
        if config.chat_template:
            self.tokenizer.chat_template = config.chat_template
        decoder = build_decoder(model, config.model_impl, config.max_len, config.quantization)
        fused = isinstance(decoder, Decoder)
        if config.quantization != "none":  # the forward holds its int8 copies: the full-precision ones go
            release_linear_weights(model)
        if processor is not None:
            self.vision = VisionPrompter(model, processor, self.tokenizer, decoder.embed)
        graphs = on_gpu and config.cuda_graphs and fused  # captured for the fused forward only
        # each path its own adapters: lifted into the fused forward, or peft's LoRA layers in the HF modules
        paths = config.lora_paths or {}
        adapters = load_adapters(model, paths, decoder.dtype) if isinstance(decoder, Decoder) \
            else decoder.load_adapters(paths)
        if config.kv_memory is not None:  # bytes, or a share of what the weights left free, at the pool's dtype
            config.kv_budget_tokens = kv_tokens_for(config.kv_memory, decoder.config.num_hidden_layers, decoder.n_kv,
                                                    decoder.head_dim, kv_dtype_for(config.kv_cache_dtype,
                                                                                   decoder.dtype), decoder.device)
            log.info("KV memory %s: %d positions", config.kv_memory, config.kv_budget_tokens)
        # the KV pool holds the profile's KV memory in blocks (every slot's whole context when it names none)
        kv_blocks = config.kv_budget_tokens // BLOCK_TOKENS + 1 if config.kv_budget_tokens else None
        self.runner = ModelRunner(decoder, config.max_slots, config.max_len, adapters, graphs, kv_blocks=kv_blocks,
                                  kv_dtype=config.kv_cache_dtype)
        self.sampler = Sampler(decoder.vocab_size, self._stop_token_ids(model, decoder.config))
        self.kv_events: ZmqPublisher | None = None
        if config.kv_events_endpoint:
            self.kv_events = ZmqPublisher(config.kv_events_endpoint, config.kv_events_topic,
                                          config.kv_events_replay_endpoint)
        self.core = EngineCore(self.runner, self.sampler, self.tokenizer, config.max_num_batched_tokens,
                               config.kv_budget_tokens, config.prefix_cache_tokens,
                               postprocess=OutputPostprocessor(self.tokenizer).for_sequence,
                               reasoning=config.reasoning,
                               publish_kv_events=self.kv_events.publish if self.kv_events is not None else None,
                               max_partial_prefills=config.max_num_partial_prefills,
                               check_invariants=config.check_scheduler_invariants,
                               scheduling_policy=config.scheduling_policy)
        self.grammars = GrammarCompilerCache(self.tokenizer, decoder.vocab_size, self.sampler.stop_token_set,
                                             config.grammar_budget_s)

    def _stop_token_ids(self, model, config) -> set[int]:
        ids: set[int] = set()
        for source in (config.eos_token_id, getattr(model.generation_config, "eos_token_id", None),
                       self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(source)
        for token in self.config.stop_tokens or []:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id == self.tokenizer.unk_token_id:
                raise ValueError(f"stop token {token!r} is not in this model's vocabulary")
            ids.add(token_id)
        return ids

    # -- request API ---------------------------------------------------------------------------

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[int]:
        if messages is not None:
            tools = params.tools if params and params.tool_choice != "none" else None
            chat = render_chat(self.tokenizer, messages, tools, params.chat_template_kwargs if params else None)
            return chat.encode(self.tokenizer)
        if prompt is None:
            raise EngineError("invalid_request", "either a prompt or messages is required", "prompt")
        return self.tokenizer.encode(prompt)

    def tokenize(self, options: Any, prompt: str | None, messages: list[dict[str, Any]] | None,
                 template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """`/tokenize`: the ids generation would see for this prompt or these messages (engine.text.tokenizer_task)."""
        return tokenizer_task.tokenize(self.tokenizer, options, prompt, messages, self.config.max_len, template_kwargs)

    def detokenize(self, ids: list[int]) -> tuple[str, dict[str, Any]]:
        """`/detokenize`: the text of these ids."""
        return tokenizer_task.detokenize(self.tokenizer, ids, self.config.max_len)

    def encode_inputs(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        images: list[bytes] | None = None,
        token_ids: list[int] | None = None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Prompt ids, plus the prompt's input embeddings when images are present (see engine.inputs.vision).

        `token_ids`: a prompt already tokenized, taken as it is (no chat template, no special tokens added)."""
        if params is not None:
            self.check_logit_bias(params)
        if token_ids is not None:
            if not token_ids:
                raise EngineError("invalid_request", "the prompt's token ids are empty", "prompt")
            tokenizer_task.check_in_vocabulary(self.tokenizer, token_ids, "prompt")
            return token_ids, None
        if not images:
            return self.encode_prompt(prompt, messages, params), None
        if self.vision is None:
            raise EngineError("unsupported_field", "this model does not accept image input", "images")
        return self.vision.encode(prompt, messages, params, images)

    def check_logit_bias(self, params: SamplingParams) -> None:
        """A bias on an id the model has no logit for is a 400, as vLLM answers it (it used to be dropped)."""
        vocab = self.sampler.vocab_size
        outside = sorted(t for t in params.logit_bias if not 0 <= t < vocab)
        if outside:
            raise EngineError("invalid_request",
                              f"logit_bias token id {outside[0]} is outside the vocabulary (0..{vocab - 1})",
                              "logit_bias")

    def grammar_factory(self, params: SamplingParams) -> Callable[[], Any] | None:
        """Compile the request's grammar (or its forced tool call) now, off the decode loop.

        Raises EngineError(grammar_invalid) for a grammar that does not compile.
        """
        if params.grammar is None and params.forces_tool_call:
            params.grammar = forced_tool_grammar(params.tools or [], params.tool_choice, params.parallel_tool_calls)
        if params.grammar is None:
            return None
        grammar = params.grammar
        self.grammars.new_state(grammar)  # compile (and cache) eagerly so errors surface before queueing
        return lambda: self.grammars.new_state(grammar)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request; raises QueueFull at once when the bounded queue is full."""
        if not self.healthy:
            raise EngineError("MODEL_LOADING", "engine is not healthy")
        adapter = request.params.lora_adapter
        key = self.lora.key(adapter) if adapter is not None else None
        if key is not None and key != adapter:  # a name loaded again: its own prefix-cache blocks
            request.params = dataclasses.replace(request.params, lora_adapter=key)
        self.inbox.put(request, room=self.config.max_queue - self.core.scheduler.queue_depth)
        if not self.healthy:  # the loop died between the check above and the put: nobody will drain it
            self._fail_incoming()

    @property
    def stats(self) -> EngineStats:
        """What the engine measures (engine/core/stats.py), for its metrics."""
        return self.core.scheduler.stats

    @property
    def step_timing(self) -> StepTiming:
        """Where the pure decode steps' time goes, by phase (engine/core/step_timing.py), for its metrics."""
        return self.core.timing

    @property
    def cache_config(self) -> dict[str, str]:
        """vLLM's cache_config_info labels: the KV block size and the number of blocks, whether prefix caching
        is on, and the profile's `kv_cache_dtype` (what KV-aware routers read)."""
        scheduler = self.core.scheduler
        return {"block_size": str(BLOCK_TOKENS), "num_gpu_blocks": str(scheduler.kv.total_blocks),
                "enable_prefix_caching": str(scheduler.prefix_cache is not None).lower(),
                "cache_dtype": self.config.kv_cache_dtype}

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running: in the intake queue or waiting for a slot / KV room."""
        return self.inbox.pending + self.core.scheduler.queue_depth

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool = True, is_cancelled: Callable[[], bool] | None = None) -> queue.Queue[RequestOutput]:
        """Convenience for tests and benchmarks: submit and get a queue of outputs."""
        out: queue.Queue[RequestOutput] = queue.Queue()
        request = EngineRequest(request_id, prompt_ids, params, out.put, stream, is_cancelled)
        request.grammar = self.grammar_factory(params)
        self.submit(request)
        return out

    # -- loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (again, after `stop`)."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self.inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._run_between_steps()  # a change that came as the loop stopped: made here, not left waiting

    # -- run-time LoRA (engine.lora_runtime) ----------------------------------------------------

    def between_steps(self, work: Callable[[], Any]) -> Any:
        """Run `work` on the loop thread between two steps and return its result (raising what it raised);
        at once on this thread when the loop is not running."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return work()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._between.put((work, done))
        self.inbox.wake()
        return done.result()

    def _run_between_steps(self) -> None:
        while True:
            try:
                work, done = self._between.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(work())
            except Exception as exc:  # the caller's to handle: the loop goes on
                done.set_exception(exc)

    def _adapter_users(self, key: str) -> int:
        """Requests the scheduler holds (waiting, running, preempted) on adapter table key `key`."""
        return sum(g.params.lora_adapter == key for g in self.core.scheduler.groups_in_flight())

    def lora_requests_info(self) -> dict[str, str]:
        """vLLM's lora_requests_info labels (engine.lora_runtime.requests_info), for the metrics thread."""
        return requests_info(self.core.scheduler, self.lora, self.config.max_loras)

    def _drain_incoming(self) -> None:
        for request in self.inbox.take():
            try:
                self.core.scheduler.add(request)
            except Exception as exc:  # a fault admitting one request fails that request, not the loop
                if not isinstance(exc, EngineError):
                    log.exception("admitting %s failed", request.request_id)
                error = exc if isinstance(exc, EngineError) else EngineError(
                    "inference_error", f"admission failed: {type(exc).__name__}")
                request.on_output(RequestOutput(request.request_id, 0, "", "error", final=True, error=error))
                if is_device_fault(exc):
                    raise  # the shared device state is gone: the loop fails everything else

    def _run(self) -> None:
        try:
            idle = True
            while not self._stopped.is_set():
                self._drain_incoming()
                self._run_between_steps()
                if not self.core.scheduler.has_work():
                    idle = True
                    self.inbox.wait(timeout=0.05)
                    continue
                if idle:  # the first step after idling takes the whole burst of requests that woke it
                    idle = False
                    self.inbox.gather_burst()
                    self._drain_incoming()
                self.core.step()
        except Exception:
            log.exception("engine loop crashed")
            self.healthy = False
            self._fail_everything()
            if self.on_fatal is not None:
                self.on_fatal()

    def _fail_everything(self) -> None:
        error = EngineError("inference_error", "the engine failed; retry the request")
        for group in self.core.scheduler.groups_in_flight():
            if not group.sent_final:
                group.end_early("error", error)
        self._fail_incoming()

    def _fail_incoming(self) -> None:
        """End the requests submitted but not yet taken by the (dead) loop."""
        error = EngineError("inference_error", "the engine failed; retry the request")
        for request in self.inbox.take():
            request.on_output(RequestOutput(request.request_id, 0, "", "error", final=True, error=error))
