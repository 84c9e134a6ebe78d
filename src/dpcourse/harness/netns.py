"""The system side of :class:`dpcourse.harness.cluster.EmulatedCluster`: checking that network
namespaces can be made here, running ``ip`` and ``tc``, removing what a cluster made (or what a
killed caller's cluster left behind).

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

PREFIX = "dpc"
_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])")  # dpc<pid><letter>...: whose, and which cluster


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built here; the message says what is missing."""


def _has_net_admin() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 12))  # CAP_NET_ADMIN is bit 12
    except OSError:
        pass
    return False


def check_available() -> None:
    """Raise :class:`ClusterUnavailable` saying what is missing, or return if a cluster can be
    built here (Linux, ``ip`` and ``tc``, root or ``CAP_NET_ADMIN``, and no
    ``DPCOURSE_NO_CLUSTER=1`` in the environment: the chapters then show recorded runs)."""
    if os.environ.get("DPCOURSE_NO_CLUSTER", "") not in ("", "0"):
        raise ClusterUnavailable(
            "DPCOURSE_NO_CLUSTER is set: no emulated cluster is built (unset it to measure)"
        )
    if not os.path.exists("/proc/self/ns/net"):
        raise ClusterUnavailable(
            "the emulated cluster needs Linux network namespaces; this system has none "
            "(on macOS or Windows, run the course in a Linux container or VM)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(
            f"the emulated cluster needs iproute2 ({' and '.join(missing)} not found): install it "
            "(Debian/Ubuntu: apt-get install iproute2)"
        )
    if not _has_net_admin():
        raise ClusterUnavailable(
            "the emulated cluster creates network namespaces and shapes links, which needs root "
            "or the capability CAP_NET_ADMIN: run Jupyter or the script with sudo, or in a "
            "container started with --cap-add NET_ADMIN"
        )


def ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(tag: str) -> None:
    """Remove the bridge, cables and namespaces whose names start with ``tag``."""
    for line in ip("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(tag):
            ip("ip", "link", "del", name, check=False)  # deleting one end deletes the cable
    for line in ip("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(tag):
            ip("ip", "netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Remove what clusters of callers that no longer run left behind; return their tags."""
    names = [line.split()[0] for line in ip("ip", "netns", "list", check=False).splitlines()
             if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0]
              for line in ip("ip", "-o", "link", "show", check=False).splitlines()
              if ":" in line]
    stale = sorted({m[0][: len(PREFIX) + len(m[1]) + 1] for m in map(_NAME.match, names)
                    if m and not _alive(int(m[1]))})
    for tag in stale:
        remove(tag)
    return stale


def leftovers(tag: str) -> list[str]:
    """The namespaces, cables and bridges whose names start with ``tag`` (none once a cluster
    has closed)."""
    out = ip("ip", "netns", "list", check=False) + ip("ip", "-o", "link", check=False)
    return sorted({word.split("@")[0] for word in out.replace(":", " ").split()
                   if word.startswith(tag)})


def namespace_inode(name: str) -> int:
    """The inode that identifies the network namespace ``name`` (see :func:`processes_in`)."""
    return os.stat(f"/var/run/netns/{name}").st_ino


def processes_in(inodes: set[int]) -> list[str]:
    """The processes (``"pid name"``) whose network namespace is one of ``inodes``, read from
    ``/proc``: a process keeps a namespace alive after its name is deleted, and is found here
    all the same."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                with open(f"/proc/{pid}/comm") as f:
                    found.append(f"{pid} {f.read().strip()}")
        except OSError:
            pass
    return found
