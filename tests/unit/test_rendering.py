"""Headless rendering (looprl/diagnostics/rendering.py): the MUJOCO_GL a worker picks and
what `looprl doctor` says, on machines described by hand; and the probe of this one."""

from __future__ import annotations

import pytest

from looprl.diagnostics.rendering import (
    Renderers,
    check_rendering,
    choose_mujoco_gl,
    egl_vendor_files,
    find_renderers,
)

MESA = "/usr/share/glvnd/egl_vendor.d/50_mesa.json"
NVIDIA = "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"
GPU = Renderers(egl_vendors=(NVIDIA, MESA), libegl=True, nvidia_egl=True, pygame=True)
CPU_MESA = Renderers(egl_vendors=(MESA,), libegl=True, pygame=True)
CPU_OSMESA = Renderers(osmesa=True)
DESKTOP = Renderers(display=True)
BARE = Renderers()


@pytest.mark.parametrize(
    ("environ", "found", "chosen"),
    [
        ({}, GPU, "egl"),
        ({}, CPU_MESA, "egl"),
        ({}, Renderers(egl_vendors=(MESA,), osmesa=True), "osmesa"),  # no libEGL.so.1
        ({}, CPU_OSMESA, "osmesa"),
        ({}, DESKTOP, "glfw"),
        ({}, BARE, None),
        ({"MUJOCO_GL": "osmesa"}, GPU, "osmesa"),  # the user's choice stands
        ({"MUJOCO_GL": ""}, CPU_OSMESA, "osmesa"),  # empty is unset
    ],
)
def test_mujoco_gl_is_the_users_else_the_first_that_renders_here(environ, found, chosen):
    assert choose_mujoco_gl(environ, found) == chosen


def _check(environ, found, name="MUJOCO_GL"):
    return {c.name: c for c in check_rendering(environ, found)}[name]


def test_doctor_says_what_an_unset_mujoco_gl_becomes():
    check = _check({}, CPU_MESA)
    assert check.status == "ok" and "env workers render with egl" in check.detail
    check = _check({}, BARE)
    assert check.status == "warn" and "nothing renders headless here" in check.detail
    assert "libosmesa6" in check.fix


@pytest.mark.parametrize(
    ("mujoco_gl", "found", "says"),
    [
        ("egl", CPU_OSMESA, "glvnd's libEGL.so.1 is not installed"),
        ("egl", Renderers(libegl=True), "glvnd finds no EGL vendor library"),
        ("osmesa", CPU_MESA, "libOSMesa is not installed"),
        ("glfw", CPU_MESA, "DISPLAY is not set"),
    ],
)
def test_a_mujoco_gl_without_its_library_fails_with_its_fix(mujoco_gl, found, says):
    check = _check({"MUJOCO_GL": mujoco_gl}, found)
    assert check.status == "fail" and says in check.detail
    assert "unset MUJOCO_GL so that env workers pick what renders here" in check.fix


def test_gpu_egl_and_pygame_checks():
    assert _check({}, GPU, "EGL").status == "ok"
    software = _check({}, CPU_MESA, "EGL")
    assert software.status == "warn" and "EGL renders through 50_mesa.json" in software.detail
    missing = _check({}, BARE, "pygame")
    assert missing.status == "warn" and "pip install 'looprl[envs]'" in missing.fix


def test_vendor_files_follow_glvnd_variables(tmp_path):
    (tmp_path / "a.json").write_text('{"ICD": {"library_path": "libEGL_nothing.so.0"}}')
    assert egl_vendor_files({"__EGL_VENDOR_LIBRARY_DIRS": str(tmp_path)}) == [
        str(tmp_path / "a.json")
    ]
    assert egl_vendor_files({"__EGL_VENDOR_LIBRARY_FILENAMES": "/x.json:/y.json"}) == [
        "/x.json",
        "/y.json",
    ]
    # a vendor file whose library does not load is no vendor
    found = find_renderers({"__EGL_VENDOR_LIBRARY_DIRS": str(tmp_path)})
    assert found.egl_vendors == () and not found.egl
