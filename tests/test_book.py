"""The book builds with warnings as errors, and its HTML is self-contained and linked up.

These checks read the built HTML only (no browser): every page of _toc.yml is there,
next/previous links walk the pages in toc order, nothing is loaded from another host,
MathJax comes from the site's own _static, notebooks offer an .ipynb download and no
launch button for a hosting service.
"""
import re
from urllib.parse import urljoin, urlparse

import pytest
from bs4 import BeautifulSoup

from browser_helpers import ROOT, build_book, source_of, toc_pages


@pytest.fixture(scope="module")
def html_dir():
    return build_book()[0]


def soup_of(html_dir, doc):
    return BeautifulSoup((html_dir / f"{doc}.html").read_text(encoding="utf-8"), "html.parser")


def built_pages(html_dir):
    return [doc for doc in toc_pages() if (html_dir / f"{doc}.html").exists()]


def test_build_has_no_warnings():
    _, code, log = build_book()
    problems = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert code == 0 and not problems, (
        f"`jupyter-book build -W -n --keep-going` failed (exit {code}):\n"
        + "\n".join(problems[:40] or log.splitlines()[-40:]))


def test_every_toc_page_is_written_and_built(html_dir):
    missing_source = [doc for doc in toc_pages() if source_of(doc) is None]
    assert not missing_source, f"_toc.yml lists pages with no source file yet: {missing_source}"
    missing_html = [doc for doc in toc_pages() if not (html_dir / f"{doc}.html").exists()]
    assert not missing_html, f"pages missing from the built site: {missing_html}"


def test_next_previous_links_follow_the_toc(html_dir):
    pages = built_pages(html_dir)
    assert pages, "nothing was built"
    for i, doc in enumerate(pages):
        soup = soup_of(html_dir, doc)
        base = f"http://site/{doc}.html"
        nxt = soup.select_one("a.right-next")
        prev = soup.select_one("a.left-prev")

        def target(a):
            return urlparse(urljoin(base, a["href"])).path.removeprefix("/").removesuffix(".html")

        if i + 1 < len(pages):
            assert nxt is not None, f"{doc}: no 'next' link"
            assert target(nxt) == pages[i + 1], f"{doc}: 'next' goes to {target(nxt)}"
        if i > 0:
            assert prev is not None, f"{doc}: no 'previous' link"
            assert target(prev) == pages[i - 1], f"{doc}: 'previous' goes to {target(prev)}"


EXTERNAL = re.compile(r"^(https?:)?//", re.I)


def test_no_page_loads_anything_from_another_host(html_dir):
    """Scripts, styles, fonts, images and frames all come from the site itself."""
    offenders = []
    for page in sorted(html_dir.rglob("*.html")):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for tag, attr in (("script", "src"), ("link", "href"), ("img", "src"),
                          ("iframe", "src"), ("source", "src"), ("embed", "src")):
            for el in soup.find_all(tag):
                url = el.get(attr) or ""
                if tag == "link" and not {"stylesheet", "preload", "icon", "prefetch",
                                          "modulepreload"} & set(el.get("rel") or []):
                    continue  # plain hyperlinks to other sites are fine
                if EXTERNAL.match(url):
                    offenders.append(f"{page.relative_to(html_dir)}: <{tag} {attr}={url}>")
    assert not offenders, "the site needs the network:\n" + "\n".join(offenders[:30])


def test_mathjax_is_served_locally(html_dir):
    pages = built_pages(html_dir)
    for doc in pages:
        srcs = [s.get("src", "") for s in soup_of(html_dir, doc).find_all("script")]
        mathjax = [s for s in srcs if "mathjax" in s.lower()]
        for src in mathjax:
            assert not EXTERNAL.match(src), f"{doc}: MathJax from {src}"
            local = (html_dir / doc).parent / src.split("?")[0]
            assert local.resolve().exists(), f"{doc}: {src} is not in the built site"
    # The chtml fonts must travel with it, or math renders as boxes offline.
    fonts = list((html_dir / "_static" / "mathjax" / "output" / "chtml" / "fonts").rglob("*.woff"))
    assert fonts, "MathJax fonts are missing from _static/mathjax"


