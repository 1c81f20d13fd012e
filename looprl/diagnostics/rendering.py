"""Headless rendering for simulator environments: what this machine can render with, the
MUJOCO_GL an env worker uses when the user set none (`choose_mujoco_gl`), and the
checks `looprl doctor` prints, which an env worker also logs when a render fails
(`diagnose`).

MuJoCo renders with `MUJOCO_GL=egl` through glvnd's libEGL.so.1 and a vendor library
that a JSON file names (NVIDIA's 10_nvidia.json on a GPU; Mesa's 50_mesa.json renders in
software, or on a Mesa GPU driver), `osmesa` (libOSMesa, software) or `glfw` (needs a
display). Gymnasium's classic-control envs (CartPole) render with pygame instead.

Owns the probing and its wording. Nothing here changes the machine;
`use_headless_rendering` sets MUJOCO_GL and SDL_VIDEODRIVER in the process that calls it
(an env worker, before a simulator is imported).
Imports neither torch nor a simulator, so that a worker stays light.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from looprl.diagnostics.checks import Check

EGL_VENDOR_DIRS = ("/etc/glvnd/egl_vendor.d", "/usr/share/glvnd/egl_vendor.d")  # glvnd's
NVIDIA_EGL_VENDOR = "10_nvidia.json"
VULKAN_ICD_FILES = ("/usr/share/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.json")
# The checks a failed render is explained by (the EGL and Vulkan ones are about GPU speed).
RENDER_CHECKS = ("MUJOCO_GL", "pygame")


@dataclass(frozen=True)
class Renderers:
    """What this machine has for headless rendering (`find_renderers`)."""

    egl_vendors: tuple[str, ...] = ()  # glvnd EGL vendor files whose library loads
    libegl: bool = False  # glvnd's libEGL.so.1 loads
    nvidia_egl: bool = False  # libEGL_nvidia.so.0 loads
    osmesa: bool = False  # libOSMesa is installed
    display: bool = False  # DISPLAY is set (what glfw needs)
    vulkan_icd: str | None = None  # NVIDIA's Vulkan ICD file
    pygame: bool = False  # pygame can be imported

    @property
    def egl(self) -> bool:
        """MUJOCO_GL=egl can render: libEGL.so.1 and a vendor library it finds."""
        return self.libegl and bool(self.egl_vendors)


def find_renderers(environ: Mapping[str, str] = os.environ) -> Renderers:
    """Probe this machine (libraries are loaded to see that they load; nothing renders)."""
    return Renderers(
        egl_vendors=tuple(f for f in egl_vendor_files(environ) if _vendor_loads(f)),
        libegl=_loadable("libEGL.so.1"),
        nvidia_egl=_loadable("libEGL_nvidia.so.0"),
        osmesa=ctypes.util.find_library("OSMesa") is not None,
        display=bool(environ.get("DISPLAY")),
        vulkan_icd=next((f for f in VULKAN_ICD_FILES if Path(f).is_file()), None),
        pygame=importlib.util.find_spec("pygame") is not None,
    )


def egl_vendor_files(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The vendor files glvnd reads: those __EGL_VENDOR_LIBRARY_FILENAMES names when it
    is set, else the JSON files in __EGL_VENDOR_LIBRARY_DIRS (or glvnd's folders)."""
    if environ.get("__EGL_VENDOR_LIBRARY_FILENAMES"):
        return [f for f in environ["__EGL_VENDOR_LIBRARY_FILENAMES"].split(":") if f]
    named = environ.get("__EGL_VENDOR_LIBRARY_DIRS", "").split(":")
    folders = [f for f in named if f] or EGL_VENDOR_DIRS
    return sorted(str(p) for folder in folders for p in Path(folder).glob("*.json"))


def choose_mujoco_gl(environ: Mapping[str, str], found: Renderers) -> str | None:
    """The MUJOCO_GL an env worker renders with: the user's when set; else `egl` when
    glvnd finds a vendor library (NVIDIA's on a GPU, Mesa's in software), else `osmesa`
    when libOSMesa is installed, else `glfw` when there is a display, else None (nothing
    renders headless here)."""
    if environ.get("MUJOCO_GL"):
        return environ["MUJOCO_GL"]
    if found.egl:
        return "egl"
    if found.osmesa:
        return "osmesa"
    return "glfw" if found.display else None


def use_headless_rendering() -> str | None:
    """Set, in this process (an env worker, before a simulator is imported) and unless
    the user set them: MUJOCO_GL to `choose_mujoco_gl`'s pick, and SDL_VIDEODRIVER=dummy
    (pygame draws off screen without asking for a display). Returns MUJOCO_GL."""
    if not os.environ.get("MUJOCO_GL"):
        chosen = choose_mujoco_gl(os.environ, find_renderers())
        if chosen is not None:
            os.environ["MUJOCO_GL"] = chosen
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    return os.environ.get("MUJOCO_GL")


