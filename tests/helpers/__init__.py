"""Test helpers (importable as `helpers.*`: tests/ is put on sys.path by tests/conftest.py)."""
