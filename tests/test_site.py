"""The generated Rosetta site (python -m harness.publishing.site): its code is the code, it is current, and it works in a
real browser (headless Chromium from the distribution, driven by Selenium) opened from the file system.

The browser tests skip, saying so, where Chromium or its driver is missing; under .ci/run
(ROSETTA_REQUIRE_ALL_FRAMEWORKS=1) they fail instead. They load a static page and start no worker process, so
they are in the fast tier. The screenshots go to SHOTS (printed by the test) for a person to look at."""
import ast
import html
import json
import re
import importlib.util
import os
import shutil
import tempfile
from html.parser import HTMLParser

import pytest

from common import FRAMEWORKS
from conftest import REQUIRE_ALL, ROOT
from harness.publishing import published, site
from harness.publishing.tables import TIMING_COLUMNS

SHOTS = os.environ.get("ROSETTA_SCREENSHOTS", os.path.join(tempfile.gettempdir(), "rosetta-site-screenshots"))


@pytest.fixture(scope="module")
def source():
    return site.load()


def test_the_committed_site_and_rosetta_page_are_what_the_generator_makes_now(source):
    """Every file the generator writes, byte for byte: the page, docs/rosetta.md, docs/results.md's published
    runs and the plots copied into docs/site/."""
    files = site.build()
    assert {published.RESULTS_MD} | {os.path.join(site.SITE, r["plot"]) for r in source["results"] if "plot" in r} \
        <= set(files)
    for path, content in files.items():
        with open(os.path.join(ROOT, path), "rb") as f:
            on_disk = f.read()
        assert on_disk == (content if isinstance(content, bytes) else content.encode("utf-8")), \
            f"{path} is stale: run `python -m harness.publishing.site` and commit the result"


def test_every_concept_shows_each_frameworks_real_function(source):
    """Each snippet is the source of the def/class/assignment its file has under that name, compared through
    ast with the file itself (a branch snippet: the `if` statement of the function that holds it)."""
    assert len(source["concept"]) >= 16
    for concept in source["concept"]:
        assert any(concept["snippets"].values()), f"{concept['id']} shows no code at all"
        for fw in FRAMEWORKS:
            snippets = concept["snippets"][fw]
            assert len(snippets) == len(site.code_of(concept, fw)), (concept["id"], fw)
            for snippet in snippets:
                with open(os.path.join(ROOT, snippet.path), encoding="utf-8") as f:
                    text = f.read()
                nodes = [n for n in ast.walk(ast.parse(text)) if getattr(n, "lineno", None) == snippet.line
                         and isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.If))]
                assert nodes, (concept["id"], fw, snippet.path, snippet.line)
                shown = ast.parse(snippet.code).body
                assert len(shown) == 1 and ast.dump(shown[0]) == ast.dump(nodes[0]), (concept["id"], fw, snippet.name)
                names = {getattr(nodes[0], "name", None)} | {t.id for t in getattr(nodes[0], "targets", [])}
                assert isinstance(nodes[0], ast.If) or snippet.name in names, snippet


def test_the_page_holds_every_snippet_and_every_link_reaches_a_file(source):
    page = site.index_html(source)
    # Nothing loads from elsewhere: no script, style, image or font from another host (a plain link a reader may
    # follow, to PyTorch's documentation say, loads nothing; the browser tests also watch every request).
    loads = re.findall(r'<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)="(https?:)?//', page) + \
        re.findall(r"url\(\s*['\"]?(?:https?:)?//", page) + re.findall(r"@import", page)
    assert not loads, "the page must load nothing from elsewhere"
    for anchor in ("what-a-migrating-user-must-know", "gpus-and-processes"):   # rosetta.md's closing sections
        assert f'<h2 id="{anchor}">' in page and f'href="#{anchor}"' in page
    for concept in source["concept"]:
        assert f'<section id="{concept["id"]}">' in page
        for fw in FRAMEWORKS:
            for snippet in concept["snippets"][fw]:
                assert f'href="../../{snippet.path}#L{snippet.line}"' in page, snippet

    class Links(HTMLParser):
        found = []

        def handle_starttag(self, tag, attrs):
            self.found += [v for k, v in attrs if k in ("href", "src")]
    parser = Links()
    parser.feed(page)
    for target in parser.found:
        path = target.partition("#")[0]
        if path and not path.startswith(("data:", "https://")):   # data: the empty icon that saves a request for
            # favicon.ico; https: a reference a reader may follow (the documentation PyTorch's advice is quoted from)
            assert os.path.exists(os.path.join(ROOT, site.SITE, path)), target


