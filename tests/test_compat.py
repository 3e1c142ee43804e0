"""hybridrec on an older torch: what torch 2.11 lacks is supplied by hybridrec.base.compat, each
fallback exercised here by hiding the newer API; and the fbgemm-gpu / torchrec releases that
`make install GPU=1 SYSTEM_TORCH=1` picks for a host's own torch."""

import os
import subprocess
import sys

import pytest

from hybridrec.base import compat


@pytest.mark.unit
def test_the_process_state_is_read_from_proc_without_torchs_helper(monkeypatch):
    monkeypatch.setattr(compat, "_torch_proc_state", None)  # torch 2.11: no process_state module
    assert compat.read_proc_state(os.getpid()) == "R"
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(stopped.pid, 19)  # SIGSTOP
        while compat.read_proc_state(stopped.pid) not in ("T", "t"):
            pass
        assert compat.own_proc_state(stopped.pid) == "T"
    finally:
        stopped.kill()
        stopped.wait()
    assert compat.read_proc_state(stopped.pid) is None  # gone


@pytest.mark.unit
def test_the_agents_shutdown_timeout_is_passed_only_where_torch_takes_it():
    class Torch211Agent:  # LocalElasticAgent before the keyword existed
        def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300):
            pass

    assert compat.agent_kwargs(5, Torch211Agent) == {}
    assert compat.agent_kwargs(5) == {"shutdown_timeout": 5}  # this torch's agent


@pytest.mark.slow
def test_the_launcher_imports_and_builds_its_agent_where_torch_lacks_both():
    """torch 2.11 as hybridrec meets it: no process_state module, an agent without the
    keyword. The launcher imports, and its agent is built, with neither."""
    code = """
import sys, inspect
from torch.distributed.elastic.agent.server import local_elastic_agent as lea  # (2.13's imports process_state)
sys.modules["torch.distributed.elastic.utils.process_state"] = None  # from now on its import fails: torch 2.11
init = lea.LocalElasticAgent.__init__
def old_init(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300, log_line_prefix_template=None):
    init(self, spec, logs_specs, start_method, exit_barrier_timeout, log_line_prefix_template=log_line_prefix_template)
lea.LocalElasticAgent.__init__ = old_init
from hybridrec.base import compat
from hybridrec.run import launch
assert compat._torch_proc_state is None and compat.agent_kwargs(5) == {}
import multiprocessing
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
spec = WorkerSpec(role="x", local_world_size=1, entrypoint=print, args=(), rdzv_handler=None)
agent = launch._Agent(spec, DefaultLogsSpecs(), beats=multiprocessing.RawArray("d", 1), silence_s=1.0,
                      **compat.agent_kwargs(shutdown_timeout=5))
print("ok", compat.read_proc_state(1) is not None)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[-2:] == ["ok", "True"], proc.stderr[-3000:]


@pytest.mark.unit
@pytest.mark.parametrize(
    "torch_version, expected",
    [
        ("2.13.0", ["fbgemm-gpu==1.8.0", "torchrec==1.8.0"]),
        ("2.12.1+cu128", ["fbgemm-gpu==1.7.0", "torchrec==1.7.0"]),
        ("2.11.0+cu130", ["fbgemm-gpu==1.6.0", "torchrec==1.6.1"]),
    ],
)
def test_a_hosts_torch_gets_the_fbgemm_and_torchrec_that_load_with_it(torch_version, expected):
    from hybridrec import install_check

    assert install_check.pairs(torch_version) == expected
    with pytest.raises(ValueError, match="torch 2.10.0: hybridrec runs on torch 2.11, 2.12, 2.13"):
        install_check.pairs("2.10.0")
