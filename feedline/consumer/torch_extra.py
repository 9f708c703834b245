"""The ``torch`` extra's absence, said in one line naming the extra.

``feedline.consumer.torch_input`` and ``torch_prefetch`` import PyTorch at their top; where it
is not installed they raise :class:`TorchMissing` ("PyTorch is not installed: pip install
'feedline[torch]'"), as the shard readers name their own extras, rather than the bare
``ModuleNotFoundError: No module named 'torch'``. It is still a ``ModuleNotFoundError`` (its
``name`` is ``'torch'``), so ``except ImportError`` around an optional import keeps working.
"""

from __future__ import annotations

from feedline.errors import Unavailable

MESSAGE = "PyTorch is not installed: pip install 'feedline[torch]'"


class TorchMissing(Unavailable, ModuleNotFoundError):
    """PyTorch cannot be imported; the message says which extra installs it."""

    def __init__(self) -> None:
        super().__init__(MESSAGE)
        self.name = "torch"


def is_torch_missing(e: ModuleNotFoundError) -> bool:
    """Whether ``e`` is PyTorch itself missing (not a module PyTorch or feedline lacks, whose
    own error says more than ours would)."""
    return (e.name or "").split(".")[0] == "torch"
