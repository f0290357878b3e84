"""Device profiles: the only facts about a device the torch emitter needs, as data.

A profile is one row of :data:`PROFILES`; the emitter has no per-device
branches.  Its fields become the PROFILE block of ``program.py`` (a few
constants and one small function), the only lines that differ between the
programs emitted for two profiles.  Adding a device is adding a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from parcomp.compile.program import ParcompError


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
        bind_device_id: pass ``device_id`` to ``init_process_group`` (its communicators then
            start at init, not at the first collective after loading).
        launch_env: the lines ``--print-launch`` prints before torchrun: what a user sets
            on each node (docs/deploy.md explains each); ``{devices}`` is 0,..,D-1 for D
            devices per node, ``{timeout}`` the program's collective timeout in seconds.
        dtype_check: expression that must be true once the device is bound (it may read
            ``COLLECTIVE_DTYPES``, the dtypes the program's collectives carry), or None.
        dtype_message: what ``program.py`` prints (then exits 2) when ``dtype_check`` is false.
        policy: statements run once the device is bound (cuda: TF32 off).
    """

    name: str
    dist_backend: str
    device: str
    prelude: tuple = ()
    set_device: str | None = None
    check: str | None = None
    check_message: str = ""
    bind_device_id: bool = False
    launch_env: tuple = ()
    dtype_check: str | None = None
    dtype_message: str = ""
    policy: tuple = ()


# fp32 matmuls and convolutions in fp32, whatever torch's defaults: parcomp run's float32
# tolerance (parcomp/check/differential.py) assumes fp32 rounding; TF32 keeps 10 mantissa bits
_TF32_OFF = ("torch.backends.cuda.matmul.allow_tf32 = False  # TF32 off: fp32 GEMMs as checked",
             "torch.backends.cudnn.allow_tf32 = False")
_GLOO_ENV = ("export GLOO_SOCKET_IFNAME=eth0  # the interface that reaches the other nodes",)
_NCCL_ENV = ("export NCCL_SOCKET_IFNAME=eth0  # the interface for bootstrap and socket traffic",
             "export NCCL_IB_HCA=mlx5  # the InfiniBand/RoCE adapters (ibv_devices lists them)",
             "export NCCL_DEBUG=WARN  # INFO prints the rings and transports NCCL picked",
             "# export NCCL_IB_GID_INDEX=3  # RoCE only: the RoCE v2 GID (show_gids lists them); not on InfiniBand",
             "export CUDA_DEVICE_MAX_CONNECTIONS=1  # one launch queue: a collective starts before the "
             "compute issued after it (Megatron's tensor-parallel overlap)",
             "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3  # a collective past --timeout aborts its "
             "communicator and the process (torch's default; 1: also tear down)",
             "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000  # the flight recorder: each rank's last 2000 "
             "collective events",
             "export TORCH_NCCL_DUMP_ON_TIMEOUT=1  # a timeout writes them to the file below (+ rank)",
             "export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/tmp/nccl_trace_rank_  # a shared file system keeps "
             "every rank's",
             "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # less fragmentation, fewer "
             "out-of-memory stops")
_HCCL_ENV = ("source /usr/local/Ascend/ascend-toolkit/set_env.sh  # the CANN environment",
             "export HCCL_IF_IP=THIS_NODE_IP  # or HCCL_SOCKET_IFNAME=eth0: the host interface",
             "export HCCL_CONNECT_TIMEOUT=600  # seconds to build links (default 120)",
             "export HCCL_EXEC_TIMEOUT={timeout}  # seconds a collective may wait (default 1836)",
             "export HCCL_BUFFSIZE=200  # MB per communicator buffer (default 200)",
             "# export HCCL_DETERMINISTIC=true  # reproducible reductions, slower",
             "export ASCEND_RT_VISIBLE_DEVICES={devices}  # the NPUs of this node",
             "export HCCL_ASYNC_ERROR_HANDLING=1  # torch_npu: a failed or timed-out collective aborts "
             "the process",
             "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True  # torch_npu: less fragmentation",
             "# export HCCL_RDMA_TC=132 HCCL_RDMA_SL=4  # RoCE: the traffic class and service level "
             "of the lossless queue")
# HCCL reduces bfloat16 only on Atlas A2 (Ascend910B) and newer; these names are older chips
_ASCEND_NO_BF16 = ("Ascend910A", "Ascend910Pro", "Ascend910Premium", "Ascend310")


PROFILES: dict = {p.name: p for p in (
    DeviceProfile("cpu", "gloo", '"cpu"', launch_env=_GLOO_ENV),
    DeviceProfile("cuda", "nccl", 'f"cuda:{LOCAL_RANK}"',
                  set_device="torch.cuda.set_device(LOCAL_RANK)",
                  check="torch.cuda.is_available() and torch.cuda.device_count() > LOCAL_RANK",
                  check_message="profile cuda: CUDA is not available or has too few GPUs: torch "
                                "{torch.__version__} (CUDA build: {torch.version.cuda}) sees "
                                "{torch.cuda.device_count()} GPUs, LOCAL_RANK {LOCAL_RANK} needs "
                                "{LOCAL_RANK + 1}; install a CUDA build of torch, check "
                                "CUDA_VISIBLE_DEVICES, or rerun with --device cpu (CPU/gloo, no GPU)",
                  bind_device_id=True, launch_env=_NCCL_ENV, policy=_TF32_OFF),
    DeviceProfile("ascend", "hccl", 'f"npu:{LOCAL_RANK}"', prelude=("torch_npu",),
                  set_device="torch.npu.set_device(LOCAL_RANK)",
                  check="torch.npu.device_count() > LOCAL_RANK",
                  check_message="profile ascend: torch_npu sees {torch.npu.device_count()} NPUs, "
                                "LOCAL_RANK {LOCAL_RANK} needs {LOCAL_RANK + 1}; check "
                                "ASCEND_RT_VISIBLE_DEVICES and the CANN environment (source "
                                "set_env.sh), or rerun with --device cpu (CPU/gloo, no NPU)",
                  launch_env=_HCCL_ENV,
                  dtype_check=f'"bfloat16" not in COLLECTIVE_DTYPES or not '
                              f'torch.npu.get_device_name().startswith({_ASCEND_NO_BF16!r})',
                  dtype_message="profile ascend: this program's collectives carry bfloat16, which "
                                "HCCL supports on Atlas A2 (Ascend910B) and newer, not on "
                                "{torch.npu.get_device_name()}; compile the model in float32 or "
                                "float16, or rerun with --device cpu"),
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
