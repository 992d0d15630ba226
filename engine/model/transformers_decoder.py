"""Any transformers decoder, run by its own modeling code on the engine's paged KV cache.

transformers routes every attention call of a model that supports its attention interface through
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`, after the model has applied its own projections,
norms and RoPE (per-layer rope bases included). We register one function there (`sie_kv`) that writes the
new keys and values into our paged cache at each token's (slot, position), through the slot's block table,
and attends over the slot's cached prefix, honouring what the layer declares: its `scaling` (Gemma's
`query_pre_attn_scalar`), its `sliding_window` and its `softcap`. Everything else (embedding scale, GQA, tied
embeddings, final logit soft-capping) stays in the model's own code. The same idea as vLLM's Transformers backend
and transformers' own continuous batching (`generation/continuous_batching/`).

A forward is one packed row of tokens ([1, N]); `AttentionStep` says where each token lives: either one
token per slot 0..N-1 (a decode step) or contiguous segments of one slot each (prefill chunks). The mask
of each window size is built once a forward, not once a layer.

The cache keeps every position of every layer, sliding-window layers included (they only read their last
`window` positions): the same block layout as the fused path, so prefix caching and forks share blocks the same
way. For Gemma 3 270M that is 18 x 2 x 256 x 4 B = 36.9 kB a token in fp32, of which the 15
sliding layers' positions older than 512 are never read again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.model.attention_shape import kv_shape
from engine.model.kv_cache import KVCache, kv_dtype_for
from engine.model.linear_kernels import Weight, choose_kind, linear, pack
from engine.model.support import UnsupportedModel, check_against_own_forward, transformers_path_gaps
from engine.model.transformers_lora import (
    BASE,
    AdapterRows,
    PeftAdapter,
    add_peft_adapter,
    load_peft_adapters,
    remove_peft_adapter,
)
from engine.staging import stage

ATTENTION_NAME = "sie_kv"


@dataclass
class Segment:
    """`length` packed tokens from `offset`, for `slot` at positions start..start+length-1."""

    slot: int
    start: int
    length: int
    offset: int


@dataclass
class AttentionStep:
    """Where the tokens of one forward live in the cache; shared by every layer of that forward."""

    cache: KVCache
    tables: torch.Tensor  # [R, max_blocks]: the block table of each decode row, or of each prefill segment
    rows: torch.Tensor | None  # [N] each packed token's row of `tables` (None: token i in row i)
    positions: torch.Tensor  # [N]
    segments: list[Segment] | None = None  # prefill; None: a decode step (token i in slot i)
    span: int = 0  # decode: cache positions read
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)
    _where: tuple[torch.Tensor, torch.Tensor] | None = None

    def where(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each packed token in the pool, found once a forward."""
        if self._where is None:
            self._where = self.cache.locate(self.tables, self.positions, self.rows)
        return self._where

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, span] bool: each row's own filled prefix (and only its last `window` positions)."""
        key = (-1, window)
        if key not in self._masks:
            keys = torch.arange(self.span, device=self.positions.device)[None, :]
            pos = self.positions[:, None]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """[length, end] bool for segment `index`, or None where plain causal attention is exact."""
        key = (index, window)
        if key not in self._masks:
            seg = self.segments[index]
            end = seg.start + seg.length
            if seg.start == 0 and (window is None or window >= end):
                self._masks[key] = None  # is_causal covers it
            else:
                device = self.positions.device
                q = torch.arange(seg.start, end, device=device)[:, None]
                k = torch.arange(end, device=device)[None, :]
                mask = k <= q
                if window is not None:
                    mask &= k > q - window
                self._masks[key] = mask
        return self._masks[key]