def check_rendering(
    environ: Mapping[str, str] = os.environ, found: Renderers | None = None
) -> list[Check]:
    """Headless rendering for simulator environments: GPU EGL, Vulkan, MUJOCO_GL (set, or
    what a worker would pick), pygame."""
    found = found or find_renderers(environ)
    nvidia_vendor = next((f for f in found.egl_vendors if Path(f).name == NVIDIA_EGL_VENDOR), None)
    checks = []
    if found.nvidia_egl and nvidia_vendor:
        checks.append(Check("EGL", "ok", f"libEGL_nvidia.so.0 and {nvidia_vendor}"))
    else:
        missing = [
            n
            for n, ok in (
                ("libEGL_nvidia.so.0", found.nvidia_egl),
                (f"glvnd vendor file {NVIDIA_EGL_VENDOR}", nvidia_vendor),
            )
            if not ok
        ]
        others = [Path(f).name for f in found.egl_vendors]
        software = f"; EGL renders through {', '.join(others)}" if found.egl else ""
        checks.append(
            Check(
                "EGL",
                "warn",
                "no GPU rendering: "
                + " and ".join(missing)
                + f" not found (only simulators need it){software}",
                "on a GPU machine install the NVIDIA driver's EGL library and "
                f"{EGL_VENDOR_DIRS[1]}/{NVIDIA_EGL_VENDOR}; without a GPU render in software "
                "with MUJOCO_GL=egl through Mesa (apt install libegl-mesa0) or "
                "MUJOCO_GL=osmesa (apt install libosmesa6)",
            )
        )
    checks.append(
        Check("Vulkan", "ok", f"ICD {found.vulkan_icd}")
        if found.vulkan_icd
        else Check(
            "Vulkan",
            "warn",
            "no NVIDIA Vulkan ICD file",
            "install the NVIDIA driver's Vulkan ICD (only simulators using Vulkan need it)",
        )
    )
    checks.append(_check_mujoco_gl(environ, found))
    checks.append(
        Check("pygame", "ok", "found: classic-control envs (CartPole) render")
        if found.pygame
        else Check(
            "pygame",
            "warn",
            "not installed: classic-control envs (CartPole) cannot render frames",
            "pip install 'looprl[envs]' (or 'gymnasium[classic-control]')",
        )
    )
    return checks


def _check_mujoco_gl(environ: Mapping[str, str], found: Renderers) -> Check:
    mujoco_gl = environ.get("MUJOCO_GL") or None
    unset = "unset MUJOCO_GL so that env workers pick what renders here"
    if mujoco_gl == "egl" and not found.egl:
        if not found.libegl:
            why = "glvnd's libEGL.so.1 is not installed"
        else:
            read = ", ".join(egl_vendor_files(environ)) or "none"
            why = f"glvnd finds no EGL vendor library that loads (vendor files: {read})"
        return Check(
            "MUJOCO_GL",
            "fail",
            f"MUJOCO_GL=egl but {why}",
            f"{unset}, or set MUJOCO_GL=osmesa (apt install libosmesa6), or install an EGL "
            "vendor: the NVIDIA driver's EGL library on a GPU, Mesa's without "
            "(apt install libegl1 libegl-mesa0)",
        )
    if mujoco_gl == "osmesa" and not found.osmesa:
        return Check(
            "MUJOCO_GL",
            "fail",
            "MUJOCO_GL=osmesa but libOSMesa is not installed",
            f"apt install libosmesa6, or {unset}",
        )
    if mujoco_gl == "glfw" and not found.display:
        return Check(
            "MUJOCO_GL",
            "fail",
            "MUJOCO_GL=glfw needs a display and DISPLAY is not set",
            f"{unset}, or set MUJOCO_GL=egl or osmesa to render headless",
        )
    osmesa = "OSMesa " + ("found" if found.osmesa else "not installed")
    if mujoco_gl:
        return Check("MUJOCO_GL", "ok", f"MUJOCO_GL={mujoco_gl}; {osmesa}")
    chosen = choose_mujoco_gl(environ, found)
    if chosen is None:
        return Check(
            "MUJOCO_GL",
            "warn",
            "MUJOCO_GL is unset and nothing renders headless here: no EGL vendor library, "
            "no libOSMesa, no display (only simulators need one)",
            "apt install libegl1 libegl-mesa0 (EGL, software) or libosmesa6",
        )
    return Check("MUJOCO_GL", "ok", f"MUJOCO_GL unset: env workers render with {chosen}; {osmesa}")


def diagnose(environ: Mapping[str, str] = os.environ, *, failures_only: bool = False) -> str:
    """What `looprl doctor` says about rendering here, as a sentence for a log line: its
    MUJOCO_GL and pygame checks that are not ok (only those that fail, with
    `failures_only`), each with its fix; "" when it finds nothing wrong."""
    wrong = ("fail",) if failures_only else ("warn", "fail")
    found = [c for c in check_rendering(environ) if c.name in RENDER_CHECKS and c.status in wrong]
    return "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in found)


def _vendor_loads(path: str) -> bool:
    try:
        library = json.loads(Path(path).read_text())["ICD"]["library_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return _loadable(library)


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True
