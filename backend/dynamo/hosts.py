"""Hosts of their own on one machine: each is a Linux network namespace with its own address on a bridge, so the
processes of a cluster reach each other only by those addresses, as on several machines (nothing reaches another
"host" by 127.0.0.1 by accident). The bridge's own address is the client's way in from this namespace. Created and
removed here with iproute2's `ip` (root only); a namespace of its own sees only its loopback and its bridge port.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps."""
    used = [ipaddress.ip_network(word, strict=False) for line in (_ip("-4", "-o", "addr") + _ip("-4", "route"))
            .splitlines() for word in line.split() if "/" in word and word[0].isdigit()]
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(150) + 100}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("hosts: no free /24 in 10.100.0.0-10.249.255.0")


@dataclass
class Hosts:
    """A bridge and the namespaces on it; `add` makes one more host, `wrap` runs a command in one."""

    tag: str  # in every interface's and namespace's name (interface names: at most 15 characters)
    subnet: ipaddress.IPv4Network
    addresses: dict[str, str] = field(default_factory=dict)  # host name -> its address

    @property
    def bridge(self) -> str:
        return f"dyb{self.tag}"

    @property
    def gateway(self) -> str:
        """The bridge's address: this namespace's (the client's) on the hosts' network."""
        return str(self.subnet.network_address + 1)

    @classmethod
    def create(cls) -> Hosts:
        if os.geteuid() != 0:
            raise RuntimeError("hosts: network namespaces need root (ip netns)")
        hosts = cls(secrets.token_hex(3), _free_subnet())
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("addr", "add", f"{hosts.gateway}/{hosts.subnet.prefixlen}", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        return hosts

    def namespace(self, name: str) -> str:
        return f"dyn-{self.tag}-{name}"

    def add(self, name: str) -> str:
        """A namespace for host `name` with the next address, joined to the bridge; returns the address."""
        i = len(self.addresses) + 2
        address, ns, outside, inside = (str(self.subnet.network_address + i), self.namespace(name),
                                        self._bridge_end(i), f"dyp{self.tag}{i}")
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        for args in (("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inside),
                     ("link", "set", inside, "up"), ("link", "set", "lo", "up")):
            _ip("-n", ns, *args)
        self.addresses[name] = address
        return address

    def link(self, name: str) -> str:
        """The bridge's end of host `name`'s veth pair, in this namespace: its counters (/sys/class/net/<link>/
        statistics) are that host's traffic, what it sent as rx_bytes."""
        return self._bridge_end(int(self.addresses[name].rsplit(".", 1)[1]))

    def _bridge_end(self, i: int) -> str:
        """The bridge's end of the veth pair of the host at the subnet's address i."""
        return f"dyv{self.tag}{i}"

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run in host `name`'s namespace (`ip netns exec` execs it: the process keeps the pid)."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def remove(self) -> None:
        """Every namespace (their veth pairs go with them) and the bridge."""
        for name in self.addresses:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.addresses.clear()