def copy_of_the_repo(tmp_path):
    """The repo's sources in tmp_path/repo (no site, no venv), and its docs/rosetta.toml."""
    shutil.copytree(ROOT, tmp_path / "repo", ignore=shutil.ignore_patterns(".venv", ".git", "site", "__pycache__"))
    return str(tmp_path / "repo"), tmp_path / "repo" / "docs" / "rosetta.toml"


NEW_CONCEPT = """
[[concept]]
id = "primitives"
title = "nn.DataParallel's primitives"
code = {pytorch = ["builtin.py:get_model"], mxnet = [], tensorflow = [], jax = ["data_parallel.py:split_and_load"]}
note = "A concept some frameworks have nothing for."
"""


def test_adding_a_concept_is_adding_one_entry(tmp_path, capsys):
    """One [[concept]] entry, its code a table per framework (two with nothing to show), makes a section on the
    page and a row of docs/rosetta.md; an entry without its note, or a table that leaves a framework out, stops
    the generator with one line."""
    root, toml = copy_of_the_repo(tmp_path)
    toml.write_text(toml.read_text() + NEW_CONCEPT)
    files = site.build(root)
    page, rosetta = files[os.path.join(site.SITE, "index.html")], files[site.ROSETTA]
    assert '<section id="primitives">' in page and 'href="../../pytorch/builtin.py#L' in page.split("primitives")[-1]
    assert "| nn.DataParallel's primitives | [`get_model`](../pytorch/builtin.py#L" in rosetta
    assert "| (none) | (none) | [`split_and_load`](../jax/data_parallel.py#L" in rosetta
    toml.write_text(toml.read_text().replace('note = "A concept some', 'notes = "A concept some'))
    assert site.main([], root=root) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "harness.publishing.site: concept 'primitives' lacks note (docs/rosetta.toml)"]
    toml.write_text(toml.read_text().replace('notes = "A concept some', 'note = "A concept some')
                    .replace(", jax = [\"data_parallel.py:split_and_load\"]}", "}"))
    assert site.main([], root=root) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "harness.publishing.site: concept 'primitives': its code table names ['mxnet', 'pytorch', 'tensorflow'], not the four "
        "frameworks ['pytorch', 'mxnet', 'tensorflow', 'jax'] (docs/rosetta.toml)"]


def test_a_missing_function_name_stops_the_generator_with_one_clear_line(tmp_path, capsys):
    root, toml = copy_of_the_repo(tmp_path)
    toml.write_text(toml.read_text().replace('"data_parallel.py:allreduce"', '"data_parallel.py:allreduce_nowhere"'))
    assert site.main([], root=root) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "harness.publishing.site: pytorch/data_parallel.py has no top-level def, class or assignment named 'allreduce_nowhere' "
        "(docs/rosetta.toml asks for it)"], err
    assert not (tmp_path / "repo" / "docs" / "site").exists(), "nothing is written when a name is missing"


# ---- the published results ----

def result_file(result):
    with open(os.path.join(ROOT, "docs", result["file"]), encoding="utf-8") as f:
        return json.load(f)


def shown_runs(result):
    """The file's rows an entry shows, selected here as docs/rosetta.toml's comment says (not through
    harness/publishing/published.py): those matching one of its `rows`, none of its `hide`, for the split those
    that have one, and for the precision table the low-precision rows that trained (each beside its fp32 row)."""
    def matches(run, where):
        return all(run.get(k) in (v if isinstance(v, list) else [v]) for k, v in where.items())
    runs = [r for r in result_file(result)["runs"] if any(matches(r, w) for w in result.get("rows", [{}]))
            and not any(matches(r, w) for w in result.get("hide", []))]
    if result.get("table") == "precision":
        return [r for r in runs if r.get("precision", "fp32") != "fp32" and r["status"] == "ok"]
    return [r for r in runs if r.get("step_split")] if result.get("table") == "split" else runs


