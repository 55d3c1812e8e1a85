"""A file replaced whole or not at all: written under a temporary name beside its path, then renamed over it, so
that a run interrupted mid-write (Ctrl-C, a crash, SIGKILL) leaves the previous version, never half a file. The one
way the harness writes its outputs, figures and checkpoints."""
import contextlib
import glob
import os
import re
import shutil
import tempfile

from common.interface import RosettaError


@contextlib.contextmanager
def replacing(path, suffix="", what="file"):
    """A temporary path beside `path` for the block to write (a file, or a directory such as Orbax's checkpoint),
    which replaces `path` once the block ends; if it raises, the temporary goes, with anything a framework made
    beside it. The temporary's name ends in `suffix` (a framework may insist on its own) and holds this process's
    id, so that the next write into the folder removes what a writer killed mid-write left (remove_orphans)."""
    path = os.path.abspath(os.fspath(path).rstrip("/"))
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    partial = f".{name[:len(name) - len(suffix)]}.partial-"
    remove_orphans(folder, partial)
    temporary = os.path.join(folder, f"{partial}{os.getpid()}{suffix}")
    try:
        yield temporary
        if os.path.isdir(path):   # an earlier Orbax directory: os.replace cannot replace a full one
            if not os.path.isdir(temporary):
                raise RosettaError(f"{path} is a directory, not a {what}")
            shutil.rmtree(path)
        os.replace(temporary, path)
    finally:   # after a failure: the temporary, and anything the framework made beside it (Orbax's own)
        for leftover in glob.glob(glob.escape(temporary) + "*"):
            shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)


@contextlib.contextmanager
def replaced_atomically(path, mode="w", **open_args):
    """An open file that replaces `path` only once completely written (replacing). A stream (/dev/stdout, a pipe)
    is written in place: renaming over it would replace it."""
    if is_stream(path):
        with open(path, mode, **open_args) as f:
            yield f
        return
    with replacing(path) as temporary, open(temporary, mode, **open_args) as f:
        yield f


def remove_orphans(folder, partial):
    """The temporaries (`partial` + a pid + anything) that a writer killed mid-write (SIGKILL: no `finally`) left in
    `folder`: those whose process is gone. A live writer's temporary is left alone."""
    for leftover in glob.glob(os.path.join(glob.escape(folder), glob.escape(partial) + "*")):
        pid = re.match(r"\d+", os.path.basename(leftover)[len(partial):])
        if pid and not alive(int(pid.group())):
            with contextlib.suppress(FileNotFoundError):   # another writer's sweep may get there first
                shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


def is_stream(path):
    """/dev/stdout, a pipe, a device: written in place (renaming over it would replace it)."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def unwritable_directory(path):
    """Why files cannot be written in the directory `path` (made if missing, as the run would), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file, not a directory"
    return unwritable(os.path.join(path, ".rosetta-directory-check"))


def unwritable(path):
    """Why `path` cannot be written, or None. Checked before the first row: a typo in an output path
    should cost seconds, not a finished run."""
    if os.path.isdir(path):
        return "it is a directory"
    if is_stream(path):
        return None if os.access(path, os.W_OK) else "permission denied"
    directory = os.path.dirname(os.path.abspath(path))
    parent = directory
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".rosetta-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"cannot create a file in {directory}: {err.strerror}"
    return None
