"""XLA presets: composed with the user's flags, chosen by the GPU generation, applied before JAX's backend starts
(in a fresh process and through `flaxstate launch`), refused after, and kept with every checkpoint's environment."""

import os

import jax
import pytest

import flaxstate as fs
from flaxstate import xla_settings


def test_the_user_s_flags_win_flag_by_flag_and_a_preset_adds_only_what_the_user_left_unset():
    user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/dump"
    composed = xla_settings.compose(xla_settings.PRESETS["hopper"].flags, user)
    flags = xla_settings.parse(composed)
    assert flags["--xla_gpu_enable_triton_gemm"] == "true" and flags["--xla_dump_to"] == "/tmp/dump"
    assert flags["--xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert flags["--xla_gpu_enable_command_buffer"] == "+WHILE,+CONDITIONAL"  # added to XLA's own
    assert composed.count("--xla_gpu_enable_triton_gemm") == 1
    assert xla_settings.compose((), "  ") == ""
    update = xla_settings.environment("hopper", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in update and update["FLAXSTATE_XLA_PRESET"] == "hopper"
    assert xla_settings.environment("blackwell", {}).keys() == {"XLA_FLAGS", "FLAXSTATE_XLA_PRESET"}
    assert xla_settings.environment("none", {"XLA_FLAGS": "--mine"}) == {"FLAXSTATE_XLA_PRESET": "none"}
    with pytest.raises(ValueError, match="no XLA preset 'volta': choose one of auto, hopper, blackwell, ampere, none"):
        xla_settings.preset("volta")


@pytest.mark.parametrize(
    ("compute_cap", "gpus", "chosen"),
    [
        ("9.0", 2, "hopper"),
        ("10.0", 8, "blackwell"),
        ("12.0", 2, "blackwell"),
        ("8.0", 4, "ampere"),
        ("7.5", 2, "none"),
        ("", 2, "none"),
        ("9.0", 1, "none"),  # one GPU: no collectives to tune, and XLA's defaults ran faster (RESULTS.md)
    ],
)
def test_auto_picks_the_preset_of_the_machine_s_gpu_generation(tmp_path, monkeypatch, compute_cap, gpus, chosen):
    fake = tmp_path / "nvidia-smi"  # answers the query as the real one does: one line a GPU
    fake.write_text("#!/bin/sh\nprintf '" + f"{compute_cap}\\n" * gpus + "'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert xla_settings.detect() == chosen and xla_settings.preset("auto").name == chosen


def test_no_gpu_means_no_preset(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert xla_settings.preset("auto") is xla_settings.PRESETS["none"]


def test_a_preset_after_the_backend_started_is_refused_naming_what_to_do(monkeypatch):
    jax.devices()  # the backend is up in this process
    monkeypatch.delenv("FLAXSTATE_XLA_PRESET", raising=False)
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match=r"after JAX started its backend.*flaxstate launch --xla-preset hopper"):
        fs.use_xla_preset("hopper")
    assert os.environ.get("XLA_FLAGS") == before  # nothing changed
    with pytest.raises(ValueError, match="no XLA preset"):
        fs.use_xla_preset("h100")
    monkeypatch.setenv("FLAXSTATE_XLA_PRESET", "hopper")  # applied by the launcher: the same name is no change
    assert fs.use_xla_preset("hopper").name == "hopper"


def test_a_preset_the_launcher_applied_is_left_as_it_is_before_the_backend_starts_too(monkeypatch):
    """A launched process that calls `use_xla_preset` at its top (its backend not up yet) keeps the launcher's
    settings: no second probe a process, and a capture the launcher dropped is not added back."""
    launched = xla_settings.environment("hopper", {}, capture=False)  # the launcher's fallback
    monkeypatch.setattr(xla_settings.private_apis, "backends_initialized", lambda: False)
    monkeypatch.setattr(xla_settings, "capture_fails", lambda *args, **kwargs: pytest.fail("probed again"))
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    assert fs.use_xla_preset("hopper").name == "hopper"
    assert os.environ["XLA_FLAGS"] == launched["XLA_FLAGS"]
    assert xla_settings.CAPTURE_WHILE not in os.environ["XLA_FLAGS"]


def test_a_second_preset_in_one_process_is_refused_naming_both_and_auto_keeps_the_first(monkeypatch):
    # A notebook cell run again with another name: the first preset's flags would stay in force while the
    # environment (and every checkpoint) said "none".
    monkeypatch.setattr(xla_settings.private_apis, "backends_initialized", lambda: False)
    monkeypatch.setattr(xla_settings, "capture_fails", lambda *args, **kwargs: None)
    monkeypatch.delenv("FLAXSTATE_XLA_PRESET", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert fs.use_xla_preset("hopper").name == "hopper"
    flags = os.environ["XLA_FLAGS"]
    with pytest.raises(ValueError, match=r"use_xla_preset\('none'\): the preset 'hopper' is applied .*Restart"):
        fs.use_xla_preset("none")
    assert os.environ["XLA_FLAGS"] == flags and os.environ["FLAXSTATE_XLA_PRESET"] == "hopper"
    assert fs.use_xla_preset("auto").name == "hopper" and fs.use_xla_preset("hopper").name == "hopper"
