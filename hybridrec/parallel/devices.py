"""Which device a run uses, and why: what this machine's torch can do with CUDA (``Cuda``),
the device a config asks for (``device_type``) and each rank's device (``pick_device``).
The line the log gives before launch is ``preflight.device_choice``: no silent CPU fallback."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from omegaconf import DictConfig

from hybridrec.config.schema import Device
from hybridrec.parallel.distributed import LaunchError, local_layout


@dataclass(frozen=True)
class Cuda:
    """What this machine's torch can do with CUDA (a value, so that tests can describe a GPU machine)."""

    build: Optional[str]
    """torch.version.cuda: None for a CPU-only torch."""
    devices: int
    """Usable GPUs: 0 when CUDA is unusable (no device visible, driver missing)."""

    @classmethod
    def probe(cls) -> Cuda:
        return cls(torch.version.cuda, torch.cuda.device_count() if torch.cuda.is_available() else 0)

    def unusable(self) -> Optional[str]:
        """Why a run here cannot use CUDA, or None when it can."""
        if self.build is None:
            return f"torch {torch.__version__} is a CPU-only build (`make install GPU=1` installs the CUDA one)"
        if self.devices == 0:
            return (
                f"torch has CUDA {self.build} but sees no usable GPU (torch.cuda.is_available() is False: "
                f"check the driver and CUDA_VISIBLE_DEVICES)"
            )
        return None


def device_type(cfg: DictConfig, cuda: Optional[Cuda] = None) -> str:
    """The device a run uses: launcher.device, with auto = cuda when usable."""
    if cfg.launcher.device == Device.auto:
        return "cpu" if (cuda or Cuda.probe()).unusable() else "cuda"
    return cfg.launcher.device.value


def pick_device(cfg: DictConfig, env: Mapping[str, str] = os.environ, cuda: Optional[Cuda] = None) -> torch.device:
    """This rank's device: ``device_type(cfg)``, on CUDA the local rank's GPU."""
    if device_type(cfg, cuda) == "cuda":
        local_rank, gpus = local_layout(env).rank, (cuda or Cuda.probe()).devices
        if local_rank >= gpus:
            raise LaunchError(
                f"local rank {local_rank} has no GPU: {gpus} visible on this node; start one rank per GPU"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
