"""Helpers shared by the test folders (tests/unit, tests/integration): tiny checkpoints, the transformers
reference, the API tests' cluster. Imported as `support.<module>`: tests/ is on sys.path because the root
conftest (tests/conftest.py) sits in a folder without __init__.py (pytest's default prepend import mode)."""
