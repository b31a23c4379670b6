"""The wire contract shared by the daemon and every Python client: header codec,
error codes, dtype rules, tensor frames and default endpoints.  ``protocol``
and ``endpoints`` need msgpack and numpy only; ``multipart`` adds pyzmq
(DESIGN.md, "The wire package").

``__version__`` is the project's one version (``VERSION`` beside this file; both
distributions, ``inferd`` and ``inferd-client``, take theirs from it)."""

from importlib.resources import files

__version__ = (files(__name__) / "VERSION").read_text(encoding="ascii").strip()
