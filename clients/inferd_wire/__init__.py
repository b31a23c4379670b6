"""The wire contract shared by the daemon and every Python client: header codec,
error codes, dtype rules, tensor frames and default endpoints.  ``protocol``
and ``endpoints`` need msgpack and numpy only; ``multipart`` adds pyzmq
(DESIGN.md, "The wire package")."""
