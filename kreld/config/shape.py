"""How deep a TOML text nests and how long its keys are, checked before tomllib sees it.

tomllib parses an array or inline table inside another by recursion (some three
frames a level): arrays nested 100,000 deep end in RecursionError.  A dotted key
(``a.b.c...``) is walked by building the key tuple of every level, each one part
longer than the last: one key of 100,000 parts took minutes and every byte of
memory.  So a linear scan goes first, knowing just enough TOML to skip what can
hide a bracket or a dot (comments; basic, literal and multi-line strings, with
tomllib's own rules for where each ends), and counts:

* ``[`` and ``{`` open, ``]`` and ``}`` close: at most :data:`MAX_NESTING` open at
  once (a table header ``[[a]]`` is two);
* dots outside strings between two of ``= , [ ] { }`` or a line's end: at most
  :data:`MAX_KEY_DOTS` (a float or a time has one; a key of *n* parts has *n* - 1).

Where the scan and tomllib could see a string end differently the text is not
TOML, and tomllib stops there with its own error before any deeper level.
"""

from __future__ import annotations

import re

from kreld.core.errors import ConfigError

__all__ = ["MAX_KEY_DOTS", "MAX_NESTING", "check_shape"]

MAX_NESTING = 32
MAX_KEY_DOTS = 31  # keys of up to 32 parts

_TOKEN = re.compile(r"[\"'#\[\]{}=,.\n]")
# A string from its opening quote to just past its end, as tomllib reads it: a
# multi-line one ends at the first unescaped (basic) or any (literal) three quotes,
# taking up to two more quotes as content; a one-line one cannot cross a newline.
_ML_BASIC = re.compile(r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*"""(?:"{1,2})?')
_ML_LITERAL = re.compile(r"'''[\s\S]*?'''(?:'{1,2})?")
_BASIC = re.compile(r'"(?:[^"\\\n]|\\[^\n])*"')
_LITERAL = re.compile(r"'[^'\n]*'")


def _string_end(text: str, pos: int) -> int:
    """Where the string opening at *pos* ends; one left open ends its line (tomllib
    stops there with an error, so nothing after it is parsed)."""
    if text.startswith('"""', pos):
        m = _ML_BASIC.match(text, pos)
    elif text.startswith("'''", pos):
        m = _ML_LITERAL.match(text, pos)
    elif text[pos] == '"':
        m = _BASIC.match(text, pos)
    else:
        m = _LITERAL.match(text, pos)
    if m is not None:
        return m.end()
    if text.startswith(('"""', "'''"), pos):
        return len(text)
    nl = text.find("\n", pos)
    return len(text) if nl < 0 else nl


def _too_deep(file: str, text: str, pos: int, what: str) -> ConfigError:
    line = text.count("\n", 0, pos) + 1
    return ConfigError(file, f"{what} (at line {line}); refused before parsing")


def check_shape(text: str, file: str) -> None:
    """A ConfigError naming *file* and the line when *text* nests deeper than
    :data:`MAX_NESTING` or has a key of more than :data:`MAX_KEY_DOTS` dots."""
    depth = dots = pos = 0
    search = _TOKEN.search
    while (m := search(text, pos)) is not None:
        c = m.group()
        pos = m.end()
        if c == ".":
            dots += 1
            if dots > MAX_KEY_DOTS:
                raise _too_deep(file, text, pos, f"a key of more than {MAX_KEY_DOTS + 1} parts")
            continue
        if c == "#":
            nl = text.find("\n", pos)
            pos = len(text) if nl < 0 else nl
            continue
        if c in "\"'":
            pos = _string_end(text, pos - 1)
            continue
        dots = 0
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise _too_deep(
                    file, text, pos, f"nested deeper than {MAX_NESTING} arrays or tables"
                )
        elif c in "]}" and depth:
            depth -= 1
