"""CURVE key pairs for a broker and its peers, written as `feedline keys generate` writes them."""


from __future__ import annotations

from pathlib import Path

from feedline import security


class Keys:
    """A broker key pair, allowed producer and consumer keys, and a stranger's key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.allowed = root / "allowed"
        self.files: dict[str, tuple[Path, Path]] = {}
        for name in ("broker", "producer", "consumer", "stranger"):
            self.files[name] = security.generate_keypair(root / name, name)
        self.allowed.mkdir()
        for name in ("producer", "consumer"):
            pub = self.files[name][0]
            (self.allowed / pub.name).write_bytes(pub.read_bytes())

    def server(self) -> security.ServerKeys:
        return security.ServerKeys.load(self.files["broker"][1], self.allowed)

    def client(self, name: str) -> security.ClientKeys:
        return security.ClientKeys.load(self.files[name][1], self.files["broker"][0])
