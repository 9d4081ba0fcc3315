"""Sphinx glue so the built book works with no network and no hosting service.

sphinx-thebe (always loaded by Jupyter Book 1.x) adds a script that declares
THEBE_JS_URL, and Sphinx 7.4 emits that body-only script twice, which is a console
error on every page. Thebe runs code on Binder, which a reader of this offline book
does not have, so its assets are dropped from every page instead.

The bibliography style "authoryear" labels each entry as the text cites it (sphinxcontrib-bibtex's
author_year: "Behrouz et al., 2025a"), so that a reader can find a citation's entry by its label.
"""
from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle


def surnames(entry, von: bool = True) -> list:
    """The authors' last names as plain text ("von Oswald"; "Oswald" with ``von=False``)."""
    return [" ".join(Text(name).render_as("text")
                     for name in (*(person.rich_prelast_names if von else []), *person.rich_last_names))
            for person in entry.persons.get("author", [])]


def cited_authors(entry) -> str:
    """The authors as author_year cites them: "A", "A and B", or "A et al." from three on."""
    last = surnames(entry)
    return last[0] if len(last) == 1 else f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al."


class AuthorYearLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            yield f"{cited_authors(entry)}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearSorting(BaseSortingStyle):
    """By the first author's surname (von Oswald under O), then year (2025a before 2025b), then title."""
    def sorting_key(self, entry):
        fields = entry.fields
        return surnames(entry, von=False)[0].lower(), fields.get("year", ""), fields.get("title", "").lower()


class AuthorYearStyle(UnsrtStyle):
    default_label_style = "authoryear"
    default_sorting_style = "authoryear"


register_plugin("pybtex.style.labels", "authoryear", AuthorYearLabels)
register_plugin("pybtex.style.sorting", "authoryear", AuthorYearSorting)
register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)


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
