"""The emulated cluster: config checks anywhere; a real 2 x 2 cluster where root can make one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sparta.errors import ConfigError
from sparta_tools.cluster import ClusterConfig, ClusterUnavailableError, EmulatedCluster, can_emulate

WORKER = Path(__file__).resolve().parent.parent / "dist" / "sched_cluster_worker.py"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rate": "fast"}, "rate = 'fast'"),
        ({"subnet": "192.168.1"}, "10.x.y.0/24"),
        ({"nodes": 0}, "nodes = 0"),
        ({"prefix": "Bad-Name"}, "prefix"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterConfig(**kwargs)


def test_rate_in_bits() -> None:
    assert ClusterConfig(rate="300mbit").rate_bits_per_s == 300e6


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_two_nodes_shaped_and_torn_down() -> None:
    why = can_emulate()
    if why:
        pytest.skip(why)
    config = ClusterConfig(nodes=2, ranks_per_node=2, rate="100mbit", master_port=29547)
    results = tempfile.mkdtemp(prefix="sparta-cluster-")
    env = {"SPARTA_TEST_RESULTS": results, "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"}
    try:
        with EmulatedCluster(config) as cluster:
            env["SPARTA_TEST_NODE_CPUS"] = json.dumps([sorted(cluster.node_cpus(n) or ()) for n in range(2)])
            assert config.prefix + "n1" in _namespaces()
            codes = cluster.run([sys.executable, str(WORKER)], timeout_s=90, env=env)
    except ClusterUnavailableError as e:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(str(e))
    assert config.prefix not in _namespaces(), "namespaces left behind"
    assert not list(Path("/etc/netns").glob(f"{config.prefix}*")), "host files left behind"
    recs = [json.loads(line) for p in Path(results).glob("rank-*.jsonl") for line in p.read_text().splitlines()]
    failed = [r["error"] for r in recs if not r["ok"]]
    assert not failed, failed[0]
    assert codes == [0] * 4 and len(recs) == 16, (codes, recs)


def test_nodes_get_their_own_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cluster = EmulatedCluster(ClusterConfig(nodes=2))
    shares = [cluster.node_cpus(n) for n in range(2)]
    assert all(shares) and set().union(*shares) <= set(cpus)
    if len(cpus) >= 2:
        assert not shares[0] & shares[1] and len(shares[0]) == len(cpus) // 2
    many = EmulatedCluster(ClusterConfig(nodes=len(cpus) + 1))
    assert many.node_cpus(len(cpus)) == {cpus[0]}  # more nodes than CPUs: round-robin
    assert EmulatedCluster(ClusterConfig(pin_nodes=False)).node_cpus(0) is None


def test_teardown_on_error() -> None:
    why = can_emulate()
    if why:
        pytest.skip(why)
    config = ClusterConfig(nodes=3, ranks_per_node=1, master_port=29548)
    try:
        with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(config):
            assert config.prefix + "n2" in _namespaces()
            raise RuntimeError("boom")
    except ClusterUnavailableError as e:
        pytest.skip(str(e))
    assert config.prefix not in _namespaces()


def test_sigterm_takes_the_cluster_down() -> None:
    """atexit does not run on SIGTERM (a CI cancel, `timeout`); the cluster turns it into
    SystemExit while it stands, so its namespaces and links go with the process."""
    why = can_emulate()
    if why:
        pytest.skip(why)
    code = (
        "import time\n"
        "from sparta_tools.cluster import ClusterConfig, EmulatedCluster\n"
        "with EmulatedCluster(ClusterConfig(nodes=2, ranks_per_node=1, rate='100mbit')) as cluster:\n"
        "    print('UP', cluster.config.prefix, flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("UP"):
            proc.kill()
            pytest.skip(f"the cluster did not start: {proc.communicate()[1][-2000:]}")
        prefix = line.split()[1]
        assert prefix + "n1" in _namespaces()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert prefix not in _namespaces(), "namespaces left behind"
    assert not list(Path("/etc/netns").glob(f"{prefix}*")), "host files left behind"
