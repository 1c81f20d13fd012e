"""The precision decision on hand-built probes of each kind of machine.

Probe figures are shaped like real measurements (`looprl doctor` prints them): an
AVX-512 BF16 EPYC, the same CPU forced to AVX2 (bf16 weights do not pack, bf16 emulated),
an aarch64 CPU whose flags settle nothing, and GPUs with and without bf16.
"""

from __future__ import annotations

import pytest

from looprl.config import ConfigError, EngineConfig, load_config
from looprl.precision import (
    CPU,
    PrecisionError,
    Probe,
    decide_engine,
    decide_train,
    engine_precision,
)

EPYC_FLAGS = frozenset(["avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"])
PACK_ERROR = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
    "avx512bw, avx512vl and avx512dq"
)


def avx512_bf16() -> Probe:
    return Probe(
        "cpu",
        (576, 1536),
        "AVX512",
        {"float32": None, "bfloat16": None},
        {
            ("float32", "plain"): 760.0,
            ("float32", "packed"): 580.0,
            ("bfloat16", "plain"): 345.0,
            ("bfloat16", "packed"): 290.0,
        },
        {"float32": 9000.0, "bfloat16": 3600.0},
        cpu=CPU("AMD EPYC", 2, "x86_64", EPYC_FLAGS),
    )


def avx2_only() -> Probe:
    """The same CPU with torch capped to AVX2: bf16 does not pack and is emulated."""
    return Probe(
        "cpu",
        (576, 1536),
        "AVX2",
        {"float32": None, "bfloat16": PACK_ERROR},
        {
            ("float32", "plain"): 680.0,
            ("float32", "packed"): 550.0,
            ("bfloat16", "plain"): 11000.0,
        },
        {"float32": 24000.0, "bfloat16": 64000.0},
        cpu=CPU("AMD EPYC", 2, "x86_64", frozenset({"avx2"})),
    )


def aarch64(bf16_us: float) -> Probe:
    """Flags that settle nothing: bf16 packs, no x86 bf16 instructions; timings decide."""
    return Probe(
        "cpu",
        (576, 1536),
        "SVE256",
        {"float32": None, "bfloat16": None},
        {
            ("float32", "plain"): 1000.0,
            ("float32", "packed"): 900.0,
            ("bfloat16", "plain"): bf16_us,
            ("bfloat16", "packed"): bf16_us,
        },
        {"float32": 9000.0, "bfloat16": 9000.0 * bf16_us / 900.0},
        cpu=CPU("Neoverse", 2, "aarch64", frozenset({"bf16", "sve"})),
    )


def gpu(bf16: bool) -> Probe:
    return Probe("cuda", (576, 1536), "NVIDIA H100" if bf16 else "Tesla V100", cuda_bf16=bf16)


def test_auto_on_a_cpu_with_hardware_bf16_picks_bfloat16_packed_and_autocast():
    engine = decide_engine("auto", "auto", avx512_bf16())
    assert (engine.dtype, engine.weight_layout, engine.warning) == ("bfloat16", "packed", None)
    # 580 / 290 us: the measured factor is in the reason, with the CPU kind.
    assert "AVX-512 BF16" in engine.reason and "2.0x faster than float32" in engine.reason
    train = decide_train("auto", "float32", avx512_bf16())
    assert (train.dtype, train.autocast) == ("bfloat16", True)
    assert "2.5x faster" in train.reason  # 9000 / 3600


def test_auto_on_avx2_picks_float32_packed_and_says_why():
    engine = decide_engine("auto", "auto", avx2_only())
    assert (engine.dtype, engine.weight_layout) == ("float32", "packed")
    # 11000 / 550 us
    assert "no hardware bf16" in engine.reason and "20.0x slower than float32" in engine.reason
    train = decide_train("auto", "float32", avx2_only())
    assert (train.dtype, train.autocast) == ("float32", False)
    assert "bf16 autocast measured 2.7x slower" in train.reason  # 64000 / 24000
    assert train.describe().startswith("training float32 (")


def test_bf16_packing_where_it_cannot_pack_names_the_field_the_reason_and_the_fix():
    with pytest.raises(PrecisionError) as error:
        decide_engine("bfloat16", "packed", avx2_only())
    message = str(error.value)
    assert "engine.weight_layout=packed with engine.dtype=bfloat16" in message
    assert PACK_ERROR in message and "AVX2 kernels" in message
    assert "engine.weight_layout=auto" in message and "engine.dtype=float32" in message


def test_explicit_bfloat16_on_avx2_runs_on_plain_weights_with_a_warning():
    engine = decide_engine("bfloat16", "auto", avx2_only())
    assert (engine.dtype, engine.weight_layout) == ("bfloat16", "plain")
    assert PACK_ERROR in engine.reason
    assert engine.warning.startswith("engine.dtype=bfloat16: ")
    assert (
        "20.0x slower than float32" in engine.warning and "auto would use float32" in engine.warning
    )
    train = decide_train("bfloat16", "float32", avx2_only())
    assert train.autocast and "2.7x slower" in train.warning


def test_explicit_choices_that_run_well_have_no_warning():
    assert decide_engine("float32", "plain", avx512_bf16()).warning is None
    assert decide_engine("bfloat16", "auto", avx512_bf16()).warning is None
    assert decide_train("float32", "float32", avx2_only()).warning is None


