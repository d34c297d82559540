"""Hosts on one machine: Linux network namespaces on one bridge, each with its own address.

The multi-host test tier starts agentkv's processes inside these hosts so that every address,
port and UCX device that crosses a host boundary is a real one. Needs root and ``ip``
(iproute2). Every namespace and link is named ``akmh<pid><letter>-...`` (one letter per network of
the process), so that a run removes what an earlier, killed run left behind (its pid no longer
lives) and never what a concurrent run, or another network of the same run, still uses.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import string
import subprocess
from dataclasses import dataclass

from typing_extensions import Self

__all__ = ["PREFIX", "Host", "Network", "netns_available", "our_leftovers", "remove_stale"]

PREFIX = "akmh"
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]-")
# Interface names hold at most 15 characters: akmh + a 7-digit pid + a letter + "-br" fits.
_NETWORK_LETTERS = itertools.cycle(string.ascii_lowercase)


@dataclass(frozen=True)
class Host:
    """One namespace: ``address`` on its ``eth0``; ``link`` is the bridge end of its cable."""

    name: str
    namespace: str
    address: str
    link: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def netns_available() -> str | None:
    """None when namespaces can be built here, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    return None


class Network:
    """A bridge in this namespace (it gets the subnet's last address) and one host per ``add``.

    ``with Network("10.77.0.0/24") as net:``; leaving it deletes every namespace and link it made.
    """

    def __init__(self, subnet: str = "10.77.0.0/24") -> None:
        self.subnet = ipaddress.ip_network(subnet)
        self.tag = f"{PREFIX}{os.getpid()}{next(_NETWORK_LETTERS)}"
        self.bridge = f"{self.tag}-br"
        self.gateway = str(self.subnet[-2])  # this namespace's address on the bridge
        self.hosts: dict[str, Host] = {}

    def start(self) -> Self:
        remove_stale()
        if _subnet_routed(self.subnet):
            raise RuntimeError(f"{self.subnet} is already routed here: another run uses it")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Host:
        """A new host, joined to the bridge by a veth pair, loopback and ``eth0`` up."""
        number = len(self.hosts) + 1
        host = Host(
            name=name,
            namespace=f"{self.tag}-{name}",
            address=str(self.subnet[number]),
            link=f"{self.tag}-{number}",  # interface names hold at most 15 characters
        )
        _ip("netns", "add", host.namespace)
        self.hosts[name] = host
        _ip(
            "link",
            "add",
            host.link,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.namespace,
        )
        _ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ("-n", host.namespace)
        _ip(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        return host

    def cut(self, host: Host) -> None:
        """Unplug ``host``'s cable: nothing reaches it and it reaches nothing, as a failed link."""
        _ip("link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def stop(self) -> None:
        """Delete every veth pair, namespace and the bridge. Links first: a deleted namespace's
        devices go away only when the kernel gets round to it, after ``ip`` returned."""
        for host in self.hosts.values():
            _ip("link", "delete", host.link, check=False)
            _ip("netns", "delete", host.namespace, check=False)
        _ip("link", "delete", self.bridge, check=False)
        self.hosts.clear()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def our_leftovers(tag: str = PREFIX) -> tuple[list[str], list[str]]:
    """Namespaces and links whose name starts with ``tag``."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").splitlines() if line]
    links = [line.split(": ")[1].split("@")[0] for line in _ip("-o", "link", "show").splitlines()]
    return (
        [name for name in namespaces if name.startswith(tag)],
        [name for name in links if name.startswith(tag)],
    )


def remove_stale() -> None:
    """Delete what runs that no longer live left behind (a run killed before its clean-up)."""
    namespaces, links = our_leftovers()
    for name in namespaces:
        if _stale(name):
            _ip("netns", "delete", name, check=False)
    for name in links:
        if _stale(name):
            _ip("link", "delete", name, check=False)


def _stale(name: str) -> bool:
    match = _NAME.match(name)
    return match is not None and not _alive(int(match.group(1)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _subnet_routed(subnet: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return str(subnet) in _ip("route", "show")


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout
