"""Tests that must share one pytest-xdist worker (a session fixture made once, or something only one process may
hold at a time) are marked `xdist_group` and, under `--dist loadgroup`, named with the group after an `@`: xdist's
scheduler keeps a group's tests on one worker by that suffix.

Why the name is set here too: pytest 9.2 keeps a node's id in `Node._id` (a structured NodeId), and pytest-xdist 3.8
still writes the suffix into the old `_nodeid` attribute, which pytest no longer reads: the groups are silently lost
and each worker makes the shared fixtures itself (pytest-dev/pytest-xdist#1386). Where xdist's own renaming works,
this leaves the name as xdist made it."""
import pytest


def keep_together(config, items, group, belongs):
    """Mark every item for which belongs(item) is true as `group`'s, and give it the group's name suffix."""
    renaming = bool(getattr(config.option, "loadgroup", False))   # set on xdist's workers under --dist loadgroup
    for item in items:
        if not belongs(item):
            continue
        item.add_marker(pytest.mark.xdist_group(group))
        if renaming and not item.nodeid.endswith(f"@{group}"):
            rename(item, f"{item.nodeid}@{group}")


def rename(item, nodeid):
    if hasattr(item, "_id"):   # pytest >= 9.2
        from _pytest.nodeid import NodeId
        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid
