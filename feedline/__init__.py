"""feedline's shared kernel: the wire protocol, broker links, configuration and the CLI."""

__version__ = "0.1.0"
