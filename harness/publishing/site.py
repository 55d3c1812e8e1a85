"""The Rosetta stone as a static page: `python -m harness.publishing.site` writes docs/site/index.html (and
pygments.css, the highlighting's colours) and docs/rosetta.md from docs/rosetta.toml (the prose, in one place) and the
framework folders. Its Results part, and the answers of docs/results.md, come from the result files committed
under docs/results/ (harness/publishing/published.py); their plots are copied into docs/site/results/, so that
docs/site/ alone serves on a static host.

Every code block on the page is a function (or class, or assignment) taken from the source BY NAME through
`ast`, so the page cannot show code that is not the code: a name the file does not define stops the generator
with one line saying which. The code is highlighted here, at build time (Pygments), and the page needs nothing
from the network: no CDN, no web font, no script from elsewhere; it works opened from the file system.
The output holds no date or commit of its own (only those the result files record), so the committed site is
current exactly when a rebuild changes nothing (tests/test_site.py checks it).
"""
import ast
import functools
import html
import os
import re
import sys
import tomllib
from collections import namedtuple

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from common import FRAMEWORKS
from common.interface import RosettaError

from . import published
from ..loader import ROOT

SOURCE = os.path.join("docs", "rosetta.toml")
SITE = os.path.join("docs", "site")
ROSETTA = os.path.join("docs", "rosetta.md")
LABELS = {"pytorch": "PyTorch", "mxnet": "MXNet", "tensorflow": "TensorFlow", "jax": "JAX"}
STYLE = "friendly"   # a Pygments style with enough contrast on a white page

Snippet = namedtuple("Snippet", "path name line code")   # path from the repo root; line: the def's line


class SiteError(RosettaError):
    """The source asks for something the code does not have: the message is the one line the user sees."""


# ---- the code, by name ----

def branch(function, key):
    """The `if ... == "key":` statement inside a function (e.g. engine_env's branch for one framework)."""
    for node in ast.walk(function):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == key for c in node.test.comparators):
            return node
    return None


def top_level(tree, name):
    """The top-level def, class or assignment that defines `name`, or None."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


@functools.lru_cache(maxsize=None)
def parsed(path):
    """A file's text and syntax tree, read once per build however many concepts show its functions."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text, syntax_tree(text)


@functools.lru_cache(maxsize=256)
def syntax_tree(text):
    """The tree of a file's text, parsed once per text: a build in a copy of the repo (the tests make several)
    parses only the files it changed. Read, never modified."""
    return ast.parse(text)


def extract(root, framework, spec):
    """The Snippet a code entry names: "file.py:name" in the framework folder, "dir/file.py:name" from the
    repo root, "file.py:name[key]" for the `if ... == "key":` branch inside name."""
    spec = spec.replace("{fw}", framework)
    where, _, name = spec.rpartition(":")
    path = where if "/" in where else f"{framework}/{where}"
    name, _, key = name.partition("[")
    if not os.path.exists(os.path.join(root, path)):
        raise SiteError(f"{path} does not exist ({SOURCE} asks for {spec!r})")
    text, tree = parsed(os.path.join(root, path))
    node = top_level(tree, name)
    if node is None:
        raise SiteError(f"{path} has no top-level def, class or assignment named {name!r} ({SOURCE} asks for it)")
    if key:
        node = branch(node, key.rstrip("]"))
        if node is None:
            raise SiteError(f"{path}: {name} has no `if ... == {key.rstrip(']')!r}:` branch ({SOURCE} asks for it)")
        last = node.body[-1].end_lineno
    else:
        last = node.end_lineno
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines = text.splitlines()[first - 1:last]
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return Snippet(path, name, node.lineno, "\n".join(line[indent:] for line in lines) + "\n")


def code_of(concept, framework):
    """A concept's code entries for one framework: `code` is one list for all four, or a table with a list per
    framework (every framework named: an empty list says on purpose that it has nothing to show)."""
    code = concept["code"]
    if isinstance(code, list):
        return code
    if set(code) != set(FRAMEWORKS):
        raise SiteError(f"concept {concept['id']!r}: its code table names {sorted(code)}, not the four frameworks "
                        f"{list(FRAMEWORKS)} ({SOURCE})")
    return code[framework]


def check_entry(concept):
    """An entry lacking a key, or a row lacking a framework, stops the generator with one line naming it."""
    missing = [key for key in ("id", "title", "code", "note") if key not in concept]
    missing += [f"row {n}'s {key}" for n, row in enumerate(concept.get("row", []), 1)
                for key in ("label",) + FRAMEWORKS if key not in row]
    if missing:
        raise SiteError(f"concept {concept.get('id', concept.get('title'))!r} lacks {', '.join(missing)} ({SOURCE})")


def load(root=ROOT):
    """The source, with every concept's snippets: {framework: [Snippet]} under each concept's "snippets"."""
    parsed.cache_clear()   # the files may have changed since the last load in this process
    with open(os.path.join(root, SOURCE), "rb") as f:
        source = tomllib.load(f)
    for concept in source["concept"]:
        check_entry(concept)
        concept["snippets"] = {fw: [extract(root, fw, spec) for spec in code_of(concept, fw)] for fw in FRAMEWORKS}
    source.setdefault("question", [])
    source["results"] = published.read_all(root, source.get("result", []), source["question"])
    return source


