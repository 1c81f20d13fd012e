"""Precision and kernels chosen from the machine: what `engine.dtype`,
`engine.weight_layout` and `train.compute_dtype` mean when they are `auto`, and whether
an explicit choice can run here.

Why it is found out, not assumed. The same bfloat16 code runs 2-3x faster than float32
on a CPU with AVX-512 BF16 or AMX, and many times slower on one with AVX2 only, where
bf16 is emulated and oneDNN refuses to pack bf16 weights at all ("bf16 path needs the
cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq").

`probe` asks torch itself, at the model's own layer shape (hidden -> intermediate, at
least 256 -> 1024 so that a tiny test model still times matmuls, not overheads):
- which kernels torch runs (`torch.backends.cpu.get_cpu_capability()`: capped by
  ATEN_CPU_CAPABILITY, which the CPU flags do not show);
- whether oneDNN packs weights in each dtype, and whether the packed weights compute
  what `F.linear` does;
- how long one linear layer takes in float32 and bfloat16, packed and plain, at a
  decode batch (64 rows: the engine), and at a training micro-batch (512 rows) in
  float32 and under bf16 autocast over float32 weights (the trainer). Variants are
  timed in interleaved rounds, best of each, so a busy machine skews them alike.

Whether bf16 is fast here (`Probe.hardware_bf16`) is settled by facts where they are
decisive: bf16 weights that do not pack mean emulated bf16 (no); x86 bf16 instructions
(AVX-512 BF16, AMX) that torch's AVX-512 kernels reach mean yes. Elsewhere (AVX-512
without BF16, AVX-NE-CONVERT, aarch64) the timings decide: bf16 must measure
`MIN_SPEEDUP` x faster than float32, since it costs logprob accuracy.

For `auto`:
- engine: bfloat16 where bf16 is fast, else float32. Weights packed in oneDNN's blocked
  layout where that dtype packs (unless plain measured `MIN_SPEEDUP` x faster), else
  plain matmuls. A vLLM/SGLang server launched here gets the dtype; a server at
  `engine.url` casts what it loads to its own, so it gets bfloat16 (half the bytes).
- training: bf16 autocast over float32 master weights where bf16 is fast, else float32.
- On a GPU: bfloat16 where `torch.cuda.is_bf16_supported()`, plain weights.

An explicit value that cannot run here raises PrecisionError naming the field, the
reason and the setting that works, before anything starts; one that runs but measured
slower than the alternative comes back with a warning that gives the factor. The probe
runs once per process, device and shape (~0.3 s; ~1 s where bf16 is emulated).

Only start-up (looprl/startup.py) calls the probe and the decisions, once per command;
the engine and the trainer receive what was decided and never see `auto`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from looprl.config import EngineConfig

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.2
DECODE_ROWS, TRAIN_ROWS = 64, 512
_MIN_IN, _MIN_OUT = 256, 1024
_SLOW = 4.0  # a variant this much slower than float32 on its first call is not timed again
_X86 = ("x86_64", "amd64")


class PrecisionError(ValueError):
    """An explicit precision or kernel setting that cannot run on this machine."""


@dataclass(frozen=True)
class CPU:
    """This machine's CPU as the OS reports it."""

    model: str
    cores: int
    arch: str
    flags: frozenset[str]

    @property
    def kind(self) -> str:
        """What decides bf16 speed: AMX, AVX-512 BF16, AVX-512, AVX2, or the architecture."""
        if self.arch not in _X86:
            return self.arch + (" with bf16" if "bf16" in self.flags else "")
        for flag, name in (
            ("amx_bf16", "AMX"),
            ("avx512_bf16", "AVX-512 BF16"),
            ("avx512f", "AVX-512"),
            ("avx2", "AVX2"),
        ):
            if flag in self.flags:
                return name
        return "x86 without AVX2"

    @property
    def bf16_instructions(self) -> bool:
        """x86 instructions that compute in bf16 (not only convert to and from it)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def isa(self) -> str:
        """The flags that matter for bf16, e.g. 'avx2 avx512f avx512bw avx512_bf16'."""
        wanted = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx_ne_convert", "amx_bf16")
        present = [f for f in wanted if f in self.flags]
        return " ".join(present) if present else "none of " + " ".join(wanted)

    def describe(self) -> str:
        return f"{self.model}, {self.cores} cores, {self.kind} ({self.isa})"


@functools.cache
def cpu() -> CPU:
    """Read /proc/cpuinfo (Linux); elsewhere only the architecture and the core count."""
    arch = platform.machine().lower()
    model, flags = "", frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    return CPU(model or platform.processor() or arch, os.cpu_count() or 1, arch, flags)


@dataclass(frozen=True)
class Probe:
    """What torch does on one device at one linear layer's shape.

    `pack_errors[dtype]`: None where oneDNN packs that dtype (and the packed weights
    compute what F.linear does), else why not. `decode_us[(dtype, layout)]`: one
    (64, in) x (in, out) linear; `train_us[dtype]`: one (512, in) linear in float32,
    or under bf16 autocast over float32 weights ('bfloat16'). In microseconds.
    """

    device: str
    shape: tuple[int, int]  # (in, out) features
    capability: str  # torch's CPU kernels (AVX2, AVX512, ...), or the GPU's name
    pack_errors: dict[str, str | None] = field(default_factory=dict)
    decode_us: dict[tuple[str, str], float] = field(default_factory=dict)
    train_us: dict[str, float] = field(default_factory=dict)
    cuda_bf16: bool = False
    cpu: CPU | None = None

    def can_pack(self, dtype: str) -> bool:
        return self.device == "cpu" and self.pack_errors.get(dtype) is None

    def layout(self, dtype: str) -> str:
        """packed where `dtype` packs, unless plain measured MIN_SPEEDUP x faster."""
        if not self.can_pack(dtype):
            return "plain"
        packed, plain = self.decode_us[(dtype, "packed")], self.decode_us[(dtype, "plain")]
        return "plain" if packed > MIN_SPEEDUP * plain else "packed"

    def engine_speedup(self) -> float:
        """float32 time / bfloat16 time of a decode linear, each in its own layout."""
        f32 = self.decode_us[("float32", self.layout("float32"))]
        return f32 / self.decode_us[("bfloat16", self.layout("bfloat16"))]

    def train_speedup(self) -> float:
        """float32 time / bf16-autocast time of a training linear."""
        return self.train_us["float32"] / self.train_us["bfloat16"]

    @property
    def hardware_bf16(self) -> bool | None:
        """True: bf16 runs on bf16 hardware here; False: it is emulated; None: the facts
        do not say (the timings decide)."""
        if self.device != "cpu":
            return self.cuda_bf16 if self.device == "cuda" else None
        if not self.can_pack("bfloat16"):
            return False  # oneDNN has no bf16 kernels here: bf16 is emulated
        x86 = self.cpu is not None and self.cpu.arch in _X86
        if x86 and self.cpu.bf16_instructions and self.capability.startswith("AVX512"):
            return True
        return None

    def where(self) -> str:
        """'AVX-512 BF16, AVX512 kernels', or the GPU's name."""
        if self.device != "cpu":
            return self.capability
        kind = self.cpu.kind if self.cpu is not None else "CPU"
        return f"{kind}, {self.capability} kernels"