def page_table(page, result_id):
    """The table of one result's article on the page: its rows of cell texts, the head first."""
    article = page.split(f'<article class="result" id="result-{result_id}">', 1)[1].split("</article>", 1)[0]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", article.split("<table>", 1)[1].split("</table>", 1)[0])]


def markdown_section(text, title):
    """The part of docs/results.md from `### title` to the next heading."""
    return re.split(r"\n#{2,3} ", text.split(f"### {title}\n", 1)[1], maxsplit=1)[0].split(published.END, 1)[0]


def markdown_table(text, title):
    """The first pipe table after `### title` in docs/results.md: its rows of cell texts, the head first."""
    table = next(chunk.strip() for chunk in markdown_section(text, title).split("\n\n") if chunk.strip().startswith("|"))
    return [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            for line in table.splitlines() if not re.fullmatch(r"\|[-|]+\|", line.strip())]


def test_the_results_part_answers_each_question_with_its_runs_and_the_commit_and_date_of_their_files(source):
    """Each question's answer, then each run that answers it: its command (less where its outputs went), commit,
    date, CPU and load from its file, its files linked, and on the page its plot."""
    assert source["results"] and source["question"], "docs/rosetta.toml asks questions and publishes runs"
    page = site.index_html(source)
    with open(os.path.join(ROOT, published.RESULTS_MD), encoding="utf-8") as f:
        results_md = f.read()
    assert '<h2 id="results">Results</h2>' in page and '<a href="#results">Results</a>' in page
    asked = {q["id"]: q for q in source["question"]}
    for result in source["results"]:
        env = result_file(result)["environment"]
        question = asked[result["question"]]
        before = results_md.split(f"### {result['title']}\n", 1)[0]
        assert before.rsplit("\n## ", 1)[1].startswith(question["title"] + "\n"), (result["id"], "under its question")
        article = page.split(f'<article class="result" id="result-{result["id"]}">', 1)[1].split("</article>", 1)[0]
        assert html.escape(question["title"]) in page.split(f'id="result-{result["id"]}"', 1)[0].rsplit("<h2", 1)[1]
        command = re.sub(r" --(json|csv|plot) \S+", "", env["command"])
        for shown in (" ".join(article.split()), " ".join(markdown_section(results_md, result["title"]).split())):
            assert f"commit {env['commit']}" in shown and env["date"] in shown, result["id"]
            assert f"{env['cpu']} ({env['cpu_count']} cores), load average {env['load_average']:.2f}" in shown
            assert html.escape(f"python {command}") in shown or f"python {command}" in shown
            assert all(result[key] in shown for key in ("file", "csv", "plot") if key in result), result["id"]
        assert html.escape(result["title"]) in article
        if "plot" in result:
            assert f'<img src="{result["plot"]}"' in article


def test_a_row_on_the_page_holds_the_files_figures_and_results_md_the_same(source):
    """Read from the JSON here, not through harness/publishing/tables.py: a cell the generator renders wrong, or a
    row it shows that the entry did not select, fails."""
    page = site.index_html(source)
    with open(os.path.join(ROOT, published.RESULTS_MD), encoding="utf-8") as f:
        results_md = f.read()
    expected = {"framework": lambda r: r["framework"], "mode": lambda r: r["mode"], "devices": lambda r: str(r["devices"]),
                "test acc": lambda r: f"{r['test_accuracy']:.4f}",
                "images/s": lambda r: f"{r['images_per_second']:,.0f}",
                "final loss": lambda r: f"{r['epoch_losses'][-1]:.4f}",
                "|Δ step-1 loss|": lambda r: f"{r['step1_loss_diff']:.1e}",
                "scaling": lambda r: f"{r['scaling_efficiency']:.2f}"}
    for result in source["results"]:
        runs = shown_runs(result)
        table = page_table(page, result["id"])
        assert table == markdown_table(results_md, result["title"]), result["id"]
        head, rows = [h.split(" (")[0] for h in table[0]], table[1:]
        assert len(rows) == len(runs) and len(head) <= 10, result["id"]
        assert head == [h.split(" (")[0] for h in result["columns"]] if "columns" in result else True, result["id"]
        checked = [column for column in expected if column in head]
        assert "framework" in checked and len(checked) >= 2, head
        for row, run in zip(rows, runs):
            if run["status"] == "ok":
                assert {c: row[head.index(c)].split(" (")[0] for c in checked} == \
                    {c: expected[c](run) for c in checked}, result["id"]