def test_notebooks_download_as_ipynb_and_launch_nowhere(html_dir):
    notebooks = [doc for doc in built_pages(html_dir) if source_of(doc).suffix == ".ipynb"]
    for doc in notebooks:
        soup = soup_of(html_dir, doc)
        hrefs = [a.get("href", "") for a in soup.find_all("a")]
        downloads = [h for h in hrefs if h.endswith(".ipynb") and "_sources" in h]
        assert downloads, f"{doc}: no .ipynb download button"
        for h in downloads:
            assert (html_dir / doc).parent.joinpath(h).resolve().exists(), f"{doc}: {h} missing"
        hosted = [h for h in hrefs if re.search(r"binder|colab|jupyterhub|hub/user-redirect", h)]
        assert not hosted, f"{doc}: launch buttons for hosting services: {hosted}"


def test_config_keeps_execution_off_and_bibliography():
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["execute"]["execute_notebooks"] == "off"
    for bib in config["bibtex_bibfiles"]:
        assert (ROOT / bib).exists(), f"bibliography file {bib} is missing"


def test_citations_read_as_their_entries_labels(html_dir):
    """Every entry of the bibliography has its own label, and every citation's text is (the end of) the label of
    the entry it links to: "[Behrouz et al., 2025a]", or "2025a" after the names in a textual citation. Two works
    by the same authors in one year once cited alike, under labels such as [BRZM25] that the text never showed."""
    entries = {}
    for div in soup_of(html_dir, "book/bibliography").select("div.citation"):
        entries[div["id"]] = div.select_one("span.label").get_text(strip=True).strip("[]")
    labels = sorted(entries.values())
    assert len(entries) > 20 and len(set(labels)) == len(labels), labels
    wrong, seen = [], 0
    for doc in built_pages(html_dir):
        for a in soup_of(html_dir, doc).select('a[href*="bibliography.html#"]'):
            label = entries.get(a["href"].split("#")[1])
            text = " ".join(a.get_text().split())           # "et al." is in <em>
            seen += 1
            if label is None or not (text == label or label.endswith(", " + text)):
                wrong.append(f"{doc}: {text!r} links to {label!r}")
    assert seen > 100 and not wrong, "\n".join(wrong[:20])


# Where a `$` may legitimately stay in the HTML: math MathJax will typeset, code, cell
# outputs, and the page's scripts and styles.
NOT_PROSE = ("script", "style", "pre", "code", "kbd", "samp")
NOT_PROSE_CLASSES = {"math", "cell_output", "output", "highlight", "MathJax"}


RAW_MATH = re.compile(r"\$|\\[A-Za-z]{2,}")   # a dollar, or a LaTeX command such as \alpha


def raw_math_in_prose(soup) -> list[str]:
    """Prose text nodes that still hold a `$` or a LaTeX command: math Markdown failed to parse.

    The usual cause is a formula wrapped onto a line that starts with `+ ` or `- `:
    Markdown reads that line as a list item, the sign disappears and both halves of the
    formula are printed raw.
    """
    main = soup.select_one("main") or soup
    found = []
    for text in main.find_all(string=RAW_MATH):
        if any(parent.name in NOT_PROSE or NOT_PROSE_CLASSES & set(parent.get("class") or [])
               for parent in text.parents):
            continue
        found.append(" ".join(text.split())[:160])
    return found


def test_raw_math_in_prose_detector_finds_a_broken_formula():
    broken = BeautifulSoup('<main><p>the gradient is $a</p><ul><li><p>b$ here</p></li></ul>'
                           '<p><span class="math notranslate">\\(x\\)</span> and <code>$HOME</code></p>'
                           '<p>raw \\tfrac12 left</p><p>no math, 5 dollars</p></main>', "html.parser")
    assert raw_math_in_prose(broken) == ["the gradient is $a", "b$ here", "raw \\tfrac12 left"]


def test_no_raw_math_in_prose(html_dir):
    """Every inline formula was parsed as math: no `$` is left in the rendered prose."""
    offenders = [f"{doc}: {text}" for doc in built_pages(html_dir)
                 for text in raw_math_in_prose(soup_of(html_dir, doc))]
    assert not offenders, "unparsed inline math (a `$` or LaTeX command left in the prose):\n" + "\n".join(offenders)


# A pipe table's |---|---| row; Sphinx's smart quotes print an unrendered one as |—|—|.
MARKDOWN_TABLE_RULE = re.compile(r"\|(\s*:?(-{3,}|[—–]+):?\s*\|){2,}")


def markdown_tables_as_text(soup) -> list[str]:
    """Text outside code that still holds a Markdown table's delimiter row: a table (typed in a cell, or printed
    by one as text/markdown) that was rendered as a paragraph of pipes instead of a table."""
    main = soup.select_one("main") or soup
    return [" ".join(text.split())[:160] for text in main.find_all(string=MARKDOWN_TABLE_RULE)
            if not any(parent.name in NOT_PROSE for parent in text.parents)]


