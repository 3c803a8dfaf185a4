"""The ``eagle3fn`` command: thin tyro entry points over the library (no logic here)."""