def test_a_published_split_shows_where_each_step_of_several_devices_goes(source):
    """The split (harness/studies/split.py) of every row a `table = "split"` entry shows, in results.md from the
    file's own figures."""
    with open(os.path.join(ROOT, published.RESULTS_MD), encoding="utf-8") as f:
        results_md = f.read()
    splits = [result for result in source["results"] if result.get("table") == "split"]
    assert splits, "a published run shows where the steps of several devices go"
    for result in splits:
        section = markdown_section(results_md, result["title"])
        for r in shown_runs(result):
            s = r["step_split"]
            assert (f"| {1e3 * s['allreduce']:.1f} ({s['allreduce'] / s['step']:.0%}) ") in section, result["id"]
            assert (f"| {1e3 * s['lockstep']:.1f} ({s['lockstep'] / s['step']:.0%}) ") in section, result["id"]


def published_copy(tmp_path):
    """A copy of the repo (copy_of_the_repo) and its first published result's entry."""
    root, toml = copy_of_the_repo(tmp_path)
    return root, toml, site.load(root)["results"][0]


def test_a_published_run_is_its_files_and_one_entry(tmp_path):
    """A benchmark's JSON and plot under docs/results/ and one [[result]] entry are all it takes: the page shows
    it under the question it answers, in the timing view (the table compare.py --benchmark prints), says when its
    tree differed from its commit, and the plot is copied into the site."""
    root, toml, first = published_copy(tmp_path)
    content = result_file(first)
    content["settings"]["benchmark"] = True
    content["environment"]["tree_modified"] = True   # said: a run from a tree that differed from its commit
    with open(os.path.join(root, "docs", "results", "another-benchmark.json"), "w") as f:
        json.dump(content, f)
    shutil.copy(os.path.join(root, "docs", first["plot"]), os.path.join(root, "docs", "results", "another-benchmark.png"))
    toml.write_text(toml.read_text() + '\n[[result]]\nid = "another-benchmark"\ntitle = "Another timing benchmark"\n'
                    f'question = "{first["question"]}"\n'
                    'file = "results/another-benchmark.json"\nplot = "results/another-benchmark.png"\nnote = "Quiet."\n')
    assert site.main([], root=root) == 0
    page = (tmp_path / "repo" / "docs" / "site" / "index.html").read_text()
    head = [c for c in page_table(page, "another-benchmark")[0] if c != "all-reduce"]   # only with a bucketed row
    assert head[:9] == list(TIMING_COLUMNS[:9])
    assert f"commit {content['environment']['commit']} with local changes, " in page.split('id="result-another-benchmark"')[1]
    assert (tmp_path / "repo" / "docs" / "site" / "results" / "another-benchmark.png").read_bytes() == \
        (tmp_path / "repo" / "docs" / "results" / "another-benchmark.png").read_bytes()
    results_md = (tmp_path / "repo" / "docs" / "results.md").read_text()
    assert "### Another timing benchmark" in results_md
    assert markdown_section(results_md, first["title"]).count("\n|") < results_md.count("\n|")