def test_markdown_table_detector_finds_a_table_left_as_text():
    broken = BeautifulSoup('<main><div class="cell_output"><p>| a | b |\n|—|—|\n| 1 | 2 |</p></div>'
                           '<p>| x | y | |---|:---:| | 3 | 4 |</p><p>a | b, not a table</p>'
                           '<table><tr><td>a</td></tr></table><pre>|---|---|</pre></main>', "html.parser")
    assert markdown_tables_as_text(broken) == ["| a | b | |—|—| | 1 | 2 |", "| x | y | |---|:---:| | 3 | 4 |"]


def test_markdown_tables_render_as_tables(html_dir):
    """Chapter 3 prints its table of presets as text/markdown; it (and every typed table) must become a <table>."""
    offenders = [f"{doc}: {text}" for doc in built_pages(html_dir)
                 for text in markdown_tables_as_text(soup_of(html_dir, doc))]
    assert not offenders, "Markdown tables rendered as text (nb_render_markdown_format?):\n" + "\n".join(offenders)


def test_every_chapter_numbers_its_sections_and_ends_with_summary_and_references():
    """Sections 1, 2, ... in order, the last numbered one the Summary, then References with citations."""
    import json
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                         if c["cell_type"] == "markdown")
        headings = re.findall(r"^## (.+)$", text, flags=re.M)
        numbered = [h for h in headings if re.match(r"\d+\. ", h)]
        assert [int(h.split(".")[0]) for h in numbered] == list(range(1, len(numbered) + 1)), (path.name, headings)
        assert numbered[-1].endswith(". Summary"), (path.name, numbered[-1])
        assert headings[-1] == "References", (path.name, headings)
        assert "{cite:" in text.split("\n## References\n")[-1], f"{path.name}: References cites nothing"


def test_directives_with_math_use_colon_fences():
    """A directive fenced with backticks (```{admonition}) is a code block to JupyterLab, which then shows
    its formulas as raw TeX; a colon fence (:::{admonition}) renders the same in the book and as Markdown in
    JupyterLab."""
    offenders = []
    for where, text in book_prose():
        if " cell " not in where:
            continue                                        # Markdown pages are not opened in JupyterLab
        for m in re.finditer(r"^(`{3,})\{[^}]+\}.*\n(?:.*\n)*?\1$", text, flags=re.M):
            if "$" in m.group(0):
                offenders.append(f"{where}: {m.group(0).splitlines()[0]}")
    assert not offenders, "backtick-fenced directives with math:\n" + "\n".join(offenders)


def test_every_widget_view_has_its_saved_state():
    """A widget cell's output names a model of the notebook's saved widget state, which holds the default
    figure the rendered book shows; a cell re-run without saving that state leaves a dangling name."""
    import json
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        nb = json.loads(path.read_text())
        state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
                if view:
                    assert view["model_id"] in state, f"{path.name} cell {i}: widget {view['model_id']} unsaved"


def test_wide_figures_take_the_full_width():
    """The page's column is 688 px wide at a laptop's 1280: a figure much wider is shrunk until its legend and
    tick labels are a few pixels high, so its cell carries the ``full-width`` tag (936 px, into the margin)."""
    import base64
    import json
    import struct
    narrow = []
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                width = struct.unpack(">I", base64.b64decode(png)[16:20])[0] if png else 0   # the IHDR width
                if width > 860 and "full-width" not in cell["metadata"].get("tags", []):
                    narrow.append(f"{path.name} cell {i}: {width} px")
    assert not narrow, "figures shrunk below 0.8 of their size; tag their cells full-width:\n" + "\n".join(narrow)




def test_every_figure_has_an_alt_text():
    """A figure's alt text is what a screen reader says and what a page shows when the image is missing;
    left unset, Sphinx writes the image's hashed file name. A cell sets it for its images through
    ``metadata.mystnb.image.alt``: a sentence or three on what the figure shows, read aloud (no TeX)."""
    import json
    missing = []
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if not any("image/png" in out.get("data", {}) for out in cell.get("outputs", [])):
                continue
            alt = cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "")
            if len(alt) < 60 or "$" in alt or "\\" in alt:
                missing.append(f"{path.name} cell {i}: {alt!r}")
    assert not missing, "figures without a readable alt text:\n" + "\n".join(missing)

