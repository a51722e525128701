"""Shared test helpers (imported as ``support``: tests/ is on sys.path through pytest's rootdir conftest)."""
