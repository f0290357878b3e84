"""Device profiles: the only facts about a device the torch emitter needs, as data.

A profile is one row of :data:`PROFILES`; the emitter has no per-device
branches.  Its fields become the PROFILE block of ``program.py`` (a few
constants and one small function), the only lines that differ between the
programs emitted for two profiles.  Adding a device is adding a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from parcomp.program import ParcompError


class ProfileError(ParcompError, ValueError):
    """An unknown device profile name (a ``ValueError`` too, so the CLI reports it cleanly)."""


@dataclass(frozen=True)
class DeviceProfile:
    """How ``program.py`` finds its device and starts ``torch.distributed``.

    Attributes:
        name: profile name, also the default of the program's ``--device`` switch.
        dist_backend: ``torch.distributed`` backend (``gloo``, ``nccl``, ``hccl``).
        device: Python expression for this rank's device; may use ``LOCAL_RANK``.
        prelude: modules imported before anything else touches the device
            (``torch_npu``); skipped under ``--device cpu``.
        set_device: statement binding the process to its device, or None.
        check: expression that must be true before ``set_device`` runs, or None.
        check_message: what ``program.py`` prints (then exits 2) when ``check`` is false.
    """

    name: str
    dist_backend: str
    device: str
    prelude: tuple = ()
    set_device: str | None = None
    check: str | None = None
    check_message: str = ""


PROFILES: dict = {p.name: p for p in (
    DeviceProfile("cpu", "gloo", '"cpu"'),
    DeviceProfile("cuda", "nccl", 'f"cuda:{LOCAL_RANK}"',
                  set_device="torch.cuda.set_device(LOCAL_RANK)",
                  check="torch.cuda.is_available() and torch.cuda.device_count() > LOCAL_RANK",
                  check_message="profile cuda: CUDA is not available or has too few GPUs: torch "
                                "{torch.__version__} (CUDA build: {torch.version.cuda}) sees "
                                "{torch.cuda.device_count()} GPUs, LOCAL_RANK {LOCAL_RANK} needs "
                                "{LOCAL_RANK + 1}; install a CUDA build of torch, check "
                                "CUDA_VISIBLE_DEVICES, or rerun with --device cpu (CPU/gloo, no GPU)"),
    DeviceProfile("ascend", "hccl", 'f"npu:{LOCAL_RANK}"', prelude=("torch_npu",),
                  set_device="torch.npu.set_device(LOCAL_RANK)",
                  check="torch.npu.device_count() > LOCAL_RANK",
                  check_message="profile ascend: torch_npu sees {torch.npu.device_count()} NPUs, "
                                "LOCAL_RANK {LOCAL_RANK} needs {LOCAL_RANK + 1}; check "
                                "ASCEND_RT_VISIBLE_DEVICES and the CANN environment (source "
                                "set_env.sh), or rerun with --device cpu (CPU/gloo, no NPU)"),
)}


def get_profile(name) -> DeviceProfile:
    """The profile called ``name`` (a :class:`DeviceProfile` passes through).

    Raises:
        ProfileError: (a ``ValueError``) unknown name; the message lists the known profiles.
    """
    if isinstance(name, DeviceProfile):
        return name
    if name not in PROFILES:
        raise ProfileError(f"unknown device profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]