def test_an_entry_shows_the_columns_and_rows_it_names_and_refuses_what_its_file_has_not(tmp_path, capsys):
    """`columns` and `rows` choose what an answer's table shows; a column the table has not, rows that select none,
    or a question no [[question]] asks stop the generator with one line."""
    root, toml, first = published_copy(tmp_path)
    name = first["id"]
    start = toml.read_text().index(f'[[result]]\nid = "{name}"\n')
    end = toml.read_text().find("\n[[", start + 1)
    entry = toml.read_text()[start:end if end > 0 else None]
    chosen = re.sub(r"^(columns|rows|hide) = .*\n(?:[ \t]+.*\n)*", "", entry, flags=re.M).replace(
        "\nnote = ", '\ncolumns = ["framework", "devices", "test acc"]\nrows = [{framework = "jax"}]\nnote = ', 1)
    text = toml.read_text().replace(entry, chosen)
    toml.write_text(text)
    assert site.main([], root=root) == 0
    page = (tmp_path / "repo" / "docs" / "site" / "index.html").read_text()
    jax = [r for r in result_file(first)["runs"] if r["framework"] == "jax"]
    assert page_table(page, name) == [["framework", "devices", "test acc"]] + [
        ["jax", str(r["devices"]), f"{r['test_accuracy']:.4f}"] for r in jax]
    for change, error in ((('"test acc"]', '"accuracy"]'), f"result {name!r}: its table has no column 'accuracy' (it has "),
                          (('{framework = "jax"}', '{framework = "caffe"}'), f"result {name!r}: its rows "),
                          ((f'question = "{first["question"]}"', 'question = "nowhere"'),
                           f"result {name!r} answers the question 'nowhere', which no [[question]] asks")):
        toml.write_text(text.replace(*change))
        assert site.main([], root=root) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"harness.publishing.site: {error}"), lines


def test_a_published_file_missing_or_without_provenance_stops_the_generator_with_one_line(tmp_path, capsys):
    root, toml, first = published_copy(tmp_path)
    text, name = toml.read_text(), first["id"]
    toml.write_text(text.replace(f'file = "{first["file"]}"', 'file = "results/nowhere.json"'))
    assert site.main([], root=root) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness.publishing.site: docs/results/nowhere.json does not exist (docs/rosetta.toml: result {name!r} names it as "
        f"its file)"]
    toml.write_text(text)
    content = result_file(first)
    del content["environment"]["commit"], content["environment"]["load_average"]
    with open(os.path.join(root, "docs", first["file"]), "w") as f:
        json.dump(content, f)
    assert site.main([], root=root) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"harness.publishing.site: docs/{first['file']} lacks its provenance (commit, load_average missing from the file; "
        f"write it with compare.py --json) (docs/rosetta.toml: result {name!r} names it)"]
    assert not (tmp_path / "repo" / "docs" / "site").exists(), "nothing is written when a result is refused"


# ---- in a real browser ----

def skip_or_fail(reason):
    """Locally a missing browser skips the browser tests; under .ci/run, which installs it, it fails them."""
    if REQUIRE_ALL:
        pytest.fail(f"{reason}; ROSETTA_REQUIRE_ALL_FRAMEWORKS=1 (.ci/run) requires the browser tests to run",
                    pytrace=False)
    pytest.skip(reason)


def chromium():
    """Paths of the distribution's Chromium and chromedriver, or a skip (a failure under .ci/run) naming what
    is missing."""
    if importlib.util.find_spec("selenium") is None:
        skip_or_fail("selenium is not installed (pip install -r requirements.txt)")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        skip_or_fail("Chromium or chromedriver is missing (apt-get install chromium chromium-driver)")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module, its console log and network events recorded."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    binary, driver = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--hide-scrollbars", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def open_page(browser, width):
    browser.set_window_size(width, 1000)
    browser.get("file://" + os.path.join(ROOT, site.SITE, "index.html"))
    browser.get_log("browser"), browser.get_log("performance")   # start both logs from this load
    browser.refresh()
    return browser


SHOWN = """return Object.fromEntries(Array.from(document.querySelectorAll("section[id]"), s => [s.id,
    Array.from(s.querySelectorAll(".fw")).filter(c => c.offsetParent !== null)
         .map(c => [c.getBoundingClientRect(), c.dataset.fw])
         .sort((a, b) => a[0].top - b[0].top || a[0].left - b[0].left).map(p => p[1])]));"""


def shown(browser):
    """{section id: the frameworks it shows now, left to right, top to bottom}, read in one call."""
    return browser.execute_script(SHOWN)


