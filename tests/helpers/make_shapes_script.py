"""scripts/peers/make_shapes.py, loaded as a module by the tests that write its shapes (it is a script)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peers" / "make_shapes.py"


def load_make_shapes() -> ModuleType:
    """A fresh copy of the script's module each call (a test may patch its functions)."""
    spec = importlib.util.spec_from_file_location("make_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name while it runs
    spec.loader.exec_module(module)
    return module
