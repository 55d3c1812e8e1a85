"""A run started by SLURM: `srun python -m harness.run.worker SPEC out-{rank}.json` starts one task per process, and
each task maps the job (SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, SLURM_LOCALID, the node list) to the variables its
framework's own launcher would have set, through harness/processes/cluster.py like compare.py's own launches.

Why here: of the four engines only JAX reads a SLURM job by itself; TensorFlow has SlurmClusterResolver but only when
passed in, and torchrun and MXNet's launch.py not at all (users take MASTER_ADDR from `scontrol show hostnames`).
MXNet also needs its scheduler and servers: the first task on each node starts that node's server, and task 0 the
scheduler, as children that end with it. An example batch script is in docs/usage.md ("On a SLURM cluster").
"""
import os
import re

from common.interface import RosettaError

from .cluster import Cluster, engine_env

JOB = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_LOCALID")
NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")   # the step's first: srun -N may use fewer
TASK_COUNTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
# Any of these means a launcher inside the job (torchrun, a hand-written script) already said who the process is.
OWN_VARIABLES = ("RANK", "TF_CONFIG", "DMLC_ROLE", "JAX_PROCESS_ID")
PORT_BASE, PORT_SPAN = 20000, 20000   # the coordinator's port, from the job id: two jobs on one node do not clash


def started_by_srun(environ=os.environ):
    """A task of a SLURM job step that nothing else has placed (compare.py's workers carry its PARENT variable)."""
    from .launch import PARENT_VARIABLE
    return (all(v in environ for v in JOB) and PARENT_VARIABLE not in environ
            and not any(v in environ for v in OWN_VARIABLES))


def expand_nodelist(text):
    """SLURM's host list syntax, as `scontrol show hostnames` expands it: 'node[01-04,07],gpu5' -> node01, node02,
    node03, node04, node07, gpu5; several bracket groups in a name multiply out; zero padding is kept."""
    names = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        match = re.search(r"\[([^\]]*)\]", item)
        if not match:
            names.append(item)
            continue
        head, tail = item[:match.start()], item[match.end():]
        for part in match.group(1).split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise RosettaError(f"cannot read the SLURM node list {text!r} (at {part!r})")
            for n in range(int(low), int(high or low) + 1):
                names.extend(expand_nodelist(f"{head}{n:0{len(low)}d}{tail}"))
    if not names:
        raise RosettaError(f"the SLURM node list {text!r} names no node")
    return names


def expand_counts(text):
    """SLURM's tasks per node, '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise RosettaError(f"cannot read SLURM's tasks per node {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first(environ, names):
    for name in names:
        if environ.get(name):
            return environ[name]
    raise RosettaError(f"a SLURM task without {' or '.join(names)}")


def job(environ=os.environ):
    """(Cluster, this task's rank, the number of tasks) of the job step this task belongs to."""
    try:
        rank, world, node, local = (int(environ[v]) for v in JOB)
    except ValueError:
        raise RosettaError(f"SLURM's {', '.join(JOB)} must be integers") from None
    hosts = expand_nodelist(first(environ, NODE_LISTS))
    counts = expand_counts(first(environ, TASK_COUNTS))
    if len(counts) != len(hosts) or len(set(counts)) != 1 or sum(counts) != world:
        raise RosettaError(f"the job step runs {', '.join(map(str, counts))} task(s) on its {len(hosts)} node(s) "
                           f"({world} in all): give every node the same number (srun --ntasks-per-node)")
    if rank != node * counts[0] + local:
        raise RosettaError(f"task {rank} is local task {local} of node {node}: SLURM placed the tasks out of block "
                           "order (use srun --distribution=block)")
    port = int(environ.get("MASTER_PORT") or PORT_BASE + int(environ.get("SLURM_JOB_ID", 0)) % PORT_SPAN)
    return Cluster(tuple(hosts), node, port), rank, world


def task_env(spec, environ=os.environ):
    """(this task's engine variables, [(role, environment)] of the helper processes it must start): those of its
    node that its local slot is responsible for (MXNet's scheduler and server: local task 0)."""
    cluster, rank, world = job(environ)
    if world != spec.processes:
        raise RosettaError(f"the SLURM job step has {world} tasks but the run asks for {spec.processes} processes")
    workers, helpers = engine_env(spec.framework, world, spec.devices, cluster=cluster)
    local = rank - cluster.ranks(world)[0]
    return workers[local], (helpers if local == 0 else [])