@dataclass(frozen=True)
class EnginePrecision:
    dtype: str  # float32 | bfloat16
    weight_layout: str  # packed | plain (the local engine's fused forward)
    reason: str
    warning: str | None = None  # an explicit choice measured slower than the alternative
    # The local engine's fused-forward kernels: cpu (oneDNN packing, batched-matmul decode
    # attention) | portable (plain torch: F.linear, scaled_dot_product_attention; any device)
    kernels: str = "cpu"
    # Decode steps replayed from CUDA graphs (engine.cuda_graphs; the local engine's
    # fused forward, graphs.py)
    cuda_graphs: bool = False

    def describe(self) -> str:
        kernels = ", portable kernels" if self.kernels == "portable" else ""
        kernels += ", CUDA graphs" if self.cuda_graphs else ""
        return f"engine {self.dtype}, {self.weight_layout} weights{kernels} ({self.reason})"


@dataclass(frozen=True)
class TrainPrecision:
    dtype: str  # what the forward computes in: float32 | bfloat16
    autocast: bool  # bfloat16 compute over float32 master weights
    reason: str
    warning: str | None = None  # an explicit choice measured slower than the alternative

    @classmethod
    def as_set(cls, compute_dtype: str, master_dtype: str) -> TrainPrecision:
        """An explicit train.compute_dtype as it is, over `master_dtype` weights, without
        asking the machine (for a Trainer built outside a run); `auto` is refused."""
        if compute_dtype == "auto":
            raise ValueError(
                "train.compute_dtype=auto is decided at start-up (looprl/startup.py), from "
                "the machine; pass the Trainer that decision (precision=) or an explicit "
                "compute_dtype"
            )
        if master_dtype == "bfloat16":
            return cls("bfloat16", False, "model.dtype: the weights are bfloat16")
        return cls(compute_dtype, compute_dtype == "bfloat16", "train.compute_dtype")

    def describe(self) -> str:
        what = "bf16 autocast over float32 weights" if self.autocast else self.dtype
        return f"training {what} ({self.reason})"


