# shared fixtures
import importlib.util
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def shards():
    """The data/shards.py module, imported by path (data/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("shards", REPO_ROOT / "data" / "shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