def test_packed_asked_for_with_auto_dtype_takes_the_dtype_that_packs():
    engine = decide_engine("auto", "packed", avx2_only())
    assert (engine.dtype, engine.weight_layout) == ("float32", "packed")


def test_where_flags_settle_nothing_the_timings_decide():
    assert aarch64(bf16_us=700.0).hardware_bf16 is None
    # 900 / 700 = 1.29x >= 1.2: worth bf16's rounding; 900 / 800 = 1.125x: not.
    assert decide_engine("auto", "auto", aarch64(bf16_us=700.0)).dtype == "bfloat16"
    assert decide_engine("auto", "auto", aarch64(bf16_us=800.0)).dtype == "float32"
    assert decide_train("auto", "float32", aarch64(bf16_us=700.0)).autocast
    assert not decide_train("auto", "float32", aarch64(bf16_us=800.0)).autocast


def test_hardware_bf16_overrides_a_timing_skewed_by_a_busy_machine():
    found = avx512_bf16()
    found.decode_us[("bfloat16", "packed")] = 600.0  # measured while another job ran
    assert found.hardware_bf16 and decide_engine("auto", "auto", found).dtype == "bfloat16"


def test_plain_weights_when_they_measured_clearly_faster_than_packed():
    found = avx512_bf16()
    found.decode_us[("float32", "packed")] = 1000.0  # > 1.2 x 760
    assert decide_engine("float32", "auto", found).weight_layout == "plain"
    found.decode_us[("float32", "packed")] = 900.0  # within 1.2x: packed stays
    assert decide_engine("float32", "auto", found).weight_layout == "packed"


def test_gpus():
    assert decide_engine("auto", "auto", gpu(True)).dtype == "bfloat16"
    assert decide_engine("auto", "auto", gpu(False)).dtype == "float32"
    assert decide_train("auto", "float32", gpu(True)).autocast
    with pytest.raises(PrecisionError, match="Tesla V100 has no bfloat16.*engine.dtype=auto"):
        decide_engine("bfloat16", "auto", gpu(False))
    with pytest.raises(PrecisionError, match="train.compute_dtype=auto or float32"):
        decide_train("bfloat16", "float32", gpu(False))
    with pytest.raises(PrecisionError, match="oneDNN's CPU layout.*weight_layout=auto"):
        decide_engine("auto", "packed", gpu(True))


def test_cuda_graphs_are_on_with_a_cuda_gpu_and_refused_elsewhere():
    on_gpu = decide_engine("auto", "auto", gpu(True))
    assert on_gpu.cuda_graphs and on_gpu.kernels == "portable"
    assert on_gpu.describe().startswith(
        "engine bfloat16, plain weights, portable kernels, CUDA graphs"
    )
    assert not decide_engine("auto", "auto", gpu(True), requested_graphs="off").cuda_graphs
    assert decide_engine("auto", "auto", gpu(True), requested_graphs="on").cuda_graphs
    for cpu in (avx2_only(), avx512_bf16()):
        assert not decide_engine("auto", "auto", cpu).cuda_graphs
        assert not decide_engine("auto", "auto", cpu, requested_kernels="portable").cuda_graphs
        with pytest.raises(PrecisionError, match="cuda_graphs=on .* runs on cpu .*auto or off"):
            decide_engine("auto", "auto", cpu, requested_graphs="on")
    with pytest.raises(PrecisionError, match="cuda_graphs=on .* a server at engine.url"):
        decide_engine("auto", "auto", gpu(True), remote_url=True, requested_graphs="on")
    assert not decide_engine("auto", "auto", gpu(True), remote_url=True).cuda_graphs
    with pytest.raises(ValueError, match="engine.cuda_graphs='on' applies to the local engine"):
        EngineConfig(type="vllm", url="http://127.0.0.1:8000", cuda_graphs="on")


def test_a_server_at_engine_url_gets_bfloat16_weights_whatever_this_machine_runs():
    cfg = EngineConfig(type="vllm", url="http://127.0.0.1:8000")
    decided = engine_precision(cfg, avx2_only())
    assert decided.dtype == "bfloat16" and "casts" in decided.reason


def test_bfloat16_master_weights_compute_in_bfloat16_without_autocast():
    train = decide_train("auto", "bfloat16", avx2_only())
    assert (train.dtype, train.autocast) == ("bfloat16", False)
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        load_config(None, ["model.dtype=bfloat16", "train.compute_dtype=float32"])


def test_the_cpu_kind_names_what_decides_bf16_speed():
    def kind(flags: str, arch: str = "x86_64") -> str:
        return CPU("x", 2, arch, frozenset(flags.split())).kind

    assert kind("avx2 avx512f avx512_bf16 amx_bf16") == "AMX"
    assert kind("avx2 avx512f avx512_bf16") == "AVX-512 BF16"
    assert kind("avx2 avx512f avx512bw") == "AVX-512"
    assert kind("avx2 fma") == "AVX2"
    assert kind("sse4_2") == "x86 without AVX2"
    assert kind("bf16 sve", "aarch64") == "aarch64 with bf16"
