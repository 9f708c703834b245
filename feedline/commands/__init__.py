"""The ``feedline`` command line and the commands that use several components at once.

This package sits on top of the others: it imports ``broker``, ``producer``, ``consumer`` and
the kernel ``feedline``; nothing imports it. ``main.py`` is the table of subcommands; each
component keeps its own command next to its code (``broker/cli.py``, ``producer/cli.py``,
``consumer/drain.py``, ...), and the commands that span components live here (``demo``,
``top``).
"""
