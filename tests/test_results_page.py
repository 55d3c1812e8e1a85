"""docs/results.md says one thing about each row: no two of its tables give one row different figures, the rows of a
table can be told apart, every table names the run it comes from, and a speed an answer states in its prose is a cell
of the page. So a run measured again cannot stand beside the one it replaces, nor a hand-copied figure beside the file.

A row is the same row in two tables when it trains the same network (the table's `model` column, or the `--model` of
the command its section's run records), accumulates as many micro-batches (1 where a table has no `accumulate` column),
computes in the same precision (fp32 where a table has no `precision` column), shards alike (none where a table has no
`shard` column) and agrees on every one of KEYS that both tables give (a split's `run` cell
gives the mode, exec, devices and processes). Its speed figures (images/s, scaling, shares of the step...) must then be
one figure wherever they appear; its accuracy and losses too, between tables of one command (other data or other
options train other weights)."""
import itertools
import os
import re

from conftest import ROOT

RESULTS_MD = os.path.join(ROOT, "docs", "results.md")
KEYS = ("framework", "BN: running states", "mode", "exec", "compiles", "layout", "all-reduce", "cores", "batch",
        "devices", "processes", "epochs")
TRAINING = ("test acc", "final loss", "|Δ step-1 loss|", "s to")   # figures that depend on the data and the options
RUN = re.compile(r"(?P<mode>\w+) \((?P<exec>[^)]*)\), (?:(?P<pattern>\S+) all-reduce, )?(?P<devices>\d+) "
                 r"device(?:s|\(s\)), (?P<processes>\d+) process")   # a split's, scaling or precision table's run
SPEED = re.compile(r"(\d[\d,]*) images/s")


def sections(text):
    """(heading, body) of every ## and ### section, the text before the first heading left out."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def tables(body):
    """Each pipe table of a section as (headings, rows of cells), `\\|` read as a `|` inside a cell."""
    found = []
    for block in re.findall(r"(?:^\|.*\n?)+", body, flags=re.M):
        lines = [line for line in block.splitlines() if not re.fullmatch(r"\|[-| ]+\|", line.strip())]
        cells = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines]
        found.append((cells[0], cells[1:]))
    return found


def command(body):
    """The `python compare.py ...` command a section's run records (its prose may wrap it over lines), or ""."""
    found = re.search(r"`python (compare\.py[^`]*)`", " ".join(body.split()))
    return found.group(1) if found else ""


def rows(text):
    """Every row of every table that has a framework column: (section, its command, key cells, figure cells)."""
    out = []
    for heading, body in sections(text):
        run = command(body)
        model = re.search(r"--model (\S+)", run)
        for headings, cells in tables(body):
            if "framework" not in headings:
                continue
            for row in cells:
                named = dict(zip(headings, row))
                keys = {k: named[k] for k in KEYS if k in named}
                keys["accumulate"] = named.get("accumulate", "1")   # compare.py shows the column only beside K > 1
                keys["precision"] = named.get("precision", "fp32")  # and this one only beside a bf16 row
                keys["shard"] = named.get("shard", "none")           # and this one only beside a sharded row
                run_cell = RUN.match(named.get("run", ""))
                if run_cell:   # the scratch step's pattern is its all-reduce column's
                    keys.update({k: v for k, v in run_cell.groupdict().items() if v is not None})
                    keys.update({"all-reduce": keys["pattern"]} if keys["mode"] == "scratch" and "pattern" in keys else {})
                keys["model"] = named["model"].split()[0] if "model" in named else model.group(1) if model else "lenet"
                figures = {h.split(" (")[0]: c for h, c in named.items()
                           if h not in KEYS + ("model", "run", "status", "accumulate", "precision", "shard")}
                out.append((heading, run, keys, figures))
    return out


def same_row(a, b):
    """Whether two rows are one: the same network, and equal on every key both tables give (the framework at least)."""
    shared = (a.keys() & b.keys()) - {"model"}
    return a["model"] == b["model"] and "framework" in shared and all(a[k] == b[k] for k in shared)


