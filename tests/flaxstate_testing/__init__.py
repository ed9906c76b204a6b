"""What the tests share: toy models and data, and workers run as separate processes.

A package with a name of its own (pytest puts `tests/` on the path through
`pythonpath` in pyproject.toml; workers get it through PYTHONPATH).
"""
