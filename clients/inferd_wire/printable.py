"""Text made safe to show a person: every character that is not printable is
written as its escape.  The project's one escaping function: ``inferctl`` and
``inferd``'s human output (``inferd_client.cli_format`` re-exports it, DESIGN.md
252) and the daemon's console log lines and journald ``MESSAGE``
(``inferd.supervision.logging``, ``journal_fields``).  It lives here, in the
standard library's reach alone, so that the daemon's logging imports neither
the client library nor what it needs (pyzmq, numpy)."""

from __future__ import annotations


def printable(line: str) -> str:
    """``line`` safe to write to a terminal: a character that is not printable (C0
    and C1 controls, DEL, line separators, bidi and other format characters) is
    shown as its escape, ``\\x1b`` or ``\\u202e``; printable Unicode is kept.  Text
    from the daemon (a model's load error, a client's ``requested_by``, an alert)
    must not move the cursor, retitle the window, write the clipboard (OSC 52) or
    begin a forged line.  The escapes are printable: a second pass changes nothing."""
    if line.isprintable():
        return line
    return "".join(char if char.isprintable() else _escape(char) for char in line)


def printable_lines(text: str) -> str:
    """``printable`` for each line of ``text``, the newlines between them kept: a
    traceback stays lines, and no character in them drives a terminal."""
    return "\n".join(printable(line) for line in text.split("\n"))


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
