"""The wire protocol: bytes from the network turned into objects and back, under
the limits every receiver applies (docs/architecture.md, "The wire protocol").

It imports only the kernel's base (errors, logs).
"""