# Characters a code box shows at 1280 px (book/_static/code.css: 12 px code), in the column and in a
# full-width cell; test_browser measures the rendered boxes. Sources are wrapped a little inside them.
CODE_BOX, CODE_BOX_FULL = 90, 124
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"   # a widget shows its view, not its text


def too_wide(lines, limit) -> list[str]:
    return [f"{len(line)}: {line[:60]}" for line in lines if len(line) > limit]


def test_code_cells_and_printed_outputs_fit_the_code_box():
    """A code line or a printed line longer than its box scrolls sideways and hides its end: sources are
    wrapped to 88 characters (120 in a full-width cell), printed text to the box itself."""
    import json
    wide = []
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            full = "full-width" in cell["metadata"].get("tags", [])
            source = "".join(cell["source"]).splitlines()
            wide += [f"{path.name} cell {i} source {w}" for w in too_wide(source, 120 if full else 88)]
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                shown_as_text = not {"text/html", "text/markdown", WIDGET_VIEW} & set(data)
                text = out.get("text") or data.get("text/plain") if shown_as_text else None
                if text:
                    printed = "".join(text).splitlines()
                    wide += [f"{path.name} cell {i} output {w}"
                             for w in too_wide(printed, CODE_BOX_FULL if full else CODE_BOX)]
    # the exercises' notebooks too (JupyterLab), worked solutions and the student copies made from them
    exercises = ROOT / "exercises"
    for path in sorted([*(exercises / "solutions").glob("ch*.ipynb"), *exercises.glob("ch*.ipynb")]):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                wide += [f"{path.name} cell {i} source {w}" for w in too_wide("".join(cell["source"]).splitlines(), 88)]
    assert not wide, f"{len(wide)} lines wider than their code box:\n" + "\n".join(wide[:40])


# Names of the library in the prose: `atlaslib.delta.chunk.chunk_step`, and paths from the repository's root.
LIBRARY_NAME = re.compile(r"\batlaslib(?:\.\w+)+")
REPO_PATH = re.compile(r"(?<![\w./-])(?:atlaslib|book|exercises|results|tests)/[\w./*-]*")


def book_prose() -> list[tuple[str, str]]:
    """(where, text) for every piece of prose a reader sees: the chapters' and exercise notebooks'
    markdown cells, the book's Markdown pages and the exercises' README."""
    import json
    prose = []
    notebooks = [*(ROOT / "book").glob("ch*.ipynb"), *(ROOT / "exercises").rglob("*.ipynb")]
    for path in sorted(p for p in notebooks if ".ipynb_checkpoints" not in p.parts):   # not Jupyter's autosaves
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                prose.append((f"{path.relative_to(ROOT)} cell {i}", "".join(cell["source"])))
    for path in sorted([*(ROOT / "book").glob("*.md"), ROOT / "exercises" / "README.md"]):
        prose.append((str(path.relative_to(ROOT)), path.read_text()))
    return prose


def library_name_resolves(name: str) -> bool:
    """Whether ``atlaslib.a.b`` is a module, or an attribute (chain) of the longest importable module."""
    import importlib
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if not (module_name + ".").startswith(f"{error.name}."):   # no such module (here or above it);
                raise                                                   # a module that fails to import is a failure
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_code_references_in_the_book_resolve():
    """Every `atlaslib....` name the prose gives imports, and every repository path it writes exists (`NN` in
    `chNN_*.ipynb` stands for a chapter's number): a function renamed or a file moved leaves a stale name."""
    stale = []
    for where, text in book_prose():
        for name in sorted(set(LIBRARY_NAME.findall(text))):
            if not library_name_resolves(name):
                stale.append(f"{where}: {name} does not resolve")
        for path in sorted(set(REPO_PATH.findall(text))):
            if not list(ROOT.glob(path.rstrip("/.").replace("NN", "[0-9][0-9]"))):
                stale.append(f"{where}: {path} does not exist")
    assert not stale, "stale code references in the book's prose:\n" + "\n".join(stale)


# The chapters' "kernel line(s) | math" tables quote the kernels' lines in short (chapter 1, section 8):
# without the ``tl.`` prefix, the dtype casts, the ``input_precision`` argument, broadcast indices such as
# ``[:, None]`` and a reduction's axis; ``-inf`` for ``float("-inf")`` and ``...`` for what is left out.
KERNEL_COLUMN = ("kernel", "kernel line(s)", "lines")
QUOTE = re.compile(r"`([^`\n]+)`")


def table_cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split(" | ")]


