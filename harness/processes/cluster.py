"""Where a run's processes are, and the variables each framework's own launcher would give one of them: the one
place that decides the coordinator's address, the ports and the network interface, on one host or many.

A run of P processes on N hosts puts P/N on each, in rank order: host h has ranks h*P/N .. (h+1)*P/N - 1, and
its first rank is local rank 0 there (torchrun's and SLURM's order). The first host is the coordinator: it
serves torch.distributed's store, MXNet's scheduler and the JAX coordinator at `port`; TensorFlow has no
coordinator, so every worker listens on a port of its own, `port` + 1 + its local rank on its host.

The interface matters on a real network: gloo (PyTorch, and JAX's CPU collectives) binds to the address the
machine's hostname resolves to unless told an interface, and on many machines that name resolves to 127.0.0.1
or to nothing; ps-lite (MXNet) picks the first interface it finds. So every engine is told this host's
interface, the one holding its address (`interface_of`), in the variable it reads.
"""
import dataclasses
import fcntl
import json
import socket
import struct

from common.interface import RosettaError
from common.placement import machine_gpus, worker_env

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500   # torchrun's


@dataclasses.dataclass(frozen=True)
class Cluster:
    hosts: tuple = (LOOPBACK,)      # one address (or name) per host; the first is the coordinator's
    node_rank: int = 0              # this host's place in `hosts`
    port: int | None = None         # the coordinator's; None: free ports picked on this host (one-host runs)
    interface: str | None = None    # this host's network interface; None: the one holding its address

    def __post_init__(self):
        if not 0 <= self.node_rank < len(self.hosts):
            raise RosettaError(f"node rank {self.node_rank} is not one of the {len(self.hosts)} hosts "
                               f"({', '.join(self.hosts)})")
        if len(self.hosts) > 1 and self.port is None:
            raise RosettaError("a run over several hosts needs a port agreed on by all of them")

    @property
    def nnodes(self):
        return len(self.hosts)

    def local_world(self, processes):
        """The processes on each host; a run's processes must share out evenly."""
        if processes % self.nnodes:
            raise RosettaError(f"{processes} process(es) cannot be shared out evenly over {self.nnodes} hosts: "
                               f"--processes must be a multiple of {self.nnodes}")
        return processes // self.nnodes

    def ranks(self, processes):
        """The global ranks of this host's processes, in local-rank order."""
        k = self.local_world(processes)
        return range(self.node_rank * k, (self.node_rank + 1) * k)

    def address(self):
        return resolve(self.hosts[self.node_rank])

    def my_interface(self):
        return self.interface or interface_of(self.address())


ONE_HOST = Cluster()


def resolve(host):
    """The IPv4 address of a host name (or the address itself), or one line saying it has none."""
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        raise RosettaError(f"cannot resolve host {host!r}: {err.strerror or err}") from None


def interface_of(address):
    """The name of this machine's network interface that holds the IPv4 `address` (SIOCGIFADDR on each one), or
    one line saying none does: a run on several hosts must be started on the host it names."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                held = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24])
            except OSError:   # an interface with no IPv4 address
                continue
            if held == address:
                return name
    raise RosettaError(f"no network interface of this machine holds {address}: start each host's command on "
                       "the host its --node-rank names, or give its interface with --interface")


def free_ports(n):
    """n ports that are free right now (the OS picks them; we release them just before use)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind((LOOPBACK, 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def ports_for(cluster, processes):
    """(the coordinator's port, [each TensorFlow worker's port, in rank order])."""
    if cluster.port is None:
        first, *rest = free_ports(processes + 1)
        return first, rest
    k = cluster.local_world(processes)
    return cluster.port, [cluster.port + 1 + r % k for r in range(processes)]


def engine_env(framework, world, devices=None, gpus=None, cluster=ONE_HOST, ports=None):
    """(per-worker environments of this host's workers, in rank order; [(name, environment)] of the helper
    processes this host runs) for one run of `world` processes and `devices` devices in all. Each worker gets its
    share of this host's GPUs (`gpus`, their ids; default machine_gpus()) by common.placement's rule, from its local
    rank. `ports`: (the coordinator's, TensorFlow's workers') when the caller chose them (ports_for)."""
    from ..spec import RunSpec
    gpus = machine_gpus() if gpus is None else gpus
    local = cluster.local_world(world)
    per_process = RunSpec(framework, devices=devices or world, processes=world).per_process
    coordinator, interface = resolve(cluster.hosts[0]), cluster.my_interface()
    port, worker_ports = ports or ports_for(cluster, world)
    ranks = cluster.ranks(world)
    place = {r: worker_env(framework, r % local, local, per_process, gpus) for r in ranks}
    if framework == "pytorch":   # what `torchrun --nnodes=N --node-rank=R --master-addr=A --master-port=P` sets
        base = {"MASTER_ADDR": coordinator, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                "GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
        return [{**base, "RANK": str(r), **place[r]} for r in ranks], []
    if framework == "tensorflow":   # MultiWorkerMirroredStrategy reads the whole cluster from TF_CONFIG
        hosts = [resolve(h) for h in cluster.hosts]
        workers = [f"{hosts[r // local]}:{worker_ports[r]}" for r in range(world)]
        return [{"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}),
                 "NCCL_SOCKET_IFNAME": interface, **place[r]} for r in ranks], []
    if framework == "mxnet":   # ps-lite: a scheduler on the first host, a server on every host, the workers
        base = {"DMLC_PS_ROOT_URI": coordinator, "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": str(cluster.nnodes),
                "DMLC_NUM_WORKER": str(world), "DMLC_NODE_HOST": cluster.address(), "DMLC_INTERFACE": interface}
        roles = ["scheduler", "server"] if cluster.node_rank == 0 else ["server"]
        return [{**base, "DMLC_ROLE": "worker", **place[r]} for r in ranks], [(role, {**base, "DMLC_ROLE": role})
                                                                               for role in roles]
    if framework == "jax":   # jax.distributed: the first process serves the coordinator
        base = {"JAX_COORDINATOR_ADDRESS": f"{coordinator}:{port}", "JAX_NUM_PROCESSES": str(world),
                "GLOO_SOCKET_IFNAME": interface}   # read by jax/distributed.py: JAX itself has no such option
        return [{**base, "JAX_PROCESS_ID": str(r), **place[r]} for r in ranks], []
    raise ValueError(framework)
