"""The wire contract shared by the daemon and every Python client: header codec,
error codes, dtype rules, tensor frames and default endpoints.  Depends on
msgpack and numpy only (DESIGN.md, "The wire package")."""
