"""The built book as a reader meets it: headless Chromium, no network, every page checked.

For each page of _toc.yml that was built: no console error, no failed or off-site
request, MathJax has typeset the math (no raw TeX left, no MathJax error), every image
has loaded and has an alt text, no cell output shows a traceback, widgets show no error,
no formula, table or code box is wider than its column. The search page must find
"delta rule". A page with a widget must show a static figure and say how to run it live.
A screenshot of each page goes to _build/screenshots/.
"""
import re
import time

import pytest

from browser_helpers import (SCREENSHOTS, OfflineRecorder, StaticServer, build_book,
                             launch, skip_without_browser, source_of, toc_pages)

# Raw TeX that MathJax should have replaced; code blocks are removed before looking.
RAW_TEX = re.compile(r"\$\$|\\\[|\\\(|\\begin\{|\$[^$\n]{0,80}[\\^_][^$\n]{0,80}\$")

PAGE_REPORT_JS = """
async () => {
  // A display formula wider than the column is cut off: scrolled out of view on the right, or, with a
  // \\tag, pushed out of its box on the left. Its glyphs must lie inside the box that holds it.
  const wideMath = () => {
    const tex = new Map();
    for (const item of (window.MathJax && MathJax.startup && MathJax.startup.document
                        && MathJax.startup.document.math) || []) tex.set(item.typesetRoot, item.math);
    return [...document.querySelectorAll('mjx-container[display="true"]')].flatMap(m => {
      const box = m.parentElement.getBoundingClientRect();
      const glyphs = [...m.querySelectorAll('mjx-c')].map(c => c.getBoundingClientRect()).filter(r => r.width);
      const cut = glyphs.some(r => r.left < box.left - 1 || r.right > box.right + 1);
      return cut ? [(tex.get(m) || m.textContent).replace(/\\s+/g, ' ').trim().slice(0, 80)] : [];
    });
  };
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  const article = document.querySelector('main article, main, body');
  const clone = article.cloneNode(true);
  clone.querySelectorAll('pre, code, mjx-container, script, style, .highlight, .cell_input')
       .forEach(e => e.remove());
  const outputs = [...document.querySelectorAll('.cell_output, .output')]
       .map(e => e.innerText).join('\\n');
  return {
    mathSource: document.querySelectorAll('.math, span.math, div.math').length,
    mathRendered: document.querySelectorAll('mjx-container').length,
    mathErrors: [...document.querySelectorAll('mjx-merror, mjx-container [style*="color: red"]')]
                 .map(e => e.textContent).slice(0, 5),
    // an image whose alt text is missing or its own file name says nothing to a screen reader
    pathAlts: imgs.filter(i => !i.alt || /\\.(png|svg|jpe?g)$|_images\\//.test(i.alt))
                  .map(i => i.getAttribute('src').slice(-40)),
    brokenImages: imgs.filter(i => !(i.complete && i.naturalWidth > 0 && i.naturalHeight > 0))
                      .map(i => i.getAttribute('src').slice(0, 80)),
    images: imgs.length,
    text: clone.textContent,
    outputs: outputs,
    pageText: document.body.innerText,
    widgetViews: document.querySelectorAll(
        'script[type="application/vnd.jupyter.widget-view+json"]').length,
    hasNext: !!document.querySelector('a.right-next'),
    hasPrev: !!document.querySelector('a.left-prev'),
    hasSidebarToc: document.querySelectorAll('nav.bd-docs-nav a, .bd-sidebar-primary a.reference').length,
    wideMath: wideMath(),
    // Code (a cell's source, its printed output, a code block in the text) that scrolls sideways hides
    // the rest of its longest lines: cells are wrapped to the 12-px box of book/_static/code.css.
    wideCode: [...document.querySelectorAll('main article pre')]
        .filter(p => p.scrollWidth > p.clientWidth + 1)
        .map(p => {
          const cells = [...document.querySelectorAll('div.cell')];
          const cell = p.closest('div.cell');
          const where = cell ? `cell ${cells.indexOf(cell)} ${p.closest('.cell_output') ? 'output' : 'source'}`
                             : 'code block';
          const longest = p.textContent.split('\\n').reduce((a, b) => b.length > a.length ? b : a, '');
          return `${where} (${p.scrollWidth} px in ${p.clientWidth}): ${longest.trim().slice(0, 60)}`;
        }),
    wideTables: [...document.querySelectorAll('main article table')]
        .filter(t => t.scrollWidth > t.parentElement.clientWidth + 1)
        .map(t => `${t.scrollWidth} px in ${t.parentElement.clientWidth}: ` +
                  t.querySelector('tr').innerText.replace(/\\s+/g, ' ').slice(0, 80)),
  };
}
"""


@pytest.fixture(scope="module")
def site(request):
    """(base_url, pages, context, recorder): the built book behind a local server."""
    chromium = skip_without_browser(request.config)
    from playwright.sync_api import sync_playwright

    html_dir = build_book()[0]
    pages = [doc for doc in toc_pages() if (html_dir / f"{doc}.html").exists()]
    assert pages, f"no page of _toc.yml was built into {html_dir}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with StaticServer(html_dir) as server, sync_playwright() as pw:
        browser = launch(pw, chromium)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        recorder = OfflineRecorder()
        recorder.attach(context)
        yield server.url, pages, context, recorder
        context.close()
        browser.close()


def open_page(context, recorder, url):
    recorder.reset()
    page = context.new_page()
    recorder.watch(page)
    page.goto(url, wait_until="load")
    return page


