"""Write one Triton model folder (config.pbtxt + 1/model.py) for a Hugging Face model folder, into any repository.

    python -m devstack.add_model <folder> --repository <dir> [--name SERVED] [--kind cpu|gpu] [--model-path PATH]
        [--kv-cache-dtype auto|bfloat16|int8] [--quantization none|int8|int4]

Everything in the profile comes from the model's own files (devstack/model_profile.py). The tensor contract and
the thin model.py are those of model_repository/smollm2_135m_instruct, so every model speaks the same contract
(docs/triton-contract.md). `--model-path` is the folder as the server will see it (e.g. /models/<name> in the NGC
container); by default, this folder's absolute path.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from contract.profile import parse_profile
from devstack.model_profile import Profile, derive

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_MODEL = REPO_ROOT / "model_repository" / "smollm2_135m_instruct"
_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}


def triton_name(served: str) -> str:
    """A Triton model (folder) name for a served name: `Org/Model-1.5B` -> `org_model_1_5b`."""
    name = re.sub(r"[^a-z0-9]+", "_", served.lower()).strip("_")
    return name or "model"


def contract_block() -> str:
    """The `model_transaction_policy`, `input` and `output` declarations of the reference model, verbatim."""
    text = (REFERENCE_MODEL / "config.pbtxt").read_text(encoding="utf-8")
    start = text.index("model_transaction_policy")
    end = text.index("\n]", text.index("\noutput [")) + 2
    return text[start:end]


def render_config(name: str, profile: Profile, kind: str) -> str:
    """config.pbtxt text for Triton model `name`."""
    lines = [
        f"# {profile.served_name}: written by devstack/add_model.py from the model folder's own files.",
        *(f"#   {note}" for note in profile.notes),
        f'name: "{name}"',
        'backend: "python"',
        "max_batch_size: 0",
        contract_block(),
        "",
        "# One engine per instance; it batches internally (continuous batching).",
        f"instance_group [ {{ count: 1, kind: {_KINDS[kind]} }} ]",
        "",
    ]
    for key, value in profile.parameters.items():
        quoted = json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid in protobuf text format
        lines.append(f'parameters: {{ key: "{key}", value: {{ string_value: {quoted} }} }}')
    return "\n".join(lines) + "\n"


def add_model(folder: Path, repository: Path, *, name: str | None = None, kind: str = "cpu",
              model_path: str | None = None, triton_model: str | None = None,
              kv_memory_bytes: int | None = None, kv_cache_dtype: str = "auto", quantization: str = "none") -> Path:
    """Write `<repository>/<triton model>/` for the model in `folder`; returns that folder."""
    if kind not in _KINDS:
        raise ValueError(f"--kind must be one of {', '.join(_KINDS)}, not {kind!r}")
    profile = derive(folder, name=name, kind=kind, model_path=model_path, kv_memory_bytes=kv_memory_bytes,
                     kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    parse_profile(profile.parameters)  # never write a profile the engine would refuse (contract/profile.py)
    target = repository / (triton_model or triton_name(profile.served_name))
    (target / "1").mkdir(parents=True, exist_ok=True)
    (target / "config.pbtxt").write_text(render_config(target.name, profile, kind), encoding="utf-8")
    (target / "1" / "model.py").write_text((REFERENCE_MODEL / "1" / "model.py").read_text(encoding="utf-8"),
                                           encoding="utf-8")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.add_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a Hugging Face model folder (config.json, weights, tokenizer)")
    parser.add_argument("--repository", type=Path, required=True, help="the Triton model repository to write into")
    parser.add_argument("--name", help="served name (default: the config's _name_or_path, else the folder name)")
    parser.add_argument("--kind", choices=sorted(_KINDS), default="cpu", help="cpu: fp32 on the host; gpu: bf16")
    parser.add_argument("--model-path", help="the model folder as the server sees it (default: its absolute path)")
    parser.add_argument("--triton-name", help="the Triton model name (default: derived from the served name)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "int8"), default="auto",
                        help="how K/V are stored (bfloat16: twice the tokens in the same memory, int8 about 4x)")
    parser.add_argument("--quantization", choices=("none", "int8", "int4"), default="none",
                        help="the linears' weights as int8 or 4-bit at load (AVX-512; docs/quantization.md)")
    args = parser.parse_args(argv)
    try:
        target = add_model(args.folder, args.repository, name=args.name, kind=args.kind, model_path=args.model_path,
                           triton_model=args.triton_name, kv_cache_dtype=args.kv_cache_dtype,
                           quantization=args.quantization)
    except (OSError, ValueError) as exc:
        print(f"add_model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