def _attend(query, key, value, mask, scaling, softcap, is_causal=False):
    """SDPA, or its math when the layer soft-caps its scores (SDPA cannot)."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal and mask is None,
                                              scale=scaling, enable_gqa=True)
    group = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


def cached_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, sie_step: AttentionStep | None = None, **kwargs):
    """transformers attention function: query [1, H, N, D], key/value [1, Hkv, N, D] (RoPE applied) ->
    ([1, N, H, D], None)."""
    if sie_step is None:
        raise RuntimeError(f"the {ATTENTION_NAME} attention runs only inside the engine's forward")
    step, layer = sie_step, module.layer_idx
    scaling = scaling if scaling is not None else module.head_dim ** -0.5
    cache = step.cache
    block, offset = step.where()
    cache.write(layer, block, offset, key[0].transpose(0, 1), value[0].transpose(0, 1))
    heads, dim, kv_heads = query.shape[1], query.shape[-1], key.shape[1]
    if step.segments is None:
        b = query.shape[2]
        group = heads // kv_heads
        # GQA folded into the query-length axis, as in the fused decode step
        q = query[0].transpose(0, 1).reshape(b, kv_heads, group, dim)
        keys, values = cache.gather(layer, step.tables, step.span)
        out = _attend(q, keys, values, step.decode_mask(sliding_window), scaling, softcap)
        return out.reshape(1, b, heads, dim), None
    parts = []
    for i, seg in enumerate(step.segments):
        end = seg.start + seg.length
        q = query[:, :, seg.offset:seg.offset + seg.length]
        mask = step.prefill_mask(i, sliding_window)
        keys, values = cache.gather(layer, step.tables[i : i + 1], end)
        parts.append(_attend(q, keys, values, mask, scaling, softcap, is_causal=True))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, cached_attention)


def logit_ops(config) -> tuple[float, float | None]:
    """(scale, soft-cap) the model's causal-LM head applies to its logits, in that order: Cohere's `logit_scale`,
    Granite's `logits_scaling` (a divisor), `output_multiplier`; Gemma's `final_logit_softcapping`."""
    scale = float(getattr(config, "logit_scale", None) or 1.0) * float(getattr(config, "output_multiplier", None)
                                                                       or 1.0)
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    return scale, getattr(config, "final_logit_softcapping", None)


def first_layer(base: torch.nn.Module) -> torch.nn.Module:
    """The first decoder layer (the first module list under the decoder: `layers`, GPT-2's `h`)."""
    layers = next((m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
    return layers[0] if layers is not None else base


def use_linear_kind(module: torch.nn.Module, kind: str) -> None:
    """Every nn.Linear under `module` runs on `kind`'s kernel (engine.model.linear_kernels): with "dnnl" its
    weight is prepacked once for oneDNN, which on AVX-512 runs these GEMMs 2-4x faster than F.linear (MKL's
    path on AMD); with "tiled", laid out as column tiles for our fp32 kernel. The dense weight stays (the HF
    model is still whole); the packed copy is extra memory.
    LoRA adapters (engine.model.transformers_lora) wrap these modules and call them as peft's `base_layer`: the
    packed kernel keeps running every base GEMM, for rows with and without adapters."""
    if kind not in ("dnnl", "tiled"):
        return
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            packed, bias = pack(sub.weight.detach(), kind), sub.bias

            def forward(x: torch.Tensor, packed: Weight = packed, bias=bias) -> torch.Tensor:
                return linear(x, packed, bias)

            sub.forward = forward  # type: ignore[method-assign,assignment]


class TransformersDecoder:
    """Prefill and batched decode through the model's own transformers code, on a KV cache passed in.

    The fused `Decoder`'s interface (engine.model.decoder), so the runner and the scheduler cannot tell them
    apart. `max_len` is unused (no RoPE tables of ours: the model computes its own). A `lora` argument is one
    peft adapter name per packed token (`lora_batch`), or None when no row of the forward has an adapter."""

    def __init__(self, hf_model: torch.nn.Module, max_len: int) -> None:
        problems = transformers_path_gaps(hf_model)
        if problems:
            raise UnsupportedModel("; ".join(problems))
        register_attention()
        hf_model.requires_grad_(False)  # served only: logits() on inference tensors outside inference_mode too
        config = hf_model.config.get_text_config()
        self.model = hf_model
        self.base = hf_model.get_decoder()  # embeddings, layers and final norm: hidden states out
        self.head = hf_model.get_output_embeddings()
        self.config = config
        # from the attention the model runs, not its config: GPT-2 and GPT-NeoX ignore a num_key_value_heads there
        shape = kv_shape(hf_model)
        self.n_kv, self.head_dim = shape.kv_heads, shape.head_dim
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.logit_ops = logit_ops(config)
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.embed = self.base.get_input_embeddings().weight.detach()
        # the fused forward's GEMM choice, measured on this model's first layer (all of its linears; GPT-2's are
        # Conv1D modules, which keep torch's own matmul)
        first = [m.weight.detach() for m in first_layer(self.base).modules() if isinstance(m, torch.nn.Linear)]
        self.linear_kind = choose_kind(self.device, first) if first else "mkl" if self.device.type == "cpu" else "torch"
        use_linear_kind(hf_model, self.linear_kind)  # the layers' linears and the LM head
        self.adapter_rows = AdapterRows()  # set only for the length of a forward with adapter rows
        self.peft_model: Any = None  # peft's wrapper, once an adapter is loaded
        check_against_own_forward(self)

    def load_adapters(self, paths: dict[str, str]) -> dict[str, PeftAdapter]:
        """peft LoRA adapters in the model's own modules, served per row (engine.model.transformers_lora)."""
        self.peft_model, adapters = load_peft_adapters(self.model, self.head, self.adapter_rows, paths)
        return adapters

    def add_adapter(self, name: str, path: str) -> PeftAdapter:
        """One more adapter at run time (between steps: it changes the modules the forward runs)."""
        self.peft_model, adapter = add_peft_adapter(self.model, self.head, self.adapter_rows, self.peft_model,
                                                    name, path)
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Take an adapter's weights out (between steps); rows no longer name it."""
        if self.peft_model is not None:
            self.peft_model = remove_peft_adapter(self.peft_model, name)

    @staticmethod
    def lora_batch(adapters: dict, token_adapters: list[str | None]) -> list[str]:
        """One forward's adapter per packed token, in peft's names (`adapters`: the runner's table, unused)."""
        return [name or BASE for name in token_adapters]

    @staticmethod
    def batch_token_adapters(prompts: list[list[int]], adapters: list[str | None]) -> list[str | None]:
        """`prefill_batch` packs the prompts back to back: one entry per prompt token."""
        return [adapter for prompt, adapter in zip(prompts, adapters, strict=True) for _ in prompt]

    def new_cache(self, slots: int, max_len: int, num_blocks: int | None = None, kv_dtype: str = "auto"
                  ) -> KVCache:
        """A zeroed KV cache shaped for this model, every layer: `slots` rows of up to `max_len` positions, in a
        pool of `num_blocks` blocks (None: enough for every slot's whole context), K/V stored as `kv_dtype` says
        (the profile's `kv_cache_dtype`: rounded as written, widened as gathered)."""
        return KVCache(self.config.num_hidden_layers, slots, self.n_kv, max_len, self.head_dim, self.dtype,
                       self.device, num_blocks, storage=kv_dtype_for(kv_dtype, self.dtype))

    @contextlib.contextmanager
    def hf_attention(self) -> Iterator[None]:
        """The HF model on its own attention for a while (HF `generate`, references), then ours again."""
        self.model.set_attn_implementation("sdpa" if self.model._supports_sdpa else "eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation(ATTENTION_NAME)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed hidden states [N, hidden] -> [N, V] float32 logits."""
        out = self.head(hidden).float()
        scale, cap = self.logit_ops
        if scale != 1.0:
            out = out * scale
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def _hidden(self, ids: torch.Tensor, step: AttentionStep, embeds: torch.Tensor | None = None,
                lora: list[str] | None = None) -> torch.Tensor:
        inputs = {"inputs_embeds": embeds[None]} if embeds is not None else {"input_ids": ids[None]}
        with self.adapter_rows.using(lora):
            out = self.base(**inputs, position_ids=step.positions[None], use_cache=False, sie_step=step)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slot: int, token_ids: list[int], start: int, lora: list[str] | None = None,
                embeds: torch.Tensor | None = None, sample: bool = True) -> torch.Tensor | None:
        """Run `token_ids` for one slot from position `start`; returns logits of the last token [V], or None when
        not `sample` (no LM head)."""
        n = len(token_ids)
        ids = stage(token_ids, torch.long, self.device)
        positions = torch.arange(start, start + n, device=self.device)
        table = cache.device_tables(slot, slot + 1)
        rows = torch.zeros(n, dtype=torch.long, device=self.device)
        step = AttentionStep(cache, table, rows, positions, [Segment(slot, start, n, 0)])
        hidden = self._hidden(ids, step, embeds.to(self.device) if embeds is not None else None, lora)
        return self.logits(hidden[-1:])[0] if sample else None

    @torch.inference_mode()
    def prefill_batch(self, cache: KVCache, slots: list[int], prompts: list[list[int]],
                      starts: list[int] | None = None, lora: list[str] | None = None) -> torch.Tensor:
        """The prompts of several new sequences in one packed forward; returns [k, V] last logits. `starts`:
        the positions each slot already holds (a cached prefix), which `prompts` continue; None: whole prompts."""
        segments, offset = [], 0
        for slot, prompt, start in zip(slots, prompts, starts or [0] * len(prompts), strict=True):
            segments.append(Segment(slot, start, len(prompt), offset))
            offset += len(prompt)
        table = stage([[t for p in prompts for t in p],
                       [i for i, s in enumerate(segments) for _ in range(s.length)],
                       [s.start + i for s in segments for i in range(s.length)],
                       [s.offset + s.length - 1 for s in segments] + [0] * (offset - len(segments))],
                      torch.long, self.device)
        tables = cache.tables_of(slots)
        step = AttentionStep(cache, tables, table[1], table[2], segments)
        return self.logits(self._hidden(table[0], step, lora=lora)[table[3, :len(segments)]])

    @torch.inference_mode()
    def decode_hidden(self, cache: KVCache, token_tensor: torch.Tensor, positions_t: torch.Tensor, span: int,
                      lora: list[str] | None = None, masked: bool = True, tables: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """One decode step for slots 0..B-1 on device tensors (row i feeds its token at its position); returns
        the final-normed hidden states [B, hidden]. Each row always attends to its own prefix (and window).
        `tables`: the rows' block tables (None: the cache's own for slots 0..B-1)."""
        tables = cache.device_tables(0, token_tensor.shape[0]) if tables is None else tables
        step = AttentionStep(cache, tables, None, positions_t, None, span=span)
        return self._hidden(token_tensor, step, lora=lora)