def probe(device: torch.device | str, in_features: int, out_features: int) -> Probe:
    """What torch does on `device` at a linear layer of this shape (cached per process)."""
    device = torch.device(device)
    shape = (max(in_features, _MIN_IN), max(out_features, _MIN_OUT))
    return _probe(device.type, device.index, *shape)


@functools.cache
def _probe(device_type: str, index: int | None, in_features: int, out_features: int) -> Probe:
    shape = (in_features, out_features)
    if device_type == "cuda":
        name = torch.cuda.get_device_name(index)
        return Probe("cuda", shape, name, cuda_bf16=torch.cuda.is_bf16_supported())
    if device_type != "cpu":
        return Probe(device_type, shape, device_type)
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    w32 = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    x32 = torch.randn(DECODE_ROWS, in_features, generator=generator)
    pack_errors: dict[str, str | None] = {}
    decode: dict[tuple[str, str], Callable[[], object]] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x, w = x32.to(dtype), w32.to(dtype)
        decode[(name, "plain")] = functools.partial(F.linear, x, w)
        pack_errors[name] = _pack_error(x, w)
        if pack_errors[name] is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS)
            decode[(name, "packed")] = functools.partial(_packed_linear, x, packed)
    decode_us = _time(decode, reference=("float32", "plain"))
    rows = torch.randn(TRAIN_ROWS, in_features, generator=generator)

    def autocast_linear() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return F.linear(rows, w32)

    train = {"float32": functools.partial(F.linear, rows, w32), "bfloat16": autocast_linear}
    train_us = _time(train, reference="float32")
    found = Probe(
        "cpu",
        shape,
        torch.backends.cpu.get_cpu_capability(),
        pack_errors,
        decode_us,
        train_us,
        cpu=cpu(),
    )
    log.debug("Precision probe (%.2f s): %s", time.perf_counter() - start, found)
    return found


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _pack_error(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why oneDNN cannot pack `w` here (None: it can, and computes what F.linear does)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        got = _packed_linear(x, packed).float()
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    want = F.linear(x.float(), w.float())
    error = float((got - want).abs().max() / want.abs().max())
    tolerance = 1e-4 if x.dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        return f"packed weights compute a different result (relative error {error:.2g})"
    return None


def _time(fns: dict, reference, rounds: int = 5, calls: int = 3) -> dict:
    """Microseconds per call of each of `fns`: the best of `rounds` interleaved rounds of
    `calls` calls each, after one warm-up call. A function whose warm-up took `_SLOW` x
    longer than the reference's keeps its warm-up time and is not called again."""
    warm = {}
    for key, fn in fns.items():
        start = time.perf_counter()
        fn()
        warm[key] = (time.perf_counter() - start) * 1e6
    best = {key: float("inf") for key in fns if warm[key] <= _SLOW * warm[reference]}
    for _ in range(rounds):
        for key in best:
            start = time.perf_counter()
            for _ in range(calls):
                fns[key]()
            best[key] = min(best[key], (time.perf_counter() - start) * 1e6 / calls)
    return {key: best.get(key, warm[key]) for key in fns}


def decide_engine(
    requested_dtype: str,
    requested_layout: str,
    found: Probe,
    *,
    remote_url: bool = False,
    requested_kernels: str = "auto",
    requested_graphs: str = "auto",
) -> EnginePrecision:
    """The engine's dtype, weight layout, kernels and CUDA graphs for the requested
    values (each may be 'auto') on the machine `found` describes. Raises PrecisionError
    for a choice that cannot run here."""
    if requested_graphs == "on" and (remote_url or found.device != "cuda"):
        where = "a server at engine.url" if remote_url else f"{found.device} ({found.capability})"
        raise PrecisionError(
            f"engine.cuda_graphs=on replays the local engine's decode steps on a CUDA GPU, "
            f"and the engine runs on {where}: set engine.cuda_graphs=auto or off"
        )
    if remote_url:
        if requested_dtype != "auto":
            return EnginePrecision(requested_dtype, "plain", "engine.dtype")
        why = "the server at engine.url casts what it loads to its own dtype"
        return EnginePrecision("bfloat16", "plain", why)
    if found.device != "cpu":
        if requested_kernels == "cpu":
            raise PrecisionError(
                f"engine.kernels=cpu are the CPU-tuned kernels (oneDNN) and the engine runs "
                f"on {found.device} ({found.capability}): set engine.kernels=auto or portable"
            )
        decided = _engine_on_gpu(requested_dtype, requested_layout, found)
        graphs = found.device == "cuda" and requested_graphs != "off"
        return replace(decided, kernels="portable", cuda_graphs=graphs)
    if requested_kernels == "portable":
        if requested_layout == "packed":
            raise PrecisionError(
                "engine.weight_layout=packed is the cpu kernels' layout (oneDNN), and "
                "engine.kernels=portable runs plain F.linear: set engine.weight_layout=auto "
                "or engine.kernels=auto"
            )
        decided = decide_engine(requested_dtype, "plain", found)
        why = f"{decided.reason}; plain weights and portable kernels: engine.kernels=portable"
        return replace(decided, reason=why, kernels="portable")
    fast, why = _bf16_is_fast(found, found.engine_speedup(), "a bfloat16 matmul")
    dtype, warning = requested_dtype, None
    if requested_dtype == "auto":
        dtype = "bfloat16" if fast else "float32"
        if requested_layout == "packed" and not found.can_pack(dtype):
            dtype = "float32" if dtype == "bfloat16" else "bfloat16"  # the one that packs
            why += f"; {dtype}, since packed weights were asked for"
    else:
        if dtype == "bfloat16" and not fast:
            warning = f"engine.dtype=bfloat16: {why}; engine.dtype=auto would use float32"
        why = "engine.dtype"
    if requested_layout == "packed" and not found.can_pack(dtype):
        other = "float32" if dtype == "bfloat16" else "bfloat16"
        fixes = "engine.weight_layout=auto (plain matmuls)"
        if found.can_pack(other):
            fixes += f" or engine.dtype={other} (it packs here)"
        raise PrecisionError(
            f"engine.weight_layout=packed with engine.dtype={dtype}: oneDNN cannot pack "
            f"{dtype} weights on this CPU ({found.where()}): {found.pack_errors[dtype]}. "
            f"Set {fixes}"
        )
    layout = requested_layout
    if layout == "auto":
        layout = found.layout(dtype)
        if layout == "plain":
            why += f"; plain weights: {found.pack_errors[dtype] or 'faster than packed here'}"
    return EnginePrecision(dtype, layout, why, warning)


def _engine_on_gpu(requested_dtype: str, requested_layout: str, found: Probe) -> EnginePrecision:
    if requested_layout == "packed":
        raise PrecisionError(
            f"engine.weight_layout=packed is oneDNN's CPU layout and the engine runs on "
            f"{found.device} ({found.capability}): set engine.weight_layout=auto or plain"
        )
    if requested_dtype == "bfloat16" and not found.cuda_bf16:
        raise PrecisionError(
            f"engine.dtype=bfloat16: {found.capability} has no bfloat16 support; set "
            "engine.dtype=auto or float32"
        )
    if requested_dtype != "auto":
        return EnginePrecision(requested_dtype, "plain", "engine.dtype")
    dtype = "bfloat16" if found.cuda_bf16 else "float32"
    return EnginePrecision(dtype, "plain", _gpu_reason(found))


def decide_train(requested: str, master_dtype: str, found: Probe) -> TrainPrecision:
    """What the trainer computes in for `requested` ('auto', 'float32', 'bfloat16'), its
    master weights in `master_dtype`. Raises PrecisionError for a choice that cannot run
    here."""
    if master_dtype == "bfloat16":
        return TrainPrecision("bfloat16", False, "model.dtype: the weights are bfloat16")
    if found.device == "cuda":
        if requested == "bfloat16" and not found.cuda_bf16:
            raise PrecisionError(
                f"train.compute_dtype=bfloat16: {found.capability} has no bfloat16 "
                "support; set train.compute_dtype=auto or float32"
            )
        if requested == "auto":
            requested = "bfloat16" if found.cuda_bf16 else "float32"
            return TrainPrecision(requested, found.cuda_bf16, _gpu_reason(found))
        return TrainPrecision(requested, requested == "bfloat16", "train.compute_dtype")
    if found.device != "cpu":
        bf16 = requested == "bfloat16"
        return TrainPrecision("bfloat16" if bf16 else "float32", bf16, found.device)
    fast, why = _bf16_is_fast(found, found.train_speedup(), "bf16 autocast")
    if requested == "auto":
        return TrainPrecision("bfloat16" if fast else "float32", fast, why)
    warning = None
    if requested == "bfloat16" and not fast:
        warning = f"train.compute_dtype=bfloat16: {why}; train.compute_dtype=auto would use float32"
    return TrainPrecision(requested, requested == "bfloat16", "train.compute_dtype", warning)


def _bf16_is_fast(found: Probe, speedup: float, what: str) -> tuple[bool, str]:
    """Whether bf16 is the faster choice here, and a sentence saying why."""
    hardware = found.hardware_bf16
    measured = f"{what} measured {_factor(speedup)} float32 here"
    if hardware is False:
        return False, f"{found.where()}: no hardware bf16, {measured}"
    if hardware:
        return True, f"{found.where()}: hardware bf16, {measured}"
    return speedup >= MIN_SPEEDUP, f"{found.where()}: {measured}"


def _factor(speedup: float) -> str:
    if speedup >= 1:
        return f"{speedup:.1f}x faster than"
    return f"{1 / speedup:.1f}x slower than"


def _gpu_reason(found: Probe) -> str:
    return f"{found.capability} {'supports' if found.cuda_bf16 else 'has no'} bfloat16"


@dataclass(frozen=True)
class Precision:
    """A run's decision: the engine's and the trainer's."""

    engine: EnginePrecision
    train: TrainPrecision

    def line(self) -> str:
        return f"Precision: {self.engine.describe()}; {self.train.describe()}"


def engine_precision(cfg: EngineConfig, found: Probe) -> EnginePrecision:
    """`decide_engine` for an engine config."""
    return decide_engine(
        cfg.dtype,
        cfg.weight_layout,
        found,
        remote_url=cfg.url is not None,
        requested_kernels=cfg.kernels,
        requested_graphs=cfg.cuda_graphs,
    )


def layer_shape(config) -> tuple[int, int]:
    """(hidden, intermediate) features of a model config's MLP up-projection."""
    text = config.get_text_config()
    hidden = text.hidden_size
    return hidden, getattr(text, "intermediate_size", None) or 4 * hidden


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