# ---- docs/rosetta.md ----

def default_row(concept):
    """The table row of a concept that has no rows of its own: its title and links to its functions."""
    cells = [", ".join(f"[`{s.name}`](../{s.path}#L{s.line})" for s in concept["snippets"][fw]) or "(none)"
             for fw in FRAMEWORKS]
    title = concept["title"]
    return {"label": title[0].lower() + title[1:], **dict(zip(FRAMEWORKS, cells))}


def rosetta_md(source):
    """docs/rosetta.md: the intro, one table of every concept's rows, then the sections after it."""
    rows = [row for concept in source["concept"] for row in concept.get("row") or [default_row(concept)]]
    table = ["| concept | " + " | ".join(LABELS[fw] for fw in FRAMEWORKS) + " |", "|---" * 5 + "|"]
    table += ["| " + " | ".join(row[key].strip() for key in ("label",) + FRAMEWORKS) + " |" for row in rows]
    return (f"# {source['title']}\n\n{source['intro'].strip()}\n\n## Concept by concept\n\n" + "\n".join(table)
            + "\n\n" + source["rosetta"]["after"].strip() + "\n")


# ---- the page ----

INLINE = re.compile(r"\[((?:`[^`\n]*`|[^\[\]`\n])*)\]\(([^\s()]+)\)|`([^`]+)`|\*\*(.+?)\*\*")


def href(target):
    """A link of the source (relative to docs/) as seen from docs/site/."""
    if re.match(r"^[a-z]+:|^#", target):
        return target
    return os.path.relpath(os.path.join("docs", target), SITE).replace(os.sep, "/")


def inline(text):
    """The Markdown the prose uses, as HTML: links, `code`, **bold**; everything else escaped."""
    out, last = [], 0
    for m in INLINE.finditer(text):
        out.append(html.escape(text[last:m.start()]))
        if m.group(2):
            out.append(f'<a href="{html.escape(href(m.group(2)))}">{inline(m.group(1))}</a>')
        elif m.group(3):
            out.append(f"<code>{html.escape(m.group(3))}</code>")
        else:
            out.append(f"<strong>{inline(m.group(4))}</strong>")
        last = m.end()
    return "".join(out) + html.escape(text[last:])


def blocks(text):
    """Markdown as HTML, for docs/rosetta.md's closing sections and the published results: ## and ### headings
    (with GitHub's anchors), paragraphs, "- " lists whose items run on over indented lines, and pipe tables;
    their inline Markdown as `inline` does it."""
    out = []
    for chunk in re.split(r"\n[ \t]*\n", text.strip()):
        lines = chunk.splitlines()
        heading = re.match(r"(#{2,3}) (.*)", lines[0])
        if heading:
            lines.pop(0)
            level, title = len(heading.group(1)), heading.group(2)
            anchor = re.sub(r"[^\w -]", "", title.replace("`", "").lower()).replace(" ", "-")
            out.append(f'<h{level} id="{anchor}">{inline(title)}</h{level}>')
        if not lines:
            continue
        if lines[0].startswith("- "):
            items = re.split(r"\n- ", "\n".join(lines)[2:])
            out.append("<ul>" + "".join(f"<li>{inline(' '.join(i.split()))}</li>" for i in items) + "</ul>")
        elif lines[0].startswith("|"):
            out.append(table(lines))
        else:
            out.append(f"<p>{inline(' '.join(chunk.split()))}</p>")
    return "\n".join(out)


def table(lines):
    """A pipe table as HTML: the first row its head, the |---| line skipped, `\\|` a `|` inside a cell (as
    harness/publishing/tables.py's markdown tables escape it)."""
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines
            if not re.fullmatch(r"\|[-| ]+\|", line.strip())]
    cells = lambda row, tag: "".join(f"<{tag}>{inline(c)}</{tag}>" for c in row)  # noqa: E731
    return ('<div class="wide"><table><thead><tr>' + cells(rows[0], "th") + "</tr></thead><tbody>"
            + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows[1:]) + "</tbody></table></div>")


def column(concept, fw):
    """One framework's column of a section: its rows' cells, then its code, each block linked to its line."""
    parts = [f'<div class="fw" data-fw="{fw}">', f"<h3>{LABELS[fw]}</h3>"]
    rows = concept.get("row", [])
    if rows:
        parts.append('<ul class="cells">' + "".join(
            f'<li><span class="label">{inline(r["label"].strip())}:</span> {inline(r[fw].strip())}</li>'
            for r in rows) + "</ul>")
    for s in concept["snippets"][fw]:
        parts.append(f'<p class="where"><a href="{href(f"../{s.path}#L{s.line}")}"><code>{s.name}</code> '
                     f'{s.path}:{s.line}</a></p>')
        code = highlight(s.code, PythonLexer(), HtmlFormatter(cssclass="code"))
        parts.append(code.replace("<pre>", '<pre tabindex="0">', 1))   # the keyboard can scroll a long line
    return "\n".join(parts + ["</div>"])


