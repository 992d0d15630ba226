"""A lean decoder over a transformers Llama-family model's weights: the model math only.

It owns no state that changes between steps: the KV cache, the adapters and the CUDA graphs belong to the
runner (engine.runner.model_runner), which passes the cache and a LoRA batch into every call.

Why our own forward: batched decode of small models on CPU is bound by per-step overhead (Python
dispatch over many small ops, a growing cache), not arithmetic. Fused QKV / gate-up weights,
a preallocated paged KV pool written at each row's own position, GQA folded into SDPA without repeating
K/V, and the LM head only on the positions we sample from cut that overhead (see
docs/cpu-decode.md). Supported: LlamaForCausalLM and the Qwen2/Qwen3 variants (QKV bias,
per-head q/k RMSNorm), which covers the served models; others, and features the forward does not compute
(an o_proj or MLP bias, a sliding window shorter than the cache), are rejected at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model import tiled_linear
from engine.model.attention import bf16_supported, chunk_attention, decode_attention, native_supported
from engine.model.kv_cache import KVCache, kv_dtype_for
from engine.model.layer_ops import LayerOps, rms_norm
from engine.model.linear_kernels import Weight, choose_kind, dense, linear, pack
from engine.model.loading import language_model, unsupported_features
from engine.model.lora import AdapterTable, LoraBatch
from engine.model.tiled_linear import Int4TiledWeight, TiledWeight
from engine.staging import stage

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}
# the profile's `quantization` -> how a layer linear is laid out (docs/quantization.md)
QUANTIZATIONS = {"int8": TiledWeight.int8, "int4": Int4TiledWeight}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # the linears in the layout of the decoder's linear kind (engine.model.linear_kernels)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


def _fuse_linears(linears: list[torch.nn.Module], name: str = "weight") -> torch.Tensor:
    """One fused tensor of the linears' `name` parameters (stacked on the output axis). The HF modules
    are re-pointed at views of it, so the unfused copies are freed, not kept beside the fused one,
    while the HF model (reference outputs, peft, the vision tower) still works."""
    fused = torch.cat([getattr(m, name).detach() for m in linears]).contiguous()
    offset = 0
    for m in linears:
        size = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[offset : offset + size], requires_grad=False))
        offset += size
    return fused


class Decoder:
    """Prefill and batched decode over a paged KV cache passed in; rows are the cache's slots.

    `max_len`: the longest sequence it runs (RoPE tables; a sliding window shorter than it is rejected);
    `quantization`: `none`; `int8` (the layers' linears and the LM head as int8 with a scale per output column,
    engine.model.tiled_linear `TiledWeight.int8`); `int4` (the layers' linears at 4 bits in groups of 32,
    `Int4TiledWeight`, the LM head int8). The embeddings, norms and activations keep their precision."""

    def __init__(self, hf_model: torch.nn.Module, max_len: int, quantization: str = "none") -> None:
        config, inner, arch = language_model(hf_model)  # a VLM's language model too
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported by engine.model.decoder")
        unsupported = unsupported_features(config, inner, max_len)
        if unsupported:  # rejected at load: the fused forward would ignore them and generate wrong text
            raise ValueError(f"{arch}: not supported by engine.model.decoder: {', '.join(unsupported)}")
        self.config = config
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        param = next(hf_model.parameters())
        self.device, self.weight_dtype = param.device, param.dtype
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head: Weight = hf_model.lm_head.weight.detach()
        self.layers = [self._fuse(layer) for layer in inner.layers]
        # GEMM path by the CPU's ISA (engine.model.linear_kernels; timed only when asked); weights prepacked if oneDNN
        self.linear_kind = "torch"
        self.quantization = quantization
        if quantization != "none":
            self._quantize(quantization)
        else:
            first = self.layers[0]
            self.set_linear_kind(choose_kind(self.device, [dense(w) for w in (first.qkv, first.o_proj,
                                                                             first.gate_up, first.down)]))
        # The activations' dtype: the weights' own, except bf16 weights on our tiled kernel, which multiplies bf16 and
        # hands back its fp32 accumulators. There the hidden states, norms, attention and the KV cache stay fp32, on our
        # fp32 kernels, and a row's bits never depend on its batch, as in fp32 (docs/configuration.md, "dtype").
        mixed = self.linear_kind == "tiled" and self.weight_dtype == torch.bfloat16  # int8 from bf16 too
        self.dtype = torch.float32 if mixed else self.weight_dtype
        if mixed:
            self._small_weights_to(self.dtype)
        self.hidden_size = config.hidden_size
        self.native_attention = native_supported(self.dtype, self.device, self.head_dim)  # our attention kernels
        # in the mixed mode, with bf16 products (prefill and decode alike: the guarantees need both)
        self.bf16_attention = mixed and bf16_supported(self.weight_dtype, self.device, self.head_dim)
        self.ops = LayerOps(LayerOps.native_supported(self.dtype, self.device, config.hidden_size,
                                                      config.intermediate_size, self.head_dim), self.eps)
        self._build_rope(config, max_len)

    def new_cache(self, slots: int, max_len: int, num_blocks: int | None = None, kv_dtype: str = "auto"
                  ) -> KVCache:
        """A zeroed KV cache shaped for this model: `slots` rows of up to `max_len` positions, in a pool of
        `num_blocks` blocks (None: enough for every slot's whole context), K/V stored as `kv_dtype` says (the
        profile's `kv_cache_dtype`; our kernels and the SDPA paths read either)."""
        return KVCache(len(self.layers), slots, self.n_kv, max_len, self.head_dim, self.dtype, self.device,
                       num_blocks, storage=kv_dtype_for(kv_dtype, self.dtype))

    def lora_batch(self, adapters: AdapterTable, token_adapters: list[str | None]) -> LoraBatch:
        """One forward's LoRA rows: `token_adapters` has an entry per row of its activations."""
        return LoraBatch(adapters, token_adapters, self.device)

    def batch_token_adapters(self, prompts: list[list[int]], adapters: list[str | None]) -> list[str | None]:
        """One entry per token of `prefill_batch`'s forward: the prompts end to end with our attention kernels,
        each right-padded to the longest under SDPA."""
        if self.native_attention:
            return [adapter for prompt, adapter in zip(prompts, adapters, strict=True) for _ in prompt]
        longest = max(len(p) for p in prompts)
        return [adapter for adapter in adapters for _ in range(longest)]

    def set_linear_kind(self, kind: str) -> None:
        """Lay the linear weights out for `kind` ("dnnl": prepacked for oneDNN; "tiled": column tiles; otherwise
        dense)."""
        for w in self.layers:
            w.qkv, w.o_proj, w.gate_up, w.down = (pack(t, kind) for t in (w.qkv, w.o_proj, w.gate_up, w.down))
        self.lm_head = pack(self.lm_head, kind)
        self.linear_kind = kind

    def _quantize(self, quantization: str) -> None:
        """The layers' linears at `quantization` and the LM head at int8 (at 4 bits the logits would lose most:
        llama.cpp's Q4_K_M keeps its output matrix at 6 bits)."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of none, {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        if self.device.type != "cpu" or not tiled_linear.runs(torch.int8):
            raise ValueError(f"quantization {quantization} runs on our CPU kernels, which need AVX-512 and a C++ "
                             "compiler here; serve this model unquantized (quantization: none)")
        layout = QUANTIZATIONS[quantization]
        for w in self.layers:
            w.qkv, w.o_proj, w.gate_up, w.down = (layout(t) for t in (w.qkv, w.o_proj, w.gate_up, w.down))
        self.lm_head = TiledWeight.int8(self.lm_head)
        self.linear_kind = "tiled"

    def _small_weights_to(self, dtype: torch.dtype) -> None:
        """The norms' weights and the QKV bias in `dtype` (what they multiply and add to); the linears keep theirs."""
        self.final_norm = self.final_norm.to(dtype)
        for w in self.layers:
            w.input_norm, w.post_norm = w.input_norm.to(dtype), w.post_norm.to(dtype)
            w.q_norm = w.q_norm.to(dtype) if w.q_norm is not None else None
            w.k_norm = w.k_norm.to(dtype) if w.k_norm is not None else None
            w.qkv_bias = w.qkv_bias.to(dtype) if w.qkv_bias is not None else None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `ids` in the activations' dtype (a fresh tensor)."""
        return self.embed[ids].to(self.dtype)

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        bias = None
        if attn.q_proj.bias is not None:
            bias = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=qkv,
            qkv_bias=bias,
            q_norm=q_norm.weight.detach() if q_norm is not None else None,
            k_norm=k_norm.weight.detach() if k_norm is not None else None,
            o_proj=attn.o_proj.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=_fuse_linears([mlp.gate_proj, mlp.up_proj]),
            down=mlp.down_proj.weight.detach(),
        )

    def _build_rope(self, config, max_len: int) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope type {rope.get('rope_type')} is not supported")
        dim = self.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=self.device) / dim))
        t = torch.arange(max_len, dtype=torch.float32, device=self.device)
        freqs = torch.outer(t, inv_freq)
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(self.dtype)

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables at each row's position [N, 1, D], gathered once per forward for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def _qkv(self, w: LayerWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
             lora: LoraBatch | None, layer: int):
        """h: [N, hidden]; rope: `_rope_at(positions)` -> q [N, H, D], k/v [N, Hkv, D] with RoPE applied."""
        x = linear(h, w.qkv, w.qkv_bias)
        if lora:
            x = lora.add(layer, "qkv", h, x)
        d, nq, nk = self.head_dim, self.n_heads, self.n_kv
        v = x[:, (nq + nk) * d :].view(-1, nk, d)
        if w.q_norm is None:  # q and k side by side in x: one RoPE over both heads
            qk = self.ops.rope(x[:, : (nq + nk) * d].view(-1, nq + nk, d), *rope)
            return qk[:, :nq], qk[:, nq:], v
        q = rms_norm(x[:, : nq * d].view(-1, nq, d), w.q_norm, self.eps)
        k = rms_norm(x[:, nq * d : (nq + nk) * d].view(-1, nk, d), w.k_norm, self.eps)
        return self.ops.rope(q, *rope), self.ops.rope(k, *rope), v

    def _o_proj(self, w: LayerWeights, attn: torch.Tensor, lora: LoraBatch | None, layer: int) -> torch.Tensor:
        out = linear(attn, w.o_proj)
        return lora.add(layer, "o_proj", attn, out) if lora else out

    def _mlp(self, w: LayerWeights, x: torch.Tensor, lora: LoraBatch | None, layer: int) -> torch.Tensor:
        """x: the post-attention-normed hidden states."""
        gate_up = linear(x, w.gate_up)
        if lora:
            gate_up = lora.add(layer, "gate_up", x, gate_up)
        act = self.ops.silu_mul(gate_up)
        out = linear(act, w.down)
        return lora.add(layer, "down", act, out) if lora else out

    def _layers(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lora: LoraBatch | None,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Every decoder layer over the embeddings h [N, hidden] (a fresh tensor: the native ops update it in place).
        `attend(layer, q, k, v)` writes the layer's k/v into the cache and returns the attention output [N, H*D].
        Returns the final-normed hidden states [N, hidden]; each residual add is fused with the norm after it."""
        ops, layers = self.ops, self.layers
        normed = ops.norm(h, layers[0].input_norm)
        for i, w in enumerate(layers):
            q, k, v = self._qkv(w, normed, rope, lora, i)
            h, normed = ops.add_norm(h, self._o_proj(w, attend(i, q, k, v), lora, i), w.post_norm)
            after = layers[i + 1].input_norm if i + 1 < len(layers) else self.final_norm
            h, normed = ops.add_norm(h, self._mlp(w, normed, lora, i), after)
        return normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed hidden states [N, hidden] -> [N, V] float32 logits."""
        return linear(normed, self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slot: int, token_ids: list[int], start: int, lora: LoraBatch | None = None,
                embeds: torch.Tensor | None = None, sample: bool = True) -> torch.Tensor | None:
        """Run `token_ids` for one slot from position `start` (its block table covers them); returns logits of the
        last token [V], or None when not `sample` (a chunk before the prompt's last: no LM head). `lora`: one row
        per token of the chunk."""
        n = len(token_ids)
        end = start + n
        positions = torch.arange(start, end, device=self.device)
        h = self._embed(stage(token_ids, torch.long, self.device)) if embeds is None \
            else embeds.to(self.device, self.dtype, copy=True)
        table = cache.device_tables(slot, slot + 1)[0]
        block, offset = cache.locate(table, positions)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(i, block, offset, k, v)
            return chunk_attention(q, cache.k[i], cache.v[i], table, start, self.native_attention,
                                   self.bf16_attention, **cache.scales(i)).reshape(n, -1)

        normed = self._layers(h, self._rope_at(positions), lora, attend)
        return self.logits(normed[-1:])[0] if sample else None

    @torch.inference_mode()
    def prefill_batch(self, cache: KVCache, slots: list[int], prompts: list[list[int]],
                      starts: list[int] | None = None, lora: LoraBatch | None = None) -> torch.Tensor:
        """The prompts of several new sequences in one forward; returns [k, V] last logits.
        `starts`: positions already in each slot (a cached prefix), so `prompts` are the rest of each
        prompt; None: whole prompts. `lora`: one row per token of the forward (`batch_token_adapters`).

        Our kernels take the prompts end to end (`forward_packed`). Under SDPA each prompt is right-padded to the
        longest: only real tokens write K/V, and a pad query attends to its row's real keys (its garbage stays
        finite and goes nowhere).
        """
        k, longest = len(prompts), max(len(p) for p in prompts)
        starts = starts or [0] * k
        if self.native_attention:
            return self.forward_packed(cache, slots, prompts, starts, lora=lora)
        span = max(s + len(p) for s, p in zip(starts, prompts, strict=True))  # keys any row reads
        # one host->device copy of the padded ids, the lengths and the starts
        staged = stage([p + [0] * (longest - len(p)) + [len(p), start]
                        for p, start in zip(prompts, starts, strict=True)], torch.long, self.device)
        ids, lengths, start_t = staged[:, :longest], staged[:, longest], staged[:, longest + 1]
        positions = start_t[:, None] + torch.arange(longest, device=self.device)  # [k, T]
        h = self._embed(ids.reshape(-1))
        tables = cache.tables_of(slots)
        keys = torch.arange(span, device=self.device)[None, None, :]
        # [k, 1, T, span]: causal from each row's own start, and never past its own last token
        mask = ((keys <= positions[:, :, None]) & (keys < (start_t + lengths)[:, None, None]))[:, None]
        real = (positions < (start_t + lengths)[:, None]).reshape(-1).nonzero()[:, 0]  # the tokens that are not pads
        token_rows = torch.arange(k, device=self.device).repeat_interleave(longest)[real]
        block, offset = cache.locate(tables, positions.reshape(-1)[real], token_rows)
        rope = self._rope_at(positions.reshape(-1).clamp(max=cache.max_len - 1))  # a pad may run past the cache

        def attend(i: int, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
            cache.write(i, block, offset, kk[real], vv[real])
            q = q.view(k, longest, self.n_heads, self.head_dim)
            keys_k, keys_v = cache.gather(i, tables, span)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys_k, keys_v, attn_mask=mask,
                                                  enable_gqa=True).transpose(1, 2)
            return attn.reshape(k * longest, -1)

        normed = self._layers(h, rope, lora, attend)
        return self.logits(normed.view(k, longest, -1)[torch.arange(k, device=self.device), lengths - 1])

    @torch.inference_mode()
    def forward_packed(self, cache: KVCache, slots: list[int], chunks: list[list[int]], starts: list[int],
                       decode: int = 0, sample: list[bool] | None = None, lora: LoraBatch | None = None,
                       embeds: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Several sequences' tokens end to end in one forward, with no padding, under our attention kernels
        (`native_attention`): chunk i continues the sequence in `slots[i]` from position `starts[i]`. The first
        `decode` chunks are decode rows (one token each; our decode kernel writes and reads their K/V), so one
        forward can decode some rows while it prefills others. Every linear row costs the same and gets the same
        bits whichever batch it is in, and attention runs chunk by chunk, so each row's bits are the ones it has
        alone. Prompts of 40 to 320 tokens padded to the longest would cost about half again as much.
        Returns [r, V] logits: each decode row's, then the last token's of each other chunk that samples (`sample`:
        a flag per chunk; None: all). `lora`: one row per token; `embeds`: per chunk, input embeddings that replace
        its tokens' (None: the tokens')."""
        bounds = [0]
        for chunk in chunks:
            bounds.append(bounds[-1] + len(chunk))
        # one host->device copy: the ids, each token's position and its chunk (for its block table)
        staged = stage([[t for c in chunks for t in c],
                        [start + i for c, start in zip(chunks, starts, strict=True) for i in range(len(c))],
                        [row for row, c in enumerate(chunks) for _ in c]], torch.long, self.device)
        positions = staged[1]
        h = self._embed(staged[0])
        for row, rows_embeds in enumerate(embeds or []):
            if rows_embeds is not None:
                h[bounds[row] : bounds[row + 1]] = rows_embeds.to(self.device, self.dtype)
        tables = cache.tables_of(slots)
        block, offset = cache.locate(tables, positions, staged[2])
        decode_tables, decode_positions = tables[:decode], positions[:decode]

        def attend(i: int, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
            q = q.view(-1, self.n_heads, self.head_dim)
            attn = torch.empty_like(q)
            if decode:
                attn[:decode] = decode_attention(q[:decode], kk[:decode], vv[:decode], cache.k[i], cache.v[i],
                                                 decode_tables, decode_positions, self.bf16_attention,
                                                 **cache.scales(i))
            if bounds[-1] > decode:
                cache.write(i, block[decode:], offset[decode:], kk[decode:], vv[decode:])
            for row in range(decode, len(chunks)):
                a, b = bounds[row], bounds[row + 1]
                attn[a:b] = chunk_attention(q[a:b], cache.k[i], cache.v[i], tables[row], starts[row], native=True,
                                            bf16=self.bf16_attention, **cache.scales(i))
            return attn.reshape(bounds[-1], -1)

        normed = self._layers(h, self._rope_at(positions), lora, attend)
        last = [b - 1 for row, b in enumerate(bounds[1:]) if row < decode or sample is None or sample[row]]
        return self.logits(normed[last])

    def decode_hidden(self, cache: KVCache, token_tensor: torch.Tensor, positions_t: torch.Tensor, span: int,
                      lora: LoraBatch | None = None, masked: bool = True, tables: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """One decode step for slots 0..B-1 on device tensors, with no host sync (so a CUDA graph can capture
        it): `span` cache positions are read, and each row attends to its own filled prefix only when `masked`.
        `tables`: the rows' block tables [B, max_blocks] (None: the cache's own for slots 0..B-1).
        Returns the final-normed hidden states [B, hidden]; `logits` applies the LM head."""
        b = token_tensor.shape[0]
        h = self._embed(token_tensor)
        tables = cache.device_tables(0, b) if tables is None else tables
        if self.native_attention:  # our kernel writes k/v too, and reads each row's own prefix: no mask to build

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return decode_attention(q, k, v, cache.k[i], cache.v[i], tables, positions_t,
                                        self.bf16_attention, **cache.scales(i)).reshape(b, -1)
        else:
            group = self.n_heads // self.n_kv
            block, offset = cache.locate(tables, positions_t)
            # [B, 1, 1, span]: each row attends to its own filled prefix only
            mask = (torch.arange(span, device=self.device)[None, :] <= positions_t[:, None])[:, None, None, :] \
                if masked else None

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cache.write(i, block, offset, k, v)
                keys_k, keys_v = cache.gather(i, tables, span)
                # GQA folded into the query-length axis: [B, Hkv, group, D] against [B, Hkv, span, D]
                attn = F.scaled_dot_product_attention(q.view(b, self.n_kv, group, self.head_dim), keys_k, keys_v,
                                                      attn_mask=mask)
                return attn.reshape(b, -1)

        return self._layers(h, self._rope_at(positions_t), lora, attend)
