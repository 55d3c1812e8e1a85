"""Keeps the links of the README and of every page in docs/ pointing where they say.

    python docs/links.py          checks: lists every broken link, exits 1 if any (the test suite runs it)
    python docs/links.py --fix    re-points every code link at its line, then checks (--write says the same;
                                  --check is accepted and only checks, as the default does)

The pages are the README, docs/*.md and docs/rosetta.toml (docs/rosetta.md's source: after --fix there, run
`python -m harness.publishing.site` to regenerate the page).

A link [`code`](../pytorch/data_parallel.py#L12) promises that line 12 of that file is a line of code
holding `code`: not a docstring, a comment, a blank line or an import (continuation lines included), and
not `code` only in the line's trailing comment. Of the lines that qualify, it must be the one --fix picks:
the `def`/`class` line that defines the name, else an assignment that defines it, else the first line
using it as code, else (when the text only ever appears inside a string literal, e.g. a config key) the
first line holding it in a string. So a link cannot drift onto another use when the code moves under it.
Text that no line of code holds (only docstrings, comments or imports do) is reported: change the link
text to what the code line says.
A link whose text is not `code` in backticks may point at a .py file (checked: the file exists) or at a
line of it (checked: the line exists). A link to a .md file with an #anchor must match a heading of that
file, slugged as GitHub does. Any relative link must reach a file that exists; http(s) links are not
followed. Links in fenced code blocks and inline code are not links and are skipped.
"""
import ast
import glob
import io
import os
import re
import sys
import tokenize
import unicodedata
from collections import namedtuple
from urllib.parse import unquote

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)

# [text](target) or [text](target "title"); the text may hold code spans with brackets, [`a[0]`](x.py#L3)
LINK = re.compile(r"\[((?:`[^`\n]*`|[^\[\]`\n])*)\]\(\s*<?([^\s()<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_TEXT = re.compile(r"`([^`]+)`")
LINE_ANCHOR = re.compile(r"L(\d+)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")   # http:, https:, mailto:
NAME = re.compile(r"(?:async\s+def\s+|def\s+|class\s+)?([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)")

Link = namedtuple("Link", "text code target start end")   # code: the backticked text, or None


def pages(root=ROOT):
    """The README, every page in docs/, and docs/rosetta.toml: the prose docs/rosetta.md is generated from, so
    --fix re-points the links there (then `python -m harness.publishing.site` regenerates the page)."""
    found = [os.path.join(root, "README.md")] if os.path.exists(os.path.join(root, "README.md")) else []
    source = os.path.join(root, "docs", "rosetta.toml")
    return found + sorted(glob.glob(os.path.join(root, "docs", "*.md"))) + [source] * os.path.exists(source)


PAGES = pages()


# ---- Markdown: links, code spans, headings ----

def mask_fences(text):
    """The text with fenced code blocks blanked (same length, newlines kept)."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            out.append(re.sub(r"[^\n]", " ", line))
        elif fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence) \
                    and not line.strip().strip(fence[0]):
                fence = None
            out.append(re.sub(r"[^\n]", " ", line))
        else:
            out.append(line)
    return "".join(out)


def code_spans(text):
    """(start, end) of every inline code span: a run of backticks closed by the next run as long, within
    a paragraph."""
    spans, runs = [], [(m.start(), m.end()) for m in re.finditer(r"`+", text)]
    i = 0
    while i < len(runs):
        start, end = runs[i]
        for j in range(i + 1, len(runs)):
            if runs[j][1] - runs[j][0] == end - start:
                if not re.search(r"\n[ \t]*\n", text[end:runs[j][0]]):
                    spans.append((start, runs[j][1]))
                    i = j
                break
        i += 1
    return spans


def find_links(text):
    """Every link of a Markdown text, outside fenced blocks and inline code."""
    masked = mask_fences(text)
    spans = code_spans(masked)
    found = []
    for m in LINK.finditer(masked):
        if any(a < m.start() < b for a, b in spans):
            continue
        code = CODE_TEXT.fullmatch(m.group(1))
        found.append(Link(m.group(1), code.group(1) if code else None, m.group(2), m.start(), m.end()))
    return found


