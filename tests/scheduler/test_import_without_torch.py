import subprocess
import sys


def test_scheduler_imports_with_torch_blocked():
    # sys.modules["torch"] = None makes any "import torch" raise ImportError.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pkgutil, importlib, scheduler\n"
        "names = [m.name for m in pkgutil.walk_packages(scheduler.__path__, 'scheduler.')]\n"
        "assert len(names) >= 8, names\n"
        "[importlib.import_module(n) for n in names]\n"
        "print('ok', len(names))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