def test_every_page_renders_offline(site):
    base, pages, context, recorder = site
    problems = []
    t0 = time.time()
    for i, doc in enumerate(pages):
        page = open_page(context, recorder, f"{base}/{doc}.html")
        report = page.evaluate(PAGE_REPORT_JS)
        page.wait_for_timeout(200)  # let late requests (fonts) settle before reading
        name = doc.replace("/", "_")
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))
        first_math = page.query_selector("mjx-container")
        box = first_math.bounding_box() if first_math else None
        if box and box["y"] > 800:  # below the first screen: show some math too
            first_math.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / f"{name}-math.png"))

        def bad(what):
            problems.append(f"{doc}: {what}")

        if recorder.console_errors:
            bad(f"console errors {recorder.console_errors[:5]}")
        if recorder.blocked:
            bad(f"requests to other hosts {sorted(set(recorder.blocked))[:5]}")
        if recorder.failed:
            bad(f"failed requests {recorder.failed[:5]}")
        if report["mathSource"] and not report["mathRendered"]:
            bad(f"{report['mathSource']} math elements but MathJax rendered none")
        if report["mathErrors"]:
            bad(f"MathJax errors / undefined macros: {report['mathErrors']}")
        raw = RAW_TEX.findall(report["text"])
        if raw:
            bad(f"raw TeX left in the text: {raw[:5]}")
        if report["wideMath"]:
            bad(f"display formulas wider than the column at 1280 px (break them into lines): {report['wideMath']}")
        if report["wideTables"]:
            bad(f"tables wider than the column at 1280 px (columns scroll out of view): {report['wideTables']}")
        if report["wideCode"]:
            bad(f"{len(report['wideCode'])} code boxes scroll sideways at 1280 px (wrap their lines): "
                f"{report['wideCode'][:8]}")
        if report["pathAlts"]:
            bad(f"images without an alt text (a file name is no description): {report['pathAlts'][:5]}")
        if report["brokenImages"]:
            bad(f"images that did not load: {report['brokenImages']}")
        for word in ("Traceback", "NotImplementedError"):
            if word in report["outputs"]:
                bad(f"a cell output contains {word!r}")
        for word in ("Error displaying widget", "Error rendering", "Loading widget"):
            if word in report["pageText"]:
                bad(f"widget error text on the page: {word!r}")
        if report["widgetViews"]:
            # A widget cannot run on a static page: its default figure and a note on how
            # to run it live must stand in for it.
            if not report["images"]:
                bad("has a widget but no static figure")
            if not re.search(r"make lab|Jupyter", report["pageText"]):
                bad("has a widget but no note on how to run it live (make lab / Jupyter)")
        if i + 1 < len(pages) and not report["hasNext"]:
            bad("no 'next' button")
        if i > 0 and not report["hasPrev"]:
            bad("no 'previous' button")
        if not report["hasSidebarToc"]:
            bad("no table of contents in the sidebar")
        print(f"{doc}: {report['mathRendered']} formulas, {report['images']} images")
        page.close()
    print(f"{len(pages)} pages checked in {time.time() - t0:.1f} s; "
          f"screenshots in {SCREENSHOTS}")
    assert not problems, "\n".join(problems)


# At phone width a display formula may be wider than the column: it must scroll, so no glyph may lie LEFT
# of its box (nothing scrolls there). A \\tag-ged equation did, in the theme's row-reverse flex box.
PHONE_CUT_MATH_JS = """
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const tex = new Map();
  for (const item of (window.MathJax && MathJax.startup && MathJax.startup.document
                      && MathJax.startup.document.math) || []) tex.set(item.typesetRoot, item.math);
  return [...document.querySelectorAll('mjx-container[display="true"]')].flatMap(m => {
    const left = m.parentElement.getBoundingClientRect().left;
    const cut = [...m.querySelectorAll('mjx-c')].some(c => {
      const r = c.getBoundingClientRect();
      return r.width && r.left < left - 1;
    });
    return cut ? [(tex.get(m) || m.textContent).replace(/\\s+/g, ' ').trim().slice(0, 80)] : [];
  });
}
"""


def test_no_formula_is_cut_on_a_phone(site):
    base, pages, context, recorder = site
    problems = []
    for doc in pages:
        page = open_page(context, recorder, f"{base}/{doc}.html")
        page.set_viewport_size({"width": 390, "height": 800})
        page.wait_for_timeout(200)  # let MathJax lay the page out again at the new width
        cut = page.evaluate(PHONE_CUT_MATH_JS)
        if cut:
            page.screenshot(path=str(SCREENSHOTS / f"{doc.replace('/', '_')}-phone.png"))
            problems.append(f"{doc}: {len(cut)} display formulas cut on their left at 390 px: {cut}")
        page.close()
    assert not problems, "\n".join(problems)


def test_search_finds_delta_rule(site):
    base, pages, context, recorder = site
    page = open_page(context, recorder, f"{base}/search.html?q=delta+rule")
    page.wait_for_function(
        "() => { const s = document.querySelector('#search-results');"
        " return s && (s.querySelector('li') || /did not match|Search Results/i.test(s.innerText)); }",
        timeout=20_000)
    page.wait_for_timeout(300)  # results arrive one by one
    hits = page.eval_on_selector_all("#search-results li a", "as => as.map(a => a.href)")
    page.screenshot(path=str(SCREENSHOTS / "search-delta-rule.png"))
    page.close()
    assert not recorder.console_errors, recorder.console_errors
    assert not recorder.blocked and not recorder.failed, recorder.failed
    assert hits, ("search for 'delta rule' found nothing "
                  f"(pages that mention it in their source: {pages_mentioning('delta rule', pages)})")
    print(f"search 'delta rule' -> {hits}")


def pages_mentioning(phrase, pages):
    return [doc for doc in pages
            if (src := source_of(doc)) and phrase in src.read_text(encoding="utf-8").lower()]
