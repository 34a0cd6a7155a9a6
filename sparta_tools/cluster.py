"""An emulated cluster on one machine: nodes as network namespaces behind a shaped link.

On one machine every link is loopback, so communication never costs what it does between
real nodes and overlapping it with compute cannot show. This starts `nodes` Linux network
namespaces, each joined to a bridge namespace by a veth pair whose two ends are shaped with
`tc ... tbf rate <rate>` (full duplex: each direction of each node's link gets the rate).
Ranks of one node share its namespace, so they talk over fast loopback; ranks of different
nodes cross the shaped link. Needs root and iproute2 (`ip`, `tc`); netem is not needed.

Addresses are private ones (`<subnet>.1..N`) that exist only inside the namespaces made here;
nothing is added to the host's own network. In node k this machine's host name resolves to
node k's address (an /etc/netns/<namespace>/hosts file, which `ip netns exec` mounts over
/etc/hosts): Horovod's process-set contexts connect by host name, which the host's own
/etc/hosts sends to loopback, another namespace. Everything is removed on exit from the `with`
block, on error, on Ctrl-C (KeyboardInterrupt unwinds through it) and at interpreter exit.

    with EmulatedCluster(ClusterConfig(nodes=2, ranks_per_node=2, rate="300mbit")) as cluster:
        codes = cluster.run([sys.executable, "worker.py", "--ranks-per-node", "2"], timeout_s=600)

Workers start as torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)
with GLOO_SOCKET_IFNAME set to their node's veth, and should call
`sparta.init(backend="torch", ranks_per_node=...)`: every namespace has the same host name.
With `launcher="horovodrun"` they start as `horovodrun --gloo` would start them instead: this
module serves Horovod's own rendezvous (`RendezvousServer`, what horovodrun runs in its
process) inside node 0's namespace, and each rank gets Horovod's variables (HOROVOD_RANK,
HOROVOD_HOSTNAME "node<k>", HOROVOD_GLOO_IFACE its node's veth, ...).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sparta.errors import ConfigError, SpartaError

_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
LAUNCHERS = ("torchrun", "horovodrun")
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts NETNS_ETC/NS/* over /etc/*

_SH_TIMEOUT_S = 30  # an ip or tc call; a stuck one raises instead of hanging the run


class ClusterUnavailableError(SpartaError, RuntimeError):
    """This machine cannot host an emulated cluster (not root, no iproute2, no namespaces)."""


@dataclass(frozen=True)
class ClusterConfig:
    """nodes x ranks_per_node ranks; `rate` is each node's link rate in tc's units
    ("100mbit", "1gbit"); `subnet` is the first three octets of the private /24 used only
    inside the namespaces ("10.213.0" -> nodes at 10.213.0.1, .2, ...); `master_port` the
    rendezvous port on node 0; `prefix` names the namespaces and links (unique per process
    by default, at most 8 characters so interface names fit Linux's 15); `pin_nodes` gives
    each node its own share of this machine's CPUs (`node_cpus`), as real nodes have their
    own cores: unpinned, the ranks of all nodes time-slice on every core, and a rank that
    the scheduler starves stalls every collective it is part of."""

    nodes: int = 2
    ranks_per_node: int = 2
    rate: str = "1gbit"
    subnet: str = "10.213.0"
    master_port: int = 29531
    prefix: str = field(default_factory=lambda: f"sp{os.getpid() % 100000}")
    pin_nodes: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ConfigError(f"ClusterConfig.nodes = {self.nodes}; use 1..200")
        if self.ranks_per_node < 1:
            raise ConfigError(f"ClusterConfig.ranks_per_node = {self.ranks_per_node}; use >= 1")
        if not _RATE.match(self.rate):
            raise ConfigError(f"ClusterConfig.rate = {self.rate!r}; write it as tc does, e.g. '300mbit' or '1gbit'")
        parts = self.subnet.split(".")
        if len(parts) != 3 or parts[0] != "10" or not all(p.isdigit() and int(p) < 256 for p in parts):
            raise ConfigError(f"ClusterConfig.subnet = {self.subnet!r}; give three octets of a 10.x.y.0/24 network")
        if not re.match(r"^[a-z][a-z0-9]{0,7}$", self.prefix):
            raise ConfigError(f"ClusterConfig.prefix = {self.prefix!r}; use 1-8 lowercase letters and digits")
        if not isinstance(self.pin_nodes, bool):
            raise ConfigError(f"ClusterConfig.pin_nodes = {self.pin_nodes!r}; use True or False")
        if not 1024 <= self.master_port < 65536:
            raise ConfigError(f"ClusterConfig.master_port = {self.master_port}; use 1024..65535")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def rate_bits_per_s(self) -> float:
        """The link rate in bit/s (tc's k/m/g are powers of 1000)."""
        m = re.match(r"^([\d.]+)(\w+)$", self.rate)
        assert m is not None
        return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def can_emulate() -> str | None:
    """None if this machine can host an emulated cluster, else why not (for skips)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install -y iproute2)"
    return None


class EmulatedCluster:
    """The namespaces, links and shaping of one ClusterConfig; a context manager."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        p = config.prefix
        self.bridge_ns = f"{p}br"
        self.node_ns = [f"{p}n{k}" for k in range(config.nodes)]
        self.node_dev = [f"{p}v{k}" for k in range(config.nodes)]  # node end of node k's link
        self.port_dev = [f"{p}b{k}" for k in range(config.nodes)]  # bridge end
        self.node_addr = [f"{config.subnet}.{k + 1}" for k in range(config.nodes)]
        self._made: list[str] = []  # namespaces to delete, in creation order
        self._made_etc = False
        self._procs: list[subprocess.Popen[bytes]] = []
        self._rendezvous: subprocess.Popen[bytes] | None = None  # Horovod's, for the ranks of one start()
        self._sigterm: Any = None  # the handler before ours, while the cluster stands

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> EmulatedCluster:
        why = can_emulate()
        if why:
            raise ClusterUnavailableError(f"cannot start an emulated cluster: {why}")
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            # atexit does not run on SIGTERM (a CI cancel, `timeout`): as SystemExit it unwinds
            # through close() and the namespaces, links and ranks go with it
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the ranks and delete every namespace (and with them the links). Idempotent."""
        for proc in [*self._procs, self._rendezvous]:
            self._stop(proc)
        self._procs.clear()
        self._rendezvous = None
        for ns in reversed(self._made):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_SH_TIMEOUT_S)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()
        if self._made_etc:  # /etc/netns did not exist before this cluster: gone, unless another uses it
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()
            self._made_etc = False
        atexit.unregister(self.close)
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def _build(self) -> None:
        c = self.config
        self._add_ns(self.bridge_ns)
        br = f"{c.prefix}bri"
        self._ip(self.bridge_ns, "link", "add", br, "type", "bridge")
        self._ip(self.bridge_ns, "link", "set", br, "up")
        for k in range(c.nodes):
            ns, dev, port = self.node_ns[k], self.node_dev[k], self.port_dev[k]
            self._add_ns(ns)
            # both ends are born inside their namespaces: the host's own links are never touched
            _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
            self._ip(self.bridge_ns, "link", "set", port, "master", br)
            self._ip(self.bridge_ns, "link", "set", port, "up")
            self._ip(ns, "addr", "add", f"{self.node_addr[k]}/24", "dev", dev)
            self._write_hosts(ns, self.node_addr[k])
            self._ip(ns, "link", "set", dev, "up")
            self._shape(ns, dev)  # node -> bridge
            self._shape(self.bridge_ns, port)  # bridge -> node

    def _write_hosts(self, ns: str, addr: str) -> None:
        hosts = NETNS_ETC / ns / "hosts"
        try:
            if not NETNS_ETC.exists():
                NETNS_ETC.mkdir(parents=True)
                self._made_etc = True
            hosts.parent.mkdir(exist_ok=True)
            hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{addr} {socket.gethostname()}\n")
        except OSError as exc:
            raise ClusterUnavailableError(f"cannot write {hosts} (node {ns}'s host name): {exc}") from exc

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        self._ip(ns, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        # burst: at least 1 ms worth of bytes, so tbf can keep up with the rate, and 256 KiB:
        # larger than a 64 KiB GSO packet, which tbf would otherwise cut into MTU-sized ones
        # in softirq (at 300 Mbit/s with 64 KiB that cost 30% of a core while transferring,
        # taken from the ranks' compute)
        burst = max(262144, int(self.config.rate_bits_per_s / 8 / 1000))
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", self.config.rate, "burst", str(burst), "latency", "200ms")  # fmt: skip

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        _sh("ip", "-n", ns, *args)

    # ------------------------------------------------------------------ ranks
    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment of world rank `rank`: torchrun's variables, the node's veth for gloo."""
        c = self.config
        node = rank // c.ranks_per_node
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(c.world_size),
            "LOCAL_RANK": str(rank % c.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(c.ranks_per_node),
            "MASTER_ADDR": self.node_addr[0],
            "MASTER_PORT": str(c.master_port),
            "GLOO_SOCKET_IFNAME": self.node_dev[node],
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def node_cpus(self, node: int) -> set[int] | None:
        """The CPUs node `node`'s ranks run on (None: unpinned): this process's CPUs dealt
        out evenly, in order; with fewer CPUs than nodes, nodes share them round-robin."""
        if not self.config.pin_nodes:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        nodes = self.config.nodes
        if len(cpus) < nodes:
            return {cpus[node % len(cpus)]}
        share = len(cpus) // nodes
        return set(cpus[node * share : (node + 1) * share])

    def horovod_env(self, rank: int, rendezvous_port: int) -> dict[str, str]:
        """What `horovodrun --gloo` gives rank `rank` (its create_slot_env_vars and
        create_run_env_vars), with node k posing as host "node<k>" on its own veth."""
        c = self.config
        node = rank // c.ranks_per_node
        return {
            "HOROVOD_HOSTNAME": f"node{node}",
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(c.world_size),
            "HOROVOD_LOCAL_RANK": str(rank % c.ranks_per_node),
            "HOROVOD_LOCAL_SIZE": str(c.ranks_per_node),
            "HOROVOD_CROSS_RANK": str(node),
            "HOROVOD_CROSS_SIZE": str(c.nodes),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.node_addr[0],
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": self.node_dev[node],
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def _horovod_rendezvous(self, env: dict[str, str], timeout_s: float = 60.0) -> int:
        """Start a fresh rendezvous server for one job (the last job's is stopped: its store
        holds that job's keys), on node 0's CPUs; returns its port."""
        c = self.config
        self._stop(self._rendezvous)
        cpus = self.node_cpus(0)
        errors = tempfile.TemporaryFile()  # its traceback, if it fails; never a pipe it could fill
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns[0], sys.executable, "-m", "sparta_tools.cluster",
             "horovod-rendezvous", str(c.nodes), str(c.ranks_per_node)],
            env=env, stdout=subprocess.PIPE, stderr=errors, start_new_session=True,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )  # fmt: skip
        self._rendezvous = proc
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], timeout_s)[0]
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.isdigit():
            self._stop(proc)
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-2000:]
            raise ClusterUnavailableError(f"Horovod's rendezvous server did not start in node 0 ({line!r}): {tail}")
        return int(line)

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def start(
        self,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        output: IO[Any] | None = None,
        launcher: str = "torchrun",
    ) -> list[subprocess.Popen[bytes]]:
        """Start `cmd` once per rank, each inside its node's namespace; returns the processes.
        `output`: a file every rank's stdout and stderr go to (default: this process's);
        `launcher`: whose variables the ranks get, "torchrun" or "horovodrun" (--gloo)."""
        if launcher not in LAUNCHERS:
            raise ConfigError(f"EmulatedCluster.start(launcher={launcher!r}): use one of {', '.join(LAUNCHERS)}")
        base = dict(os.environ if env is None else env)
        port = self._horovod_rendezvous(base) if launcher == "horovodrun" else 0
        procs = []
        for rank in range(self.config.world_size):
            node = rank // self.config.ranks_per_node
            cpus = self.node_cpus(node)
            rank_env = self.horovod_env(rank, port) if launcher == "horovodrun" else self.rank_env(rank)
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.node_ns[node], *cmd],
                env={**base, **rank_env},
                stdout=output,
                stderr=None if output is None else subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if cpus is None else lambda cpus=cpus: os.sched_setaffinity(0, cpus),
            )
            self._procs.append(proc)
            procs.append(proc)
        return procs

    def run(
        self,
        cmd: Sequence[str],
        timeout_s: float,
        env: dict[str, str] | None = None,
        output: IO[Any] | None = None,
        launcher: str = "torchrun",
    ) -> list[int]:
        """Run `cmd` on every rank and wait; returns the exit codes. Kills them all and
        raises TimeoutError after `timeout_s`, and stops the others as soon as one fails.
        `output` and `launcher` as for `start`."""
        procs = self.start(cmd, env, output, launcher)
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break  # one rank failed: the others would wait on it until their timeout
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{list(cmd)} on the emulated cluster ran past {timeout_s:g} s; killed")
                time.sleep(0.05)
        finally:
            for p in [*procs, self._rendezvous]:
                self._stop(p)
            self._rendezvous = None
        return [int(p.returncode) for p in procs]


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _sh(*args: str) -> None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_SH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClusterUnavailableError(f"`{' '.join(args)}` did not finish in {_SH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise ClusterUnavailableError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")


def _serve_horovod_rendezvous(nodes: int, ranks_per_node: int) -> None:
    # Horovod's own server and host plan, as horovodrun --gloo builds them; prints the port
    # for the parent, then serves until the cluster kills it
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    hosts = parse_hosts(",".join(f"node{k}:{ranks_per_node}" for k in range(nodes)))
    server.init(get_host_assignments(hosts, nodes * ranks_per_node))
    print(port, flush=True)
    signal.pause()


if __name__ == "__main__" and sys.argv[1:2] == ["horovod-rendezvous"]:
    _serve_horovod_rendezvous(int(sys.argv[2]), int(sys.argv[3]))
