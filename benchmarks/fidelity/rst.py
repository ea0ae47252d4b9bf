"""Reading Python's library reference (the reStructuredText sources that Debian's
``python3.X-doc`` package installs) as plain prose: sections and documented objects
(functions, classes, methods, data, exceptions, command-line options), each with its own
text, markup removed and code examples dropped.

    entries = parse_page(open(".../_sources/library/json.rst.txt").read(), "json")
    # [Entry(kind="section", name="Basic Usage", text=...), Entry(kind="function", name="json.dump", ...)]

Used by ``benchmarks/fidelity/suite.py`` (``quality.py prose-suite``), which packs entries into documents and writes the
evaluation cases.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# directives that document one object: each becomes its own entry
OBJECTS = {"function", "method", "class", "data", "attribute", "exception", "decorator", "classmethod",
           "staticmethod", "coroutinefunction", "coroutinemethod", "cmdoption", "decoratormethod"}
# directives whose body is prose worth keeping (with a lead-in)
KEEP = {"note": "Note: ", "warning": "Warning: ", "seealso": "See also: ", "impl-detail": "", "important": "",
        "tip": "", "attention": "", "caution": "", "hint": "", "admonition": ""}
# directives dropped with their body (code, tables, indexes, metadata)
_VERSION = {"versionadded": "New in version {v}.", "versionchanged": "Changed in version {v}:",
            "deprecated": "Deprecated since version {v}:", "deprecated-removed": "Deprecated since version {v}:"}
_HEADING = re.compile(r"^([=\-~^*+#\"'`])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\. ([a-z:-]+)::\s*(.*)$")


@dataclass
class Entry:
    """One section's prose or one documented object: ``kind`` ("section" or the directive),
    ``name`` (the section title, or the object's qualified name), ``text`` (plain prose,
    paragraphs separated by blank lines) and, for objects, ``summary`` (its first sentence)."""

    kind: str
    name: str
    text: str
    summary: str = ""
    paragraphs: list[str] = field(default_factory=list)


def inline(s: str) -> str:
    """Plain text of one line of reST inline markup."""
    s = re.sub(r":[a-z:]+:`~?([^`<]*?)\s*<[^`>]*>`", r"\1", s)  # :ref:`text <target>`
    s = re.sub(r":[a-z:]+:`[~!]?([^`]*)`", lambda m: m.group(1).split(".")[-1] if m.group(0).find("`~") >= 0
               else m.group(1), s)
    s = re.sub(r"`([^`<]+?)\s*<[^`>]+>`__?", r"\1", s)  # `text <url>`_
    s = re.sub(r"``([^`]+)``", r"\1", s)
    s = re.sub(r"`([^`]+)`_*", r"\1", s)
    s = re.sub(r"\[#[^\]]*\]_", "", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"\1", s)
    s = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"\1", s)
    s = re.sub(r"\|([^|\s][^|]*)\|", r"\1", s)
    return s.replace("\\", "")


def _join_continuations(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith("\\"):
            out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
        else:
            out.append(line.rstrip())
    return out


def _block(lines: list[str], i: int, indent: int) -> int:
    """The index after the block of lines indented deeper than ``indent`` (blank lines
    included) that starts at ``i``."""
    j = i
    while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
        j += 1
    while j > i and not lines[j - 1].strip():
        j -= 1
    return j


def _dedent(lines: list[str]) -> list[str]:
    ind = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return [x[ind:] for x in lines]


def _summary(paragraphs: list[str]) -> str:
    for p in paragraphs:
        if p.startswith(("New in version", "Changed in version", "Deprecated", "Note:", "Warning:")):
            continue
        m = re.match(r"(.+?[.!?])(\s|$)", p)
        return (m.group(1) if m else p).strip()
    return ""


class _Parser:
    """One page's entries, in document order."""

    def __init__(self, module: str):
        self.module = module
        self.owner = ""  # the class whose body is being read
        self.entries: list[Entry] = []

    def prose(self, lines: list[str], out: list[str]) -> None:
        """Append ``lines``' paragraphs to ``out``; documented objects inside become entries."""
        i, para = 0, []

        def flush():
            if para:
                text = inline(" ".join(x.strip() for x in para))
                literal = text.endswith("::")
                text = text[:-1] if literal else text
                if literal and len(text.split()) < 8:  # "Compact encoding:" before a code block
                    text = ""
                if text.strip(" :") and not text.lstrip().startswith((">>>", "+--", "|")):
                    out.append(text.strip())
                para.clear()
                return literal
            return False

        while i < len(lines):
            line = lines[i]
            m = _DIRECTIVE.match(line)
            if m:
                flush()
                end = _block(lines, i + 1, len(m.group(1)))
                self.directive(m.group(2), m.group(3).strip(), _dedent(lines[i + 1:end]), out)
                i = end
                continue
            if not line.strip():
                base = len(para[0]) - len(para[0].lstrip()) if para else 0
                if flush():  # a paragraph ending in '::' introduces a code block: drop it
                    j = i + 1
                    while j < len(lines) and not lines[j].strip():
                        j += 1
                    if j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > base:
                        i = _block(lines, j, base)
                        continue
                i += 1
                continue
            if line.lstrip().startswith((">>>", "...")) or set(line.strip()) <= set("=-+| ") \
                    or (not para and re.match(r"^\s*:[a-z-]+:(\s|$)", line)):  # a directive's options
                flush()
                i += 1
                continue
            para.append(line)
            i += 1
        flush()

    def directive(self, name: str, arg: str, body: list[str], out: list[str]) -> None:
        """One directive: an object becomes an entry; a note keeps its prose; the rest goes."""
        if name in ("module", "currentmodule"):
            self.module = arg or self.module
            return
        if name in OBJECTS:
            sig = arg.split("\n")[0]
            short = re.split(r"[(\s\[]", sig, maxsplit=1)[0]
            if name == "cmdoption" or "." in short:
                qual = short
            else:
                qual = ".".join(x for x in (self.owner or self.module, short) if x)
            paras: list[str] = []
            at = len(self.entries)
            owner, self.owner = self.owner, (qual if name in ("class", "exception") else self.owner)
            self.prose(body, paras)
            self.owner = owner
            text = "\n\n".join([inline(f"{qual}{sig[len(short):]}")] + paras)
            self.entries.insert(at, Entry(name, qual, text, _summary(paras), paras))
            return
        if name in KEEP:
            inner: list[str] = []
            self.prose(body, inner)
            if inner:
                out.append(KEEP[name] + " ".join(inner))
            return
        if name in _VERSION:
            inner = []
            self.prose(body, inner)
            out.append(" ".join([_VERSION[name].format(v=arg.split(",")[0].strip())] + inner))
            return
        if name == "rubric" and arg:
            out.append(inline(arg))


def parse_page(text: str, module: str) -> list[Entry]:
    """The entries of one library reference page: each section's prose (titled by its
    heading) and each documented object, in document order."""
    lines = _join_continuations(text.splitlines())
    p = _Parser(module)
    sections: list[tuple[str, list[str]]] = [("", [])]
    i = 0
    while i < len(lines):  # split at headings: a line underlined (and maybe overlined) by punctuation
        if i + 1 < len(lines) and lines[i].strip() and _HEADING.match(lines[i + 1]) \
                and len(lines[i + 1].strip()) >= len(lines[i].strip()) and not _HEADING.match(lines[i]):
            sections.append((inline(lines[i].strip()), []))
            i += 2
            continue
        if _HEADING.match(lines[i]) and not lines[i].startswith(".."):
            i += 1
            continue
        sections[-1][1].append(lines[i])
        i += 1
    for title, body in sections:
        paras: list[str] = []
        at = len(p.entries)
        p.prose(body, paras)
        paras = [x for x in paras if len(x.split()) >= 4]
        if paras:
            p.entries.insert(at, Entry("section", title or module, "\n\n".join(paras), _summary(paras), paras))
    return p.entries


__all__ = ["Entry", "OBJECTS", "inline", "parse_page"]