def loaded_cleanly(browser, origin):
    """The page just loaded logged no console error or warning, no request failed or left `origin`, and its
    stylesheet and script both took effect."""
    import json
    console = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert console == [], console
    events = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    requested = [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"]
    failed = [e["params"] for e in events if e["method"] == "Network.loadingFailed"]
    assert failed == [], failed
    assert all(url.startswith(origin) for url in requested), requested
    assert {url.rsplit("/", 1)[1] for url in requested} >= {"index.html", "style.css", "pygments.css", "site.js"}
    assert browser.execute_script("return getComputedStyle(document.querySelector('.cols')).display") == "grid"
    assert browser.execute_script("return document.body.dataset.view") == "all"   # site.js ran
    images = browser.execute_script("return Array.from(document.images, i => [i.src, i.complete && i.naturalWidth])")
    assert images and all(loaded for _, loaded in images), images   # the plots: every one decoded
    assert all("/docs/site/results/" in src for src, _ in images), "a plot from the site's own copy"
    assert {src for src, _ in images} <= set(requested)


def test_the_page_loads_from_the_file_system_with_no_console_error_and_no_failed_request(browser):
    open_page(browser, 1400)
    loaded_cleanly(browser, "file://")


def test_the_page_serves_as_is_from_a_static_host(browser):
    """Served by a plain static file server (the repo root, as GitHub Pages or any host would serve it)."""
    import functools
    import http.server
    import threading
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=ROOT)
    handler.func.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        origin = f"http://127.0.0.1:{server.server_address[1]}/"
        browser.set_window_size(1400, 1000)
        browser.get(origin + "docs/site/index.html")
        browser.get_log("browser"), browser.get_log("performance")
        browser.refresh()
        loaded_cleanly(browser, origin)
    finally:
        server.shutdown()
        server.server_close()


def test_wide_shows_four_columns_and_a_tab_switches_every_section(browser, source):
    open_page(browser, 1400)
    ids = [c["id"] for c in source["concept"]]
    assert shown(browser) == {i: list(FRAMEWORKS) for i in ids}
    row = {c.location["y"] for c in browser.find_elements("css selector", f"#{ids[0]} .fw")}
    assert len(row) == 1, "four columns side by side on a wide screen"
    for fw in FRAMEWORKS:
        browser.find_element("css selector", f'.tab[data-fw="{fw}"]').click()
        assert shown(browser) == {i: [fw] for i in ids}, fw
        assert browser.find_element("css selector", f'.tab[data-fw="{fw}"]').get_attribute("aria-pressed") == "true"
    browser.find_element("css selector", '.tab[data-fw="all"]').click()
    assert shown(browser) == {i: list(FRAMEWORKS) for i in ids}


def test_any_two_frameworks_side_by_side(browser, source):
    from selenium.webdriver.support.ui import Select
    open_page(browser, 1400)
    Select(browser.find_element("id", "left")).select_by_value("jax")
    Select(browser.find_element("id", "right")).select_by_value("mxnet")
    assert shown(browser) == {c["id"]: ["jax", "mxnet"] for c in source["concept"]}
    first, second = browser.find_elements("css selector", f'#{source["concept"][0]["id"]} .fw:not([hidden])')
    assert first.location["y"] == second.location["y"], "the two are side by side"
    assert browser.find_element("id", "compare").get_attribute("aria-pressed") == "true"


def test_narrow_starts_on_a_tab_and_the_keyboard_reaches_the_controls(browser, source):
    from selenium.webdriver.common.keys import Keys
    open_page(browser, 420)
    ids = [c["id"] for c in source["concept"]]
    assert shown(browser) == {i: ["pytorch"] for i in ids}, "a narrow screen shows one tab"
    browser.find_element("css selector", '.tab[data-fw="tensorflow"]').send_keys(Keys.SPACE)   # a real button
    assert shown(browser) == {i: ["tensorflow"] for i in ids}
    assert browser.execute_script("return document.activeElement.matches('.tab:focus-visible')")


def test_screenshots_at_1400_and_420_pixels(browser):
    """The top of the page, the allreduce section and the Results part, at each width, for a person to look at."""
    os.makedirs(SHOTS, exist_ok=True)
    for width in (1400, 420):
        open_page(browser, width)
        for where in ("top", "allreduce", "results"):
            if where != "top":
                browser.execute_script(f"document.getElementById('{where}').scrollIntoView()")
            path = os.path.join(SHOTS, f"site-{width}px-{where}.png")
            assert browser.save_screenshot(path) and os.path.getsize(path) > 10000
            print(f"screenshot: {path}")
