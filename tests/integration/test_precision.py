"""The precision probe against what torch really does, here and on a forced AVX2 CPU.

`LOOPRL_FORCE_CPU=avx2` (or the three variables it sets) caps torch's kernels at AVX2 on
any x86 machine, so the AVX2 path is proven where the machine has AVX-512 too. Children
get a clean environment: the forcing variables are set only where a test says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looprl import runtime
from looprl.precision import cpu, probe

LOOPRL = str(Path(sys.executable).with_name("looprl"))
AVX2_VARIABLES = runtime.FORCED_CPU_SETTINGS["avx2"]
PROBE_SCRIPT = """
import json, looprl
from looprl.precision import decide_engine, decide_train, probe
found = probe("cpu", 576, 1536)
print(json.dumps({
    "capability": found.capability,
    "bf16_pack_error": found.pack_errors["bfloat16"],
    "hardware_bf16": found.hardware_bf16,
    "engine": decide_engine("auto", "auto", found).describe(),
    "train": decide_train("auto", "float32", found).describe(),
}))
"""

pytestmark = pytest.mark.skipif(
    cpu().arch not in ("x86_64", "amd64"), reason="AVX2 is forced on x86 CPUs only"
)


def unforced_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*AVX2_VARIABLES, runtime.FORCE_CPU_VARIABLE)
    }
    return env | extra


def run_probe(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "env",
    [{runtime.FORCE_CPU_VARIABLE: "avx2"}, AVX2_VARIABLES],
    ids=["LOOPRL_FORCE_CPU", "the-three-variables"],
)
def test_on_a_forced_avx2_cpu_the_probe_finds_no_bf16_by_itself(env):
    """The probe answers from what torch does: the same answer whether looprl set the
    variables (LOOPRL_FORCE_CPU) or they came from outside, unknown to looprl."""
    found = run_probe(unforced_env(**env))
    assert found["capability"] == "AVX2"
    assert "bf16 path needs the cpu support" in found["bf16_pack_error"]
    assert found["hardware_bf16"] is False
    # float32; packed or plain weights is a timing measured at start (CI's run once
    # measured plain faster than packed under forced AVX2), so either layout is right.
    assert re.match(r"engine float32, (packed|plain) weights \(", found["engine"])
    assert "no hardware bf16" in found["engine"]
    assert found["train"].startswith("training float32 (")


def test_the_probe_agrees_with_torch_on_this_cpu():
    """bf16 weights pack exactly where oneDNN's bf16 kernels are in torch's reach: torch
    runs AVX-512 kernels on a CPU with AVX-512 BW/VL/DQ, or the CPU has AVX-NE-CONVERT."""
    found = probe("cpu", 576, 1536)
    flags = cpu().flags
    avx512 = (
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and {
            "avx512bw",
            "avx512vl",
            "avx512dq",
        }
        <= flags
    )
    assert found.can_pack("bfloat16") == (avx512 or "avx_ne_convert" in flags)
    assert found.can_pack("float32")
    assert found.capability == torch.backends.cpu.get_cpu_capability()


def test_an_impossible_setting_fails_before_anything_starts(tiny_model_dir, tmp_path):
    """bf16 packing where the probe says no: exit 2 with the field and the fix, no
    traceback, and nothing trained or written but the log."""
    run = subprocess.run(
        [
            LOOPRL,
            "train",
            f"model.path={tiny_model_dir}",
            "engine.dtype=bfloat16",
            "engine.weight_layout=packed",
            f"run.fileroot={tmp_path}",
        ],
        env=unforced_env(**{runtime.FORCE_CPU_VARIABLE: "avx2"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    message = " ".join(run.stderr.split())
    assert "engine.weight_layout=packed with engine.dtype=bfloat16" in message
    assert "oneDNN cannot pack bfloat16 weights" in message
    assert "engine.weight_layout=auto" in message and "engine.dtype=float32" in message
    assert "Traceback" not in run.stderr
    trial = tmp_path / "default" / "trial0"
    assert not (trial / "metrics.jsonl").exists() and not (trial / "config.yaml").exists()


def test_an_unknown_forced_cpu_is_refused_by_name():
    run = subprocess.run(
        [sys.executable, "-c", "import looprl"],
        env=unforced_env(**{runtime.FORCE_CPU_VARIABLE: "avx3"}),
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert "LOOPRL_FORCE_CPU='avx3' is not one of avx2" in run.stderr


def test_forcing_after_torch_ran_wider_kernels_is_refused():
    """torch fixes its kernels at its first op: forcing later cannot take effect, and
    says so instead of silently testing the wrong path."""
    script = (
        "import os, torch; torch.ones(4) + 1; "
        f"os.environ['{runtime.FORCE_CPU_VARIABLE}'] = 'avx2'; import looprl"
    )
    here = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=unforced_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if here in ("AVX2", "DEFAULT"):
        pytest.skip(f"torch runs {here} kernels here already: nothing can come too late")
    run = subprocess.run(
        [sys.executable, "-c", script], env=unforced_env(), capture_output=True, text=True
    )
    assert run.returncode != 0
    assert f"came too late: torch was imported and already runs with {here}" in run.stderr
    assert "Import looprl before torch" in run.stderr
