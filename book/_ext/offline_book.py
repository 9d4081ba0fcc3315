"""Sphinx glue so the built book works with no network and no hosting service.

sphinx-thebe (always loaded by Jupyter Book 1.x) adds a script that declares
THEBE_JS_URL, and Sphinx 7.4 emits that body-only script twice, which is a console
error on every page. Thebe runs code on Binder, which a reader of this offline book
does not have, so its assets are dropped from every page instead.
"""


def _is_thebe(asset) -> bool:
    filename = str(getattr(asset, "filename", asset) or "")
    body = str(getattr(asset, "attributes", {}).get("body", ""))
    return "thebe" in filename.lower() or "THEBE_JS_URL" in body


def drop_thebe_assets(app, pagename, templatename, context, doctree):
    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [a for a in context[key] if not _is_thebe(a)]


def setup(app):
    app.connect("html-page-context", drop_thebe_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