def section(concept):
    return "\n".join([f'<section id="{concept["id"]}">', f'<h2><a href="#{concept["id"]}">'
                      f'{inline(concept["title"])}</a></h2>', f'<p class="note">{inline(concept["note"].strip())}</p>',
                      '<div class="cols">'] + [column(concept, fw) for fw in FRAMEWORKS] + ["</div>", "</section>"])


def controls():
    """The view switches: one tab per framework (or all four), and two selects for any two side by side."""
    tabs = "".join(f'<button type="button" class="tab" data-fw="{fw}" aria-pressed="false">{LABELS[fw]}</button>'
                   for fw in FRAMEWORKS)
    options = "".join(f'<option value="{fw}">{LABELS[fw]}</option>' for fw in FRAMEWORKS)
    return ('<nav class="controls" aria-label="Which frameworks to show">'
            f'<div class="tabs"><button type="button" class="tab" data-fw="all" aria-pressed="true">All four</button>'
            f'{tabs}</div><div class="pair"><label>Compare <select id="left">{options}</select></label> '
            f'<label>with <select id="right">{options}</select></label> '
            '<button type="button" id="compare">Side by side</button></div></nav>')


def results_section(source):
    """The questions and their published runs (harness/publishing/published.py): each question's answer, then each
    run's markdown as docs/results.md holds it, with its plot from the copy in docs/site/ (the same path relative to
    docs/site/ as the original's to docs/)."""
    parts = []
    for question, results in published.answers(source["question"], source["results"]):
        parts.append(blocks(published.question_markdown(question)))
        for result in results:
            plot = result.get("plot")
            figure = (f'<figure><a href="{html.escape(plot)}"><img src="{html.escape(plot)}" alt="'
                      f'{html.escape(published.plot_alt(result))}"></a></figure>') if plot else ""
            parts.append(f'<article class="result" id="result-{result["id"]}">\n{blocks(published.markdown(result))}'
                         f"\n{figure}</article>")
    return "\n".join(['<section class="results" aria-labelledby="results">', '<h2 id="results">Results</h2>',
                      f'<p class="note">{inline(" ".join(source["results_intro"].split()))}</p>'] + parts
                     + ["</section>"])


def index_html(source):
    toc = "".join(f'<li><a href="#{c["id"]}">{inline(c["title"])}</a></li>' for c in source["concept"]) \
        + '<li><a href="#what-a-migrating-user-must-know">What a migrating user must know</a></li>' \
        + '<li><a href="#gpus-and-processes">GPUs and processes</a></li>' \
        + '<li><a href="#results">Results</a></li>'
    body = "\n".join(section(c) for c in source["concept"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(source["title"])}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="style.css">
<link rel="stylesheet" href="pygments.css">
<script src="site.js" defer></script>
</head>
<body>
<header>
<h1>{html.escape(source["title"])}</h1>
<p>Each section is one idea of the "multi-GPU from scratch" recipe: the real functions of the four frameworks,
taken from the source by name when this page was generated (<code>python -m harness.publishing.site</code>), each linked to
its line. The same prose, as one table: <a href="../rosetta.md">docs/rosetta.md</a>. At the end,
<a href="#results">Results</a>: what the published runs answer, from their files in docs/results/.</p>
</header>
{controls()}
<main>
<nav class="toc" aria-label="Concepts"><ol>{toc}</ol></nav>
{body}
<section class="notes">
{blocks(source["rosetta"]["after"])}
</section>
{results_section(source)}
</main>
<footer><p>Generated from docs/rosetta.toml, the framework folders and docs/results/ by
<code>python -m harness.publishing.site</code>;
do not edit by hand.</p></footer>
</body>
</html>
"""


def build(root=ROOT):
    """Every file the generator writes, {path from the repo root: text, or bytes for a plot}; writes nothing. The
    page's own style.css and site.js are written by hand and live in docs/site/ as they are served; docs/results.md
    is written by hand but for its answers and their runs."""
    source = load(root)
    colours = f"/* Pygments, style {STYLE}: made by python -m harness.publishing.site */\n" + \
        HtmlFormatter(style=STYLE).get_style_defs(".code") + "\n"
    with open(os.path.join(root, published.RESULTS_MD), encoding="utf-8") as f:
        results_md = published.results_md(f.read(), source["results_intro"], source["question"], source["results"])
    files = {os.path.join(SITE, "index.html"): index_html(source), os.path.join(SITE, "pygments.css"): colours,
             ROSETTA: rosetta_md(source), published.RESULTS_MD: results_md}
    for result in source["results"]:
        if "plot" in result:
            with open(os.path.join(root, "docs", result["plot"]), "rb") as f:
                files[os.path.join(SITE, result["plot"])] = f.read()
    return files


def main(argv=None, root=ROOT):
    try:
        files = build(root)
    except RosettaError as error:
        print(f"harness.publishing.site: {error}", file=sys.stderr)
        return 1
    for path, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        binary = isinstance(content, bytes)
        with open(os.path.join(root, path), "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            f.write(content)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