def slug(heading):
    """GitHub's anchor for a heading: its rendered text, lowercased, punctuation other than hyphens and
    underscores removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor of a Markdown file: its headings' slugs (repeats get -1, -2, ...) and explicit ids."""
    with open(path, encoding="utf-8") as f:
        text = mask_fences(f.read())
    seen, found = {}, set()
    for heading in re.findall(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t#]*$", text, re.M):
        base = slug(heading)
        name = base if base not in seen else f"{base}-{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
        found.add(name)
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


# ---- Python: which lines are code, and where a text is code ----

class Source:
    """One Python file: its lines, which are code, and where strings and comments lie in them."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.text = f.read()
        self.lines = self.text.splitlines()
        tree = ast.parse(self.text)
        self.kind = {}                      # line -> "docstring" or "import"; other lines are sorted below
        self.defs, self.assigns = {}, {}    # line -> the name a def/class or an assignment defines
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.mark(node, "import")
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                self.mark(node, "docstring")     # a docstring, or a string statement that does nothing
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs.setdefault(node.lineno, set()).add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for t in ast.walk(target):
                        if isinstance(t, (ast.Name, ast.Attribute)):
                            self.assigns.setdefault(node.lineno, set()).add(ast.unparse(t))
        self.strings, self.comments, significant = {}, {}, set()
        for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
            kind = tokenize.tok_name[tok.type]
            (r1, c1), (r2, c2) = tok.start, tok.end
            if kind == "COMMENT":
                self.comments.setdefault(r1, []).append((c1, c2))
            elif kind in ("STRING", "FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END"):
                for r in range(r1, r2 + 1):
                    self.strings.setdefault(r, []).append((c1 if r == r1 else 0,
                                                           c2 if r == r2 else len(self.lines[r - 1])))
            if kind not in ("COMMENT", "NL", "NEWLINE", "INDENT", "DEDENT", "ENCODING", "ENDMARKER"):
                significant.update(range(r1, r2 + 1))
        for n, line in enumerate(self.lines, 1):
            if n not in self.kind:
                self.kind[n] = "blank" if not line.strip() else "code" if n in significant else "comment"

    def mark(self, node, kind):
        """Marks a statement's lines; its first line stays code if code precedes it (def f(): "doc")."""
        first = node.lineno + bool(self.lines[node.lineno - 1][:node.col_offset].strip())
        for n in range(first, node.end_lineno + 1):
            self.kind[n] = kind

    def holds(self, n, text):
        """How line n holds text: "code", "string" (only inside string literals), or None (not at all, only
        in its comment, or the line is not code)."""
        if self.kind.get(n) != "code":
            return None
        line, best = self.lines[n - 1], None
        start = line.find(text)
        while start >= 0:
            end = start + len(text)
            inside = lambda spans: any(a <= start and end <= b for a, b in spans.get(n, ()))
            if inside(self.comments):
                pass
            elif inside(self.strings):
                best = best or "string"
            else:
                return "code"
            start = line.find(text, start + 1)
        return best

    def best_line(self, text):
        """The line a link for `text` belongs on, and why; (None, None) if no line of code holds it."""
        name = NAME.match(text).group(1) if NAME.match(text) else None
        holding = {n: self.holds(n, text) for n in range(1, len(self.lines) + 1)}
        as_code = [n for n, how in holding.items() if how == "code"]
        for reason, lines in (
                (f"the def/class of `{name}`", [n for n in as_code if name in self.defs.get(n, ())]),
                (f"the assignment of `{name}`", [n for n in as_code if name in self.assigns.get(n, ())]),
                (f"the first line of code using `{text}`", as_code),
                (f"the first line of code holding `{text}` in a string",
                 [n for n, how in holding.items() if how == "string"])):
            if lines:
                return lines[0], reason
        return None, None

    def mentions(self, text):
        """Where the text appears outside code: {"docstring": [lines], "comment": [...], "import": [...]}."""
        found = {}
        for n, line in enumerate(self.lines, 1):
            if text in line:
                kind = self.kind[n] if self.kind[n] != "code" else "comment"   # a trailing comment
                found.setdefault(kind, []).append(n)
        return found


# ---- checking and fixing a page ----

def rel(path):
    return os.path.relpath(path, ROOT)


def resolve(page, target):
    """(file path, anchor) a relative target names; file is None for an external link, the page itself for
    a bare #anchor."""
    if EXTERNAL.match(target):
        return None, None
    path, _, anchor = target.partition("#")
    path = unquote(path)
    base = ROOT if path.startswith("/") else os.path.dirname(page)
    return (os.path.normpath(os.path.join(base, path.lstrip("/"))) if path else page), anchor


def check(page, link, sources):
    """The problem with one link of a page, or None; with the line --fix would use for a code link."""
    where = f"{rel(page)}: {link.target}"
    path, anchor = resolve(page, link.target)
    if path is None:
        return None, None
    if not os.path.exists(path):
        return f"{where} does not hold anything: there is no {rel(path)}", None
    if path.endswith(".md") and anchor:
        if anchor not in anchors(path):
            return f"{where} does not hold a heading whose anchor is #{anchor}", None
        return None, None
    if not path.endswith(".py") or not anchor:
        return (f"{where} does not hold an anchor #{anchor}" if anchor else None), None
    line = LINE_ANCHOR.fullmatch(anchor)
    if not line:
        return f"{where} does not hold an anchor #{anchor}: a .py link takes #L<line>", None
    n = int(line.group(1))
    if path not in sources:
        try:
            sources[path] = Source(path)
        except (SyntaxError, tokenize.TokenError, UnicodeDecodeError) as error:
            sources[path] = error
    source = sources[path]
    if isinstance(source, Exception):
        return f"{where} does not hold code that parses: {type(source).__name__}: {source}", None
    if not 1 <= n <= len(source.lines) and link.code is None:
        return f"{where} does not hold line {n}: {rel(path)} has {len(source.lines)} lines", None
    if link.code is None:
        return None, None
    best, reason = source.best_line(link.code)
    if best is None:
        seen = "; ".join(f"{kind} line{'s' * (len(ns) > 1)} {', '.join(map(str, ns))}"
                         for kind, ns in source.mentions(link.code).items()) or "nowhere"
        return (f"{where} does not hold `{link.code}` as code, and no line of code in {rel(path)} does "
                f"({seen}): point the link at the code line that uses it, with that line's text"), None
    if n == best:
        return None, best
    if 1 <= n <= len(source.lines) and source.kind[n] != "code":
        what = f"line {n} is {'an' if source.kind[n] == 'import' else 'a'} {source.kind[n]} line"
    elif 1 <= n <= len(source.lines) and source.holds(n, link.code):
        what = f"line {n} holds it, but is not its line"
    elif 1 <= n <= len(source.lines):
        what = f"line {n} does not hold it, or only in a comment"
    else:
        what = f"{rel(path)} has {len(source.lines)} lines"
    return f"{where} does not hold `{link.code}`: {what}; {reason} is line {best} (run `python docs/links.py --fix`)", best


def problems(page, sources=None):
    """Every broken link of a page, one line each: "page: target does not hold ..."."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    sources = {} if sources is None else sources
    return [p for p in (check(page, link, sources)[0] for link in find_links(text)) if p]


def fix(page, sources=None):
    """Re-points every code link of a page at its line; returns [(target, new target)] it changed."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    sources = {} if sources is None else sources
    changed, out, last = [], [], 0
    for link in find_links(text):
        _, best = check(page, link, sources)
        if best is None:
            continue
        new = re.sub(r"#L\d+$", f"#L{best}", link.target)
        if new != link.target:
            changed.append((link.target, new))
            out.append(text[last:link.start] + f"[{link.text}]({new})")
            last = link.end
    if changed:
        with open(page, "w", encoding="utf-8") as f:
            f.write("".join(out) + text[last:])
    return changed


def main(argv, pages=None):
    pages = PAGES if pages is None else pages
    writing = "--fix" in argv or "--write" in argv
    unknown = [a for a in argv if a not in ("--fix", "--write", "--check")]
    if unknown or (writing and "--check" in argv):
        print("usage: python docs/links.py [--fix | --write | --check]: checks by default, rewrites with --fix",
              file=sys.stderr)
        return 2
    sources = {}
    if writing:
        for page in pages:
            for old, new in fix(page, sources):
                print(f"{rel(page)}: {old} -> {new}")
    checked, at_code, broken = 0, 0, []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            found = [link for link in find_links(f.read()) if not EXTERNAL.match(link.target)]
        checked += len(found)
        at_code += sum(link.code is not None and bool(re.search(r"\.py#L\d+$", link.target)) for link in found)
        broken += problems(page, sources)
    print("\n".join(broken) or f"all {checked} links point at their code ({at_code} at lines of code, "
                                f"{checked - at_code} at files and headings) in {len(pages)} pages")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
