"""The client end of a connection to a host: the link, the I/O thread shared by
producers and consumers, and the hand-over between that thread and its owner.

It imports the protocol and the kernel's base.
"""
