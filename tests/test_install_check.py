"""make install's check: the environment holds the build asked for, CPU or CUDA."""

import pytest

from hybridrec import install_check

pytestmark = pytest.mark.unit


def test_gpu_install_refuses_a_cpu_torch(monkeypatch):
    monkeypatch.setattr(install_check, "installed", lambda name: name in ("torch", "fbgemm-gpu"))
    found = install_check.problems(True, "2.13.0+cpu", None, cuda_usable=False)
    assert len(found) == 1 and "torch.version.cuda is None" in found[0]
    assert install_check.problems(True, "2.13.0+cu128", "12.8", cuda_usable=True) == []


def test_cpu_install_refuses_a_cuda_torch_and_mixed_fbgemm(monkeypatch):
    monkeypatch.setattr(install_check, "installed", lambda name: True)  # both fbgemm builds present
    found = install_check.problems(False, "2.13.0+cu128", "12.8", cuda_usable=False)
    assert len(found) == 2 and "CUDA build in a CPU install" in found[0] and "fbgemm-gpu, the CUDA build" in found[1]


def test_switching_builds_removes_the_other_ones_packages(monkeypatch):
    monkeypatch.setattr(install_check, "installed", lambda name: name in ("torch", "fbgemm-gpu-cpu"))
    assert install_check.other_build(gpu=True, torch_cuda=None) == ["fbgemm-gpu-cpu", "torch"]
    assert install_check.other_build(gpu=False, torch_cuda=None) == []  # already the CPU build
    monkeypatch.setattr(install_check, "installed", lambda name: name in ("torch", "fbgemm-gpu"))
    assert install_check.other_build(gpu=False, torch_cuda="12.8") == ["fbgemm-gpu", "torch"]


def test_this_environment_passes_its_own_check(capsys):
    """The suite runs in a `make install` environment (CPU here): the check the Makefile ends
    with (``main``, in this process: the modules it loads are the suite's own)."""
    import torch

    gpu = "1" if torch.version.cuda else "0"
    assert install_check.main(["--gpu", gpu]) == 0, capsys.readouterr().err
    assert f"torch {torch.__version__} |" in capsys.readouterr().out
