"""A Slurm cluster of separate hosts on this one machine, for the tests.

Design note. A cluster's nodes differ from two tasks on one host in four ways
the code can trip over: each has its own hostname, its own process table (a pid
recorded on one node means nothing on another), its own network address, and
its own link, which can go away while its processes keep running. Each host
here is therefore a network namespace (`ip netns`) entered with `unshare --uts
--pid --fork --mount-proc`: its own hostname, pids and /proc, an address on one
bridge, no default route and no NAT (traffic stays between the test's hosts).

    login   this machine's own namespace: the tests, the CLI, the driver, the panel
    ctl     slurmctld, and an SFTP server of the shared disk (the "storage server")
    n0, n1  slurmd each (NodeName n0, n1 with their own NodeAddr)

The shared filesystem is the shared disk seen *over the network*: each node
mounts the tests' folder with sshfs from ctl at the same path, as a cluster
node mounts NFS or Lustre (sshfs straight to OpenSSH's sftp-server on a port
of ctl's, `-o directport`: no sshd, no keys, no service on this machine). So a
node whose link is cut loses what it loses on a real cluster (the controller,
its peers and the shared disk: its writes block, as on a hard NFS mount, and go
through when the link comes back) while its processes keep running. The login
namespace sees the folder directly. sshfs says a lost O_EXCL race or link
race as EPERM (SFTP v3 has no "exists" status): the queue and the hidden-state
writer tell it from a real refusal by looking.

munged is the cluster's own (its key, socket and pid file in the cluster's
folder; slurm.conf's AuthInfo names the socket), and every daemon is stopped by
`stop()`, whatever the tests' result: a node's init is pid 1 of its pid
namespace, so its end takes every process of that node with it.

    python -m tests.netns_cluster node --name n0 --hosts F [--mount SRC DST OPTS] -- CMD...
        a host's init (pid 1 in its namespaces): hostname, /etc/hosts, mounts, CMD, reaping
    python -m tests.netns_cluster sftp --addr A --port P
        the storage server: OpenSSH's sftp-server for each connection
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("ip", "nsenter", "unshare", "munged", "mungekey", "slurmctld", "slurmd", "sbatch",
         "sshfs")
SFTP_SERVER = "/usr/lib/openssh/sftp-server"   # Debian's openssh-sftp-server
SFTP_PORT = 7022
NODE_LOST_S = 10        # slurm.conf SlurmdTimeout: a silent node is DOWN after this


class Unavailable(RuntimeError):
    """This machine cannot make the cluster (the reason is the message)."""


def unavailable_reason() -> str | None:
    """Why this machine cannot make the cluster, in one line; None if it can."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (network namespaces, mounts, Slurm's daemons)"
    missing = [t for t in NEEDS if not shutil.which(t)]
    if not Path(SFTP_SERVER).exists():
        missing.append(SFTP_SERVER)
    if missing:
        return (f"not installed: {', '.join(missing)} (scripts/install.sh --dev installs "
                "slurmctld slurmd slurm-client munge iproute2 sshfs openssh-sftp-server)")
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse here: the nodes mount the shared disk with sshfs"
    probe = f"epprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if r.returncode:
        return f"network namespaces cannot be made here: {r.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _sh(*argv, check=True, timeout=30) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                       check=False)
    if check and r.returncode:
        raise Unavailable(f"{' '.join(map(str, argv))}: {(r.stderr or r.stdout).strip()[:300]}")
    return r