def leading_number(cell):
    found = re.match(r"-?[\d,.]+(?:e[-+]\d+)?%?", cell)
    return found.group(0) if found else cell


def contradictions(text):
    """Each pair of cells that give one row two figures, as a line naming both sections; and each pair of rows of one
    table that nothing tells apart."""
    found = []
    for (s1, run1, k1, f1), (s2, run2, k2, f2) in itertools.combinations(rows(text), 2):
        if not same_row(k1, k2):
            continue
        if s1 == s2 and k1.keys() == k2.keys():
            found.append(f"{s1}: two rows {k1} that nothing tells apart")
        for figure in f1.keys() & f2.keys():
            if figure.startswith(TRAINING) and run1 != run2:
                continue
            one, two = leading_number(f1[figure]), leading_number(f2[figure])
            if "-" not in (one, two) and one != two:
                found.append(f"{k1['framework']} {k1.get('mode', '')} {k1.get('devices', '?')} devices: {figure} {one} in "
                             f"{s1!r}, {two} in {s2!r}")
    return found


def page():
    with open(RESULTS_MD, encoding="utf-8") as f:
        return f.read()


def test_no_two_tables_give_one_row_different_figures():
    assert contradictions(page()) == []


def test_a_row_given_two_figures_is_found():
    """The check itself: a second section that gives a row of the first another speed, or a second copy of a row with
    nothing to tell them apart, is reported; other data may give the same row another accuracy."""
    first = ("### A run\n\n| framework | mode | devices | images/s (min-max) | test acc |\n|---|---|---|---|---|\n"
             "| pytorch | scratch | 2 | 3,933 (3,825-4,007) | 0.9694 |\n\nRun `python compare.py --dataset synthetic`, "
             "commit 1234567.\n\n")
    again = first.replace("### A run", "### Another run").replace("3,933 (3,825-4,007)", "5,203")
    assert contradictions(first + again.replace("--dataset synthetic", "--dataset digits")) == [
        "pytorch scratch 2 devices: images/s 3,933 in '### A run', 5,203 in '### Another run'"]
    assert contradictions(first + again.replace("5,203", "3,933").replace("0.9694", "0.97")) == [
        "pytorch scratch 2 devices: test acc 0.9694 in '### A run', 0.97 in '### Another run'"]
    assert contradictions(first + again.replace("5,203", "3,933").replace("0.9694", "0.97")
                          .replace("synthetic", "digits")) == []
    twice = first.replace("| 0.9694 |\n", "| 0.9694 |\n| pytorch | scratch | 2 | 3,931 | 0.9694 |\n")
    assert len(contradictions(twice)) == 2   # two rows alike, and their two speeds
    resnet = again.replace("--dataset synthetic", "--model resnet18 --dataset synthetic")
    assert contradictions(first + resnet) == []   # another network: another row


def test_every_table_names_the_run_it_comes_from():
    """A table of rows (a framework column) sits in a section that gives the run's command and commit."""
    for heading, body in sections(page()):
        for headings, _ in tables(body):
            if "framework" in headings:
                assert command(body) and re.search(r"commit [0-9a-f]{7}", " ".join(body.split())), heading   # wrapped anywhere


def test_a_speed_an_answer_states_is_a_cell_of_the_page():
    """Every "N images/s" in the prose (not a table) is the figure of an images/s cell of some table on the page."""
    text = page()
    cells = {leading_number(figures["images/s"]) for _, _, _, figures in rows(text) if "images/s" in figures}
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
    stated = SPEED.findall(" ".join(prose.split()))
    assert stated and set(stated) <= cells, sorted(set(stated) - cells)


def test_the_page_reads_as_a_page():
    """At most 10 columns a table and no line over 300 characters: an answer is read, not scrolled sideways."""
    text = page()
    assert all(len(line) <= 300 for line in text.splitlines())
    for heading, body in sections(text):
        assert all(len(headings) <= 10 for headings, _ in tables(body)), heading


def test_the_page_fits_its_budget():
    """At most 300 lines: each answer with the rows that check it, the rest left to its file."""
    lines = len(page().splitlines())
    assert lines <= 300, f"docs/results.md is {lines} lines; its budget is 300"
