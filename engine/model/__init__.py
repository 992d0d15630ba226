"""The model: weights lifted from Hugging Face, the fused decoder, KV cache, linear kernels, LoRA."""