class NetCluster:
    """`nodes` Slurm nodes, a controller and this machine as the login node;
    `shared` is the folder every node mounts (over the network) at its own path."""

    def __init__(self, shared: Path, nodes: int = 2):
        self.shared = Path(shared).resolve()
        self.nodes = [f"n{i}" for i in range(nodes)]
        tag = os.getpid() % 100000
        self.prefix = f"ep{tag}"
        self.base = Path(tempfile.mkdtemp(prefix=f"ep-netcluster-{tag}-"))
        self.net = f"10.213.{tag % 200 + 20}"
        self.addr = {"login": f"{self.net}.1", "ctl": f"{self.net}.2",
                     **{n: f"{self.net}.{10 + i}" for i, n in enumerate(self.nodes)}}
        self.conf = self.base / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.netns: list[str] = []

    # ---- names ------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def env(self) -> dict[str, str]:
        """What a Slurm client on the login node needs."""
        return {"SLURM_CONF": str(self.conf)}

    # ---- start / stop -------------------------------------------------------------
    def start(self) -> NetCluster:
        try:
            self._write_files()
            self._network()
            self._daemons()
            self.wait_idle(timeout=90)
        except BaseException:  # noqa: BLE001 - whatever stopped it, nothing is left running
            logs = self.logs()
            self.stop()
            raise Unavailable(f"the namespace cluster did not come up: {logs[-1500:]}") from None
        return self

    def stop(self) -> None:
        """Every daemon and node stopped, every namespace and the folder removed."""
        inits = {h: p for h, p in self.procs.items() if h not in ("munged",)}
        for p in inits.values():
            with contextlib.suppress(ProcessLookupError):
                _signal_init(p, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in inits.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()        # unshare --kill-child: its init and the namespace's processes go too
                p.wait(timeout=30)
        for ns in reversed(self.netns):
            _sh("ip", "netns", "del", ns, check=False)
        self.netns.clear()
        self.procs.clear()
        shutil.rmtree(self.base, ignore_errors=True)

    def _write_files(self) -> None:
        b = self.base
        for sub in ("munge", "ctl/state", *(f"{n}/spool" for n in self.nodes)):
            (b / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o700)
        _sh("mungekey", "-c", "-k", b / "munge/munge.key")
        hosts = ["127.0.0.1 localhost"] + [f"{a} {h}" for h, a in self.addr.items()]
        (b / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.addr[n]} CPUs={os.cpu_count()} "
                          "State=UNKNOWN" for n in self.nodes)
        partition = (f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=FORCE:8")
        self.conf.write_text(textwrap.dedent(f"""\
            ClusterName=epnet
            SlurmctldHost=ctl({self.addr['ctl']})
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            AuthInfo=socket={b}/munge/munge.sock
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            ReturnToService=2
            SlurmdTimeout={NODE_LOST_S}
            MessageTimeout=5
            TCPTimeout=3
            StateSaveLocation={b}/ctl/state
            SlurmdSpoolDir={b}/%n/spool
            SlurmctldPidFile={b}/ctl/slurmctld.pid
            SlurmdPidFile={b}/%n/slurmd.pid
            SlurmctldLogFile={b}/ctl/slurmctld.log
            SlurmdLogFile={b}/%n/slurmd.log
            MpiDefault=none
            KillWait=5
            MinJobAge=600
            OverTimeLimit=0
            """) + nodes + "\n" + partition + "\n")

    def _network(self) -> None:
        """One bridge in its own namespace; a veth from each host to it. The
        login end stays in this machine's namespace (named after the cluster)."""
        sw = self.ns("sw")
        _sh("ip", "netns", "add", sw)
        self.netns.append(sw)
        _sh("ip", "netns", "exec", sw, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", sw, "ip", "link", "set", "br0", "up")
        for host in ("login", "ctl", *self.nodes):
            end = f"{self.prefix}{host}"[:15]
            _sh("ip", "link", "add", end, "type", "veth", "peer", "name", f"p-{host}", "netns", sw)
            _sh("ip", "netns", "exec", sw, "ip", "link", "set", f"p-{host}", "master", "br0", "up")
            if host == "login":
                _sh("ip", "addr", "add", f"{self.addr[host]}/24", "dev", end)
                _sh("ip", "link", "set", end, "up")
                continue
            ns = self.ns(host)
            _sh("ip", "netns", "add", ns)
            self.netns.insert(0, ns)     # removed before the switch
            _sh("ip", "link", "set", end, "netns", ns)
            for argv in (["ip", "link", "set", end, "name", "eth0"],
                         ["ip", "addr", "add", f"{self.addr[host]}/24", "dev", "eth0"],
                         ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]):
                _sh("ip", "netns", "exec", ns, *argv)

    def _daemons(self) -> None:
        b = self.base
        self.procs["munged"] = subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={b}/munge/munge.sock",
             f"--key-file={b}/munge/munge.key", f"--pid-file={b}/munge/munged.pid",
             f"--log-file={b}/munge/munged.log", f"--seed-file={b}/munge/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: (b / "munge/munge.sock").exists(), 20, "munged's socket")
        sftp = shlex.join([sys.executable, "-m", "tests.netns_cluster", "sftp", "--addr",
                           self.addr["ctl"], "--port", str(SFTP_PORT)])
        self.procs["ctl"] = self._host("ctl", [], [
            "sh", "-c", f"{sftp} >>{b}/sftp.log 2>&1 & exec slurmctld -D -i"])
        _wait(lambda: _port_open(self.addr["ctl"], SFTP_PORT), 20, "the SFTP server on ctl")
        for n in self.nodes:
            # dir_cache=no: a node's listing of claims/ or done/ is never an old one
            mount = ["--mount", f"{self.addr['ctl']}:{self.shared}", str(self.shared),
                     f"directport={SFTP_PORT},dir_cache=no"]
            self.procs[n] = self._host(n, mount, ["slurmd", "-D", "-N", n])

    def _host(self, host: str, extra: list[str], cmd: list[str]) -> subprocess.Popen:
        log = open(self.base / f"{host}.init.log", "ab")   # the child's: it keeps it open
        env = {**os.environ, **self.env(), "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            # nsenter, not `ip netns exec`: that one mounts a new /sys, without the
            # cgroup hierarchy slurmd needs
            ["nsenter", f"--net=/run/netns/{self.ns(host)}", "unshare", "--uts", "--pid", "--fork",
             "--mount-proc", "--kill-child", sys.executable, "-m", "tests.netns_cluster", "node",
             "--name", host, "--hosts", str(self.base / "hosts"), *extra, "--", *cmd],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_idle(self, timeout: float = 60, nodes: list[str] | None = None) -> None:
        want = set(nodes or self.nodes)
        _wait(lambda: want <= {n for n, s in self.node_states().items()
                               if s.rstrip("*~#") in ("idle", "mixed", "allocated")},
              timeout, f"nodes {sorted(want)} up in Slurm")

    def node_states(self) -> dict[str, str]:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           env={**os.environ, **self.env()}, check=False, timeout=30)
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def logs(self) -> str:
        out = []
        for f in sorted(self.base.glob("**/*.log")):
            with contextlib.suppress(OSError):
                out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-600:]}")
        return "\n".join(out)

    # ---- what the tests do to it -------------------------------------------------
    def cut(self, host: str) -> None:
        """The host's link down: it reaches nothing (controller, peers, shared
        disk), and nothing reaches it; its processes keep running."""
        self._link(host, "down")

    def mend(self, host: str) -> None:
        """The link up again; a node Slurm marked down meanwhile is resumed as an
        admin would (`scontrol update State=RESUME`: without it, slurmctld takes
        ~50 s to ping a down node back, measured here)."""
        self._link(host, "up")
        if host in self.nodes and self.node_states().get(host, "").startswith("down"):
            subprocess.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"],
                           capture_output=True, env={**os.environ, **self.env()}, check=False,
                           timeout=30)

    def _link(self, host: str, state: str) -> None:
        # the switch's port: the same for the login node (this namespace) as for the others
        _sh("ip", "netns", "exec", self.ns("sw"), "ip", "link", "set", f"p-{host}", state)

    def pids(self, host: str) -> list[int]:
        """The host's processes, as this (the login) namespace numbers them."""
        init = self.procs[host]
        target = _pidns(_child(init.pid))
        return [p for p in _all_pids() if target and _pidns(p) == target]


