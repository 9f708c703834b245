"""Without PyTorch, the torch input says which extra to install, in one line (issue 53,
finding 19): ``RemoteTorchDataset`` and ``CudaPrefetcher`` raised a bare
``ModuleNotFoundError: No module named 'torch'``, where the shard readers name their extra.

PyTorch is installed where these tests run, so each case runs in a subprocess whose
``sys.meta_path`` starts with a finder that refuses ``torch`` (and its submodules) as an
absent package would: a real interpreter importing the real modules, PyTorch alone taken
away.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

MESSAGE = "PyTorch is not installed: pip install 'feedline[torch]'"

# Installed before anything is imported: torch (and torch.*) is "not installed".
BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("statement", [
    "from feedline import RemoteTorchDataset",
    "from feedline.consumer import RemoteTorchDataset",
    "from feedline import CudaPrefetcher",
    "import feedline.consumer.torch_prefetch",
    "from feedline import to_torch",
])
def test_without_torch_the_error_names_the_extra(statement: str) -> None:
    r = without_torch(f"""
try:
    {statement}
except ImportError as e:  # still an ImportError: optional imports keep working
    print(type(e).__name__, e.name, isinstance(e, ModuleNotFoundError), str(e), sep="|")
else:
    print("imported")
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"TorchMissing|torch|True|{MESSAGE}"


def test_without_torch_the_uncaught_error_ends_in_that_one_line() -> None:
    """What a user's script shows: the last line is the message, no chained "No module
    named 'torch'" traceback above it; the rest of the consumer side imports as before."""
    r = without_torch("import feedline\nfrom feedline import RemoteDataZMQ\n"
                      "print('remote ok', flush=True)\nfeedline.RemoteTorchDataset\n")
    assert r.returncode == 1 and r.stdout == "remote ok\n"
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == f"feedline.consumer.torch_extra.TorchMissing: {MESSAGE}", r.stderr
    assert "No module named 'torch'" not in r.stderr and "During handling" not in r.stderr