def kernel_table_quotes() -> list[tuple[str, str]]:
    """(where, quote) for every backticked span in the kernel column of the chapters' kernel tables."""
    quotes = []
    for where, text in book_prose():
        if not where.startswith("book/ch"):
            continue
        lines = text.split("\n")
        for i, line in enumerate(lines[:-1]):
            if not (line.startswith("|") and re.match(r"\|\s*:?-{3,}", lines[i + 1])):
                continue
            header = table_cells(line)
            if not set(header) & set(KERNEL_COLUMN):
                continue
            column = next(j for j, cell in enumerate(header) if cell in KERNEL_COLUMN)
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                quotes += [(where, q) for q in QUOTE.findall(table_cells(row)[column])]
    return quotes


def without_casts(code: str) -> str:
    """``code`` without its ``.to(...)`` casts, and without the brackets that held a cast's operand."""
    while (i := code.find(".to(")) >= 0:
        j = code.index(")", i) + 1
        k = i - 1
        if k >= 0 and code[k] == ")":                 # the operand's brackets: (x * y).to(dt), or a call's
            depth = 0
            while (depth := depth + {")": 1, "(": -1}.get(code[k], 0)) != 0:
                k -= 1
        if k >= 0 and code[k] == "(" and not (k and (code[k - 1].isalnum() or code[k - 1] == "_")):
            code = code[:k] + code[k + 1:i - 1] + code[j:]
        else:
            code = code[:i] + code[j:]
    return code


def squeezed(code: str) -> str:
    """``code`` without whitespace, except one space between two names (``if GATE``)."""
    return re.sub(r"(?<=\W) | (?=\W)", "", re.sub(r"\s+", " ", code.strip()))


def kernel_source_shorthand(code: str) -> str:
    """Code written as the tables write it (see above), without whitespace (``squeezed``)."""
    code = squeezed(code).replace('float("-inf")', "-inf")
    code = without_casts(re.sub(r"\btl\.", "", code))
    code = re.sub(r",(input_precision|axis)=[\w\"']+", "", code)
    code = re.sub(r"\b(sum|max|min)\(([^(),]*),\d\)", r"\1(\2)", code)      # a reduction's axis
    code = re.sub(r"\[(:|None)(,(:|None))+\]", "", code)
    return re.sub(r"\b(\d+)\.0\b", r"\1", code)


def quote_pattern(quote: str) -> re.Pattern:
    """The shorthand of a quoted line as a pattern: ``...`` stands for any code within one statement."""
    parts = [re.escape(kernel_source_shorthand(p)) for p in quote.split("...")]
    return re.compile(r"(?<!\w)" + r"[^;]{0,200}?".join(parts) + r"(?!\w)")   # whole names at either end


def logical_lines(source: str) -> list[str]:
    """The statements of a Python module, each on one line, without comments."""
    import io
    import tokenize
    lines, line = [], []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            lines.append(" ".join(line))
            line = []
        elif token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            line.append(token.string)
    return lines


def kernel_sources() -> str:
    """Every module of the library that holds a Triton kernel, as written (no whitespace) and in shorthand,
    statements separated by ';'."""
    texts = [p.read_text() for p in sorted((ROOT / "atlaslib").rglob("*.py"))]
    lines = [line for t in texts if "@triton.jit" in t for line in logical_lines(t)]
    return ";".join([squeezed(line) for line in lines] + [kernel_source_shorthand(line) for line in lines])


def stale_kernel_quotes(quotes, source) -> list[str]:
    return [f"{where}: `{q}`" for where, q in quotes if not quote_pattern(q).search(source)]


def test_kernel_table_quotes_detector_finds_a_broken_quote():
    line = 'b_A *= decay(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))'
    source = kernel_source_shorthand(line)
    good = ("here", "b_A *= decay(where(m_causal, ..., -inf))")
    assert not stale_kernel_quotes([good], source)
    assert stale_kernel_quotes([("here", "b_A *= decay(where(m_lower, ..., -inf))")], source)


def test_kernel_table_quotes_occur_in_the_kernels():
    """Every line the kernel tables quote is in a kernel module, modulo the shorthand: a kernel edited or
    split leaves a quote that no longer says what the code does."""
    quotes = kernel_table_quotes()
    assert len(quotes) > 50, f"found only {len(quotes)} quotes: has the tables' layout changed?"
    stale = stale_kernel_quotes(quotes, kernel_sources())
    assert not stale, "kernel lines quoted in the book that are not in the kernels:\n" + "\n".join(stale)
