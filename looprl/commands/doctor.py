"""`looprl doctor`: checks of this machine against a config, each failure with its fix.

First the start-up checks `looprl train` runs before the model loads (the workflow,
the data, the model paths, the reward, the extras: looprl/preflight.py), one row per
problem. Then, of the machine, only those the config needs: Ray and the node's IP for a
Ray run, rendering where an env is played. Owns the checks: torch and CUDA, the CPU
(kind, ISA flags) and the precision `auto` picks for the engine and the trainer with the
cost of forcing the other, GPUs visible vs what the config uses, NCCL variables, the
Ray address (RAY_ADDRESS, else scheduler.ray_address), whether every node of that
cluster answers at the address it announced (scheduling/reachability.py), the IP this
node would announce, the gateway port, disk space for checkpoints, the code reward's
sandbox (bubblewrap, probed with a real box), and simulator rendering
(looprl/diagnostics/rendering.py: NVIDIA EGL, Vulkan, MUJOCO_GL as set or as env workers
pick it, pygame). Each returns a `Check`; nothing here changes the machine.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path

import torch

from looprl import extras, precision, preflight, runtime, startup
from looprl.config import ENV_WORKFLOW, Config
from looprl.diagnostics.checks import Check
from looprl.diagnostics.rendering import check_rendering
from looprl.models import resolve_model

MIN_FREE_GB = 5.0


def run_checks(cfg: Config) -> list[Check]:
    """The config's start-up checks, then the machine's checks that `cfg` needs: Ray
    and the node's IP only for a Ray run (scheduler.type=ray, or a cluster named by
    RAY_ADDRESS or scheduler.ray_address), rendering only where EnvWorkflow plays an
    env."""
    ray_address = os.environ.get("RAY_ADDRESS") or cfg.scheduler.ray_address
    ray_checks = []
    if cfg.scheduler.type == "ray" or ray_address:
        ray_check = check_ray(ray_address)
        ray_checks = [
            ray_check,
            *(check_ray_nodes(ray_address) if ray_check.status == "ok" else []),
            check_node_ip(),
        ]
    config = check_config(cfg)
    model_found = all(c.name != "models" for c in config)  # else said once, in its row
    return [
        *config,
        check_torch(),
        check_cpu(),
        *(check_precision(cfg) if model_found else []),
        check_gpus(),
        check_nccl(),
        *ray_checks,
        check_port(cfg.gateway.host, cfg.gateway.port),
        check_disk(Path(cfg.run.fileroot)),
        check_sandbox(cfg),
        *(check_rendering() if cfg.workflow.path == ENV_WORKFLOW else []),
    ]


def check_config(cfg: Config) -> list[Check]:
    """The start-up checks of `looprl train` (looprl/preflight.py): a failed row per
    problem, else one ok row."""
    problems = asyncio.run(preflight.check(cfg))
    if not problems:
        return [Check("config", "ok", "workflow, data, model paths, reward and extras hold")]
    return [Check(p.part, "fail", p.detail(), p.fix, p.traceback) for p in problems]


def check_sandbox(cfg: Config) -> Check:
    """Whether reward.type=code can make its box here (a failure only where the config
    uses it)."""
    from looprl.rewards.sandbox import bubblewrap_missing

    uses = cfg.reward.type == "code"
    if cfg.reward.code.isolation == "unisolated":
        return Check("code sandbox", "warn" if uses else "ok",
                     "reward.code.isolation=unisolated: programs run without a box",
                     "set reward.code.isolation=bubblewrap")  # fmt: skip
    why = bubblewrap_missing()
    if why is None:
        who = "as root, a user id per box" if os.geteuid() == 0 else "a user namespace per box"
        return Check("code sandbox", "ok", f"bubblewrap makes boxes here ({who})")
    status = "fail" if uses else "ok"
    detail = why if uses else f"not used (reward.type={cfg.reward.type}); {why}"
    fix = "see the reason; or, unsafe, set reward.code.isolation=unisolated" if uses else ""
    return Check("code sandbox", status, detail, fix)


def check_torch() -> Check:
    built = torch.version.cuda
    if built is None:
        return Check("torch", "ok", f"torch {torch.__version__}, CPU build")
    if not torch.cuda.is_available():
        return Check(
            "torch",
            "warn",
            f"torch {torch.__version__} is built for CUDA {built} but no GPU or driver answers",
            "on a CPU machine install the CPU build (pip install "
            f"torch=={torch.__version__.split('+')[0]} here); on a GPU machine check "
            f"`nvidia-smi` and that the driver supports CUDA {built}",
        )
    return Check("torch", "ok", f"torch {torch.__version__}, CUDA {built}")


def check_cpu() -> Check:
    found = precision.cpu()
    detail = f"{found.describe()}; torch runs {torch.backends.cpu.get_cpu_capability()} kernels"
    forced = runtime.forced_cpu()
    if forced:
        detail += f" ({runtime.FORCE_CPU_VARIABLE}={forced})"
    return Check("CPU", "ok", detail)


def check_precision(cfg: Config) -> list[Check]:
    """Where each part would run (run.device, decided as start-up decides it), what the
    engine and the trainer would compute in there (`auto` or the config's choice), what
    forcing the other dtype would cost on a CPU, and whether an explicit choice can run."""
    try:
        model = resolve_model(cfg.model.path)
    except (OSError, ValueError) as e:
        return [Check("precision", "warn", f"cannot read model.path={cfg.model.path!r}: {e}")]
    try:
        device, why = startup.decide_device(cfg.run.device, startup.cuda_devices())
    except ValueError as e:
        return [Check("device", "fail", str(e), "set run.device=auto")]
    checks = [Check("device", "ok", f"{startup.placement(cfg, device)} ({why})")]
    found = precision.probe(device, *precision.layer_shape(model.config))
    on_cpu = found.device == "cpu"
    try:
        engine = precision.engine_precision(cfg.engine, found)
    except precision.PrecisionError as e:
        fix = "set engine.dtype, engine.weight_layout and engine.kernels to auto"
        checks.append(Check("engine precision", "fail", str(e), fix))
    else:
        speedup = found.engine_speedup() if on_cpu else None
        checks.append(_precision_check("engine", engine, speedup, "engine.dtype"))
    try:
        train = precision.decide_train(cfg.train.compute_dtype, cfg.model.dtype, found)
    except precision.PrecisionError as e:
        checks.append(Check("training precision", "fail", str(e), "set train.compute_dtype=auto"))
    else:
        speedup = found.train_speedup() if on_cpu else None
        checks.append(_precision_check("training", train, speedup, "train.compute_dtype"))
    return checks


def _precision_check(part: str, chosen, speedup: float | None, field: str) -> Check:
    """A decision, and on a CPU the cost of the other dtype: 'forcing float32 costs 2.1x'
    (`speedup`: bf16 over float32 as measured; None where nothing was timed, a GPU)."""
    if speedup is None:
        status = "warn" if chosen.warning else "ok"
        return Check(f"{part} precision", status, chosen.describe())
    other = "float32" if chosen.dtype == "bfloat16" else "bfloat16"
    factor = speedup if chosen.dtype == "bfloat16" else 1 / speedup
    if factor >= 1:
        cost = f"forcing {other} ({field}={other}) costs {factor:.1f}x per matmul here"
    else:
        cost = f"{field}={other} would be {1 / factor:.1f}x faster per matmul here"
    detail = f"{chosen.describe()}; {cost}"
    if chosen.warning:
        return Check(f"{part} precision", "warn", detail, f"set {field}=auto")
    return Check(f"{part} precision", "ok", detail)


def check_gpus() -> Check:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return Check("GPUs", "ok", "no GPU: the engine and the trainer run on CPU")
    if count > 1:
        return Check(
            "GPUs",
            "warn",
            f"{count} GPUs visible; scheduler.type=single_process uses one (devices "
            f"1..{count - 1} idle)",
            "run engine replicas and trainer ranks on all of them with the Ray scheduler, or "
            "set CUDA_VISIBLE_DEVICES to the ones this run should use",
        )
    return Check("GPUs", "ok", "1 GPU")


def check_nccl() -> Check:
    found = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return Check("NCCL", "ok", "not used without GPUs" + (f"; set: {found}" if found else ""))
    if found.get("NCCL_P2P_DISABLE") == "1" or found.get("NCCL_IB_DISABLE") == "1":
        return Check(
            "NCCL",
            "warn",
            f"set: {found}",
            "NCCL_P2P_DISABLE/NCCL_IB_DISABLE slow weight sync down; unset them unless a "
            "hang was traced to P2P or InfiniBand",
        )
    return Check("NCCL", "ok", f"set: {found}" if found else "no NCCL_* variables (defaults)")


def check_ray(address: str | None) -> Check:
    if not address or address == "auto":
        return Check(
            "Ray",
            "ok",
            "no RAY_ADDRESS or scheduler.ray_address: a Ray scheduler would start a local cluster",
        )
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            pass
    except (OSError, ValueError) as e:
        return Check(
            "Ray",
            "fail",
            f"RAY_ADDRESS={address} cannot be reached: {e}",
            "start the head node (`ray start --head --node-ip-address=IP`) or fix RAY_ADDRESS "
            "to the head's IP:port (6379 by default)",
        )
    return Check("Ray", "ok", f"{address} answers")


def check_ray_nodes(address: str | None) -> list[Check]:
    """Join the cluster at `address` and try each alive node at the address it announced:
    one check for the nodes, and a failing one per node this machine cannot reach."""
    if not address or address == "auto":
        return []
    if absent := extras.missing("ray"):
        return [
            Check(
                "Ray nodes",
                "fail",
                f"a cluster is named ({address}) but {', '.join(absent)} is not installed",
                extras.install_line("ray"),
            )
        ]
    import logging

    import ray

    from looprl.scheduling import reachability

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        return [Check("Ray nodes", "fail", f"cannot join the cluster at {address}: {e}")]
    try:
        listed = ray.nodes()
    finally:
        ray.shutdown()
    nodes = reachability.alive_nodes(listed)
    dead = sorted({n["NodeManagerAddress"] for n in listed if not n["Alive"]})
    bad = reachability.unreachable_nodes(nodes)
    listed = ", ".join(n.label for n in nodes)
    detail = f"{len(nodes) - len(bad)} of {len(nodes)} alive node(s) answer: {listed}"
    checks = [Check("Ray nodes", "ok", detail)]
    if dead:
        checks[0] = Check(
            "Ray nodes",
            "warn",
            f"{detail}; Ray marked dead: {', '.join(dead)}",
            "a node marked dead soon after it joined often announced an address the head "
            "cannot reach: start it with `ray start --node-ip-address=<an address the head "
            "reaches>`",
        )
    for node, error in bad:
        checks.append(
            Check(
                f"Ray {node.label}",
                "fail",
                reachability.unreachable_problem(node, error),
                reachability.unreachable_fix(address),
            )
        )
    return checks


def check_node_ip() -> Check:
    """The IP this node would announce to Ray/NCCL peers: the one of the default route."""
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the route's source
        route_ip = probe.getsockname()[0]
        probe.close()
    except OSError:
        route_ip = None
    try:
        host_ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        host_ip = None
    detail = f"default-route IP {route_ip}, hostname resolves to {host_ip}"
    if host_ip and host_ip.startswith("127.") and route_ip and not route_ip.startswith("127."):
        return Check(
            "node IP",
            "warn",
            detail,
            f"peers on other machines cannot reach {host_ip}: start Ray with "
            f"--node-ip-address={route_ip} and set NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to "
            "that interface",
        )
    return Check("node IP", "ok", detail)


def check_port(host: str, port: int) -> Check:
    if port == 0:
        return Check("gateway port", "ok", "gateway.port=0: a free port is picked at start")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return Check(
                "gateway port",
                "fail",
                f"{host}:{port} is taken: {e.strerror}",
                "set gateway.port=0 (any free port) or another port",
            )
    return Check("gateway port", "ok", f"{host}:{port} is free")


def check_disk(fileroot: Path) -> Check:
    existing = fileroot
    while not existing.exists():
        existing = existing.parent
    free_gb = shutil.disk_usage(existing).free / 1e9
    if free_gb < MIN_FREE_GB:
        return Check(
            "disk",
            "fail",
            f"{free_gb:.1f} GB free under {existing}; a SmolLM2-135M checkpoint is 1.6 GB "
            "and keep_last of them are kept",
            "free space, point run.fileroot at a larger disk, or lower checkpoint.keep_last",
        )
    return Check("disk", "ok", f"{free_gb:.0f} GB free under {existing}")
