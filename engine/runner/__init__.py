"""The model runner and its CUDA graphs: inputs in, logits out."""
