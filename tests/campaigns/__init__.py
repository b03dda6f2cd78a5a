"""The reliability campaigns: seeded fault-injection runs against the checkpoint protocol.

tests/campaigns/harness.py runs them (and says how); one module per campaign. Imported as
`campaigns.*`, with tests/ on sys.path (tests/conftest.py puts it there), like `helpers.*`.
"""
