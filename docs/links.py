"""Keeps the links of the Rosetta page and the migration page on the right lines.

A link [`code`](../pytorch/data_parallel.py#L12) promises that line 12 of that file holds `code`.
`python docs/links.py` re-points every link at the first line holding its code (a `def` or `class`
line first); `python docs/links.py --check` only lists broken links (the test suite runs the check).
"""
import os
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
PAGES = [os.path.join(DOCS, "rosetta.md"), os.path.join(DOCS, "migration.md")]
LINK = re.compile(r"\[`([^`]+)`\]\(\.\./([\w/.-]+\.py)#L(\d+)\)")


def find_line(path, code):
    with open(path) as f:
        lines = f.read().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if code in line]
    defs = [i for i in hits if re.match(r"\s*(def|class) ", lines[i - 1])]
    return (defs or hits or [None])[0], lines


def problems(page):
    with open(page) as f:
        text = f.read()
    found = []
    for code, rel, line in LINK.findall(text):
        path = os.path.join(DOCS, "..", rel)
        if not os.path.exists(path):
            found.append(f"{rel}: no such file (link for `{code}`)")
            continue
        _, lines = find_line(path, code)
        if not (1 <= int(line) <= len(lines)) or code not in lines[int(line) - 1]:
            found.append(f"{rel}#L{line} does not hold `{code}`")
    return found


def update(page):
    with open(page) as f:
        text = f.read()

    def repoint(match):
        code, rel, line = match.groups()
        path = os.path.join(DOCS, "..", rel)
        best, _ = find_line(path, code) if os.path.exists(path) else (None, None)
        return f"[`{code}`](../{rel}#L{best or line})"
    with open(page, "w") as f:
        f.write(LINK.sub(repoint, text))


if __name__ == "__main__":
    if "--check" not in sys.argv:
        for page in PAGES:
            update(page)
    broken = [p for page in PAGES for p in problems(page)]
    print("\n".join(broken) or "all links point at their code")
    sys.exit(1 if broken else 0)
