"""The checks every command runs before any rank starts, in one sequence: the config against
the job's world size, the parallel layout, the device (said in the log, never a silent
fallback), and a dry plan of the tables (a constraint the planner cannot meet fails here,
not after N ranks have started). ``python -m hybridrec.train`` adds the checkpoint to
resume, ``evaluate`` the checkpoint to score, ``plan`` plans for another cluster.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from omegaconf import DictConfig

from hybridrec.config import Device
from hybridrec.data import build_source
from hybridrec.data.source import Source
from hybridrec.parallel.devices import Cuda
from hybridrec.parallel.parallel_dims import ParallelDims, job_dims
from hybridrec.parallel.sharding import plan_tables, sharders
from hybridrec.run.launch import already_launched, world_size
from hybridrec.run.validation import check_device, validate
from hybridrec.training.build import model_for, plan_inputs

log = logging.getLogger("hybridrec.preflight")  # its name before the packages: hydra.verbose keeps it


def check_job(cfg: DictConfig) -> ParallelDims:
    """``cfg`` validated for the ranks this job will have (the launcher's, or torchrun's /
    Slurm's), and their layout; the device line logged. Raises ValueError with the one line."""
    world = world_size(cfg)  # under a submitit job: nodes x nproc_per_node, or why not
    validate(cfg, world)
    dims = job_dims(cfg, world)  # the layout every rank will rebuild from its own environment
    log.info(device_choice(cfg, dims))  # no silent CPU fallback: the log says which device and why
    check_device(cfg, dims.device_type)
    if dims.device_type == "cpu" and cfg.mesh.param_dtype is not None and not cpu_has_bf16():
        log.warning(
            f"mesh.param_dtype={cfg.mesh.param_dtype.value} on a CPU without bf16 instructions (no "
            f"avx512_bf16 or amx_bf16): its matmuls are emulated, many times slower than fp32 (16x for ctr's "
            f"MLPs on an AMD EPYC without AVX-512, at the same AUC); it pays on GPUs and CPUs that have them"
        )
    return dims


def plan_before_launch(cfg: DictConfig, dims: ParallelDims, data: Optional[Source]) -> None:
    """Plan the tables here first, with this machine's memory. Not under torchrun or srun,
    where every rank runs this module: the ranks plan anyway, identically, over their group."""
    if not already_launched():
        dry_plan(cfg, dims, detect=True, data=data)


def dry_plan(cfg: DictConfig, dims: ParallelDims, detect: bool, data: Optional[Source] = None) -> dict[str, Any]:
    """Plan ``cfg``'s tables for the layout ``dims`` without any process group, as a rank
    would (``hybridrec.training.build``), and return the plan report. ``detect``: take unset memory
    sizes from this machine (the check before a run here) rather than TorchRec's defaults
    (planning for another cluster). ``data``: the source, when the caller has built it."""
    data = data or build_source(cfg.data, cfg.seed)
    _, report = plan_tables(model_for(cfg, data), plan_inputs(cfg, dims, data), sharders(), detect=detect)
    assert report is not None  # planned here (no process group), so this process has the report
    return report


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (Linux: its flags in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_choice(cfg: DictConfig, dims: ParallelDims, cuda: Optional[Cuda] = None) -> str:
    """Before launch: the device the ranks will use and why, as one line for the log; raises
    ValueError when the launcher settings ask for GPUs this machine does not have."""
    cuda = cuda or Cuda.probe()
    why = cuda.unusable()
    if cfg.launcher.device == Device.cuda and why:
        raise ValueError(f"launcher.device=cuda but {why}; or set launcher.device=auto to run on CPU")
    if dims.device_type == "cuda":
        if dims.local_world_size > cuda.devices:
            raise ValueError(
                f"{dims.local_world_size} ranks per node (launcher.nproc_per_node, or the launcher's "
                f"LOCAL_WORLD_SIZE) but {cuda.devices} GPU(s) visible: hybridrec runs one rank per GPU, "
                f"so start at most {cuda.devices}"
            )
        return f"device: cuda, {dims.local_world_size} of {cuda.devices} GPU(s) per node (CUDA {cuda.build})"
    if cfg.launcher.device == Device.auto:
        return f"device: cpu (launcher.device=auto: {why})"
    return "device: cpu (launcher.device=cpu)"
