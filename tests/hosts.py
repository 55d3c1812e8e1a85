"""Two hosts on one machine, for real: two Linux network namespaces joined by a veth pair, each with an address
of its own, so that a multi-process run crosses a real network interface instead of loopback (the bugs of a
cluster: binding to 127.0.0.1, the wrong interface, a port clash, never show on one host).

    sudo python -m tests.hosts up      # make them (root and iproute2's `ip`); prints their addresses
    sudo ip netns exec rosetta-h0 python compare.py ... --hosts 10.77.0.1,10.77.0.2 --node-rank 0
    sudo ip netns exec rosetta-h1 python compare.py ... --hosts 10.77.0.1,10.77.0.2 --node-rank 1
    sudo python -m tests.hosts down    # remove them

These are the project's own test hosts: their addresses exist only inside the two namespaces, and nothing
leaves the machine (neither namespace has a route to anywhere else). Each namespace gets a hosts file
(/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts) naming the two hosts, as a cluster's
DNS would: `rosetta-h0` and `rosetta-h1` resolve to their addresses in both.
"""
import os
import shutil
import subprocess
import sys

from common.interface import RosettaError

NAMES = ("rosetta-h0", "rosetta-h1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
INTERFACES = ("rosetta0", "rosetta1")   # each host's end of the veth pair
PREFIX = 24


def missing():
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not shutil.which("ip"):
        return "making network namespaces needs iproute2's `ip` (apt-get install iproute2)"
    return None


def ip(*args, check=True):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RosettaError(f"ip {' '.join(args)}: {done.stderr.strip() or 'failed'}")
    return done


def exists():
    return set(NAMES) <= set(ip("netns", "list").stdout.split())


def hosts_file(name):
    return os.path.join("/etc/netns", name, "hosts")


def up():
    """Make the two hosts (after removing any left from an earlier run); return [(name, address, interface)]."""
    why = missing()
    if why:
        raise RosettaError(why)
    down()
    try:
        for name in NAMES:
            ip("netns", "add", name)
        ip("link", "add", INTERFACES[0], "type", "veth", "peer", "name", INTERFACES[1])
        for name, address, interface in zip(NAMES, ADDRESSES, INTERFACES):
            ip("link", "set", interface, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/{PREFIX}", "dev", interface)
            ip("-n", name, "link", "set", interface, "up")
            ip("-n", name, "link", "set", "lo", "up")
            os.makedirs(os.path.dirname(hosts_file(name)), exist_ok=True)
            with open(hosts_file(name), "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in zip(NAMES, ADDRESSES)))
    except BaseException:
        down()
        raise
    return list(zip(NAMES, ADDRESSES, INTERFACES))


def down():
    """Remove the two hosts and everything made for them (deleting a namespace deletes its end of the veth
    pair, and with it the other end)."""
    for name in NAMES:
        ip("netns", "delete", name, check=False)
        shutil.rmtree(os.path.dirname(hosts_file(name)), ignore_errors=True)


def run_in(host, argv, **options):
    """Start argv on one of the hosts (its index): a subprocess.Popen inside that namespace."""
    return subprocess.Popen(["ip", "netns", "exec", NAMES[host], *argv], **options)


def main(argv):
    if argv not in (["up"], ["down"]):
        print("usage: python -m tests.hosts up|down", file=sys.stderr)
        return 2
    try:
        if argv == ["down"]:
            down()
            return 0
        for name, address, interface in up():
            print(f"{name}: {address} on {interface} (ip netns exec {name} CMD)")
        return 0
    except RosettaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