# ---- helpers ------------------------------------------------------------------------

def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise Unavailable(f"timed out after {timeout:.0f} s waiting for {what}")


def _port_open(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((addr, port)) == 0


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pidns(pid: int | None) -> str | None:
    if pid is None:
        return None
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _child(pid: int) -> int | None:
    """unshare's forked child: the host's init (pid 1 in its namespace)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _signal_init(unshare: subprocess.Popen, sig: int) -> None:
    init = _child(unshare.pid)
    if init is not None:
        os.kill(init, sig)


# ---- a host's init ------------------------------------------------------------------

def node_init(name: str, hosts: Path, mounts: list[list[str]], cmd: list[str]) -> int:
    """pid 1 of a host: its hostname and /etc/hosts, its network mounts, then
    `cmd`, reaping every orphan until `cmd` ends (then the kernel ends the rest
    of the namespace). SIGTERM goes on to `cmd`."""
    socket.sethostname(name)
    subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
    for src, dst, opts in mounts:
        # sshfs forks into the background once mounted; it is reaped here like any orphan
        subprocess.run(["sshfs", "-o", opts, src, dst], check=True)
    child = subprocess.Popen(cmd)
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: child.send_signal(signal.SIGINT))
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status) & 0xFF


def serve_sftp(addr: str, port: int) -> None:
    """OpenSSH's sftp-server on each connection to addr:port (stdin and stdout
    the socket): the nodes' `sshfs -o directport` mounts."""
    import socketserver

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            fd = self.request.fileno()
            subprocess.run([SFTP_SERVER, "-e", "-l", "ERROR"], stdin=fd, stdout=fd, check=False)

    class Server(socketserver.ForkingTCPServer):
        allow_reuse_address = True

    with Server((addr, port), Handler) as server:
        server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description="a test host's init, or its storage server")
    sub = ap.add_subparsers(dest="what", required=True)
    sftp = sub.add_parser("sftp")
    sftp.add_argument("--addr", required=True)
    sftp.add_argument("--port", type=int, required=True)
    node = sub.add_parser("node")
    node.add_argument("--name", required=True)
    node.add_argument("--hosts", required=True, type=Path)
    node.add_argument("--mount", nargs=3, action="append", default=[],
                      metavar=("SRC", "DST", "OPTIONS"))
    node.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.what == "sftp":
        serve_sftp(a.addr, a.port)
        return
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    sys.exit(node_init(a.name, a.hosts, a.mount, cmd))


if __name__ == "__main__":
    main()
