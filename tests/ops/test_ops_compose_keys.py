"""The key files ``docker compose up`` needs are the ones the docs' commands make (issue 53,
finding 19): the compose walk-through did not say which key files ``up`` reads, the README's
``feedline keys generate`` commands make other names (``data-1``, no ``producer``), and the
public ``broker.key`` and ``allowed/`` were short-syntax binds, for which Docker makes an
empty directory where the file is missing instead of stopping ``up``.

Here docs/operations.md's key block is run as its commands say (real ``feedline keys
generate``, ``mkdir``, ``cp``; only ``sudo chown`` is left out: it needs root, and the owner
is not what is checked), in a scratch directory, and every key path docker-compose.yml mounts
(read from the file itself, no Docker needed) must then exist, as a file where compose mounts
a secret, with the clients' public keys in ``allowed/``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.doc_support import ROOT, blocks, commands, shell_lines
from tests.support.ops_support import COMPOSE, COMPOSE_PRODUCERS

KEYS_VAR = re.compile(r"\$\{FEEDLINE_KEYS:-\./keys\}")


def key_block() -> list[list[str]]:
    """The commands of docs/operations.md's block that makes the compose keys."""
    found = [b for b in blocks(ROOT / "docs" / "operations.md")
             if "feedline keys generate keys" in b.code and "docker compose" not in b.code
             and "kubectl" not in b.code]
    assert len(found) == 1, [b.where for b in found]
    return [argv for line in shell_lines(found[0].code) for argv in commands(line)]


def generated_names(argvs: list[list[str]]) -> dict[str, str]:
    """name -> directory, for each ``feedline keys generate DIR --name NAME``."""
    out = {}
    for argv in argvs:
        if argv[:3] == ["feedline", "keys", "generate"]:
            out[argv[argv.index("--name") + 1]] = argv[3]
    return out


def key_mounts(compose: Path) -> tuple[dict[str, str], list[Any]]:
    """The compose file's secrets (source name -> file, relative to the project) and its
    volumes that come from FEEDLINE_KEYS, with ``${FEEDLINE_KEYS:-./keys}`` as ``keys``."""
    cfg = yaml.safe_load(compose.read_text())
    secrets = {name: KEYS_VAR.sub("keys", s["file"]) for name, s in cfg["secrets"].items()}
    volumes = [v for svc in cfg["services"].values() for v in svc.get("volumes", [])
               if KEYS_VAR.search(v if isinstance(v, str) else v.get("source", ""))]
    return secrets, volumes


def run_commands(argvs: list[list[str]], cwd: Path) -> None:
    for argv in argvs:
        if argv[0] == "sudo":  # chown to the image's uid: needs root (see the docstring)
            assert argv[1] == "chown", argv
            continue
        assert argv[0] in ("feedline", "mkdir", "cp"), f"the test does not run {argv}"
        if argv[0] == "feedline":
            argv = [sys.executable, "-m", "feedline.commands", *argv[1:]]
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (argv, r.stderr)


def test_the_walkthrough_makes_every_key_file_docker_compose_mounts(tmp_path: Path) -> None:
    argvs = key_block()
    run_commands(argvs, tmp_path)
    secrets, volumes = key_mounts(COMPOSE)
    assert secrets, "docker-compose.yml mounts no key"
    for name, file in secrets.items():
        assert (tmp_path / file).is_file(), f"secret {name}: {file} is not made by the docs"
    for v in volumes:
        # A short-syntax bind would have Docker make an empty directory for a missing key.
        assert isinstance(v, dict) and v["type"] == "bind" and v["read_only"], v
        assert (tmp_path / KEYS_VAR.sub("keys", v["source"])).is_dir(), v
    # The broker accepts every client whose secret compose mounts: its public key is there.
    allowed = tmp_path / "keys" / "allowed"
    for file in secrets.values():
        if file.endswith(".key_secret") and Path(file).stem != "broker":
            public = Path(file).with_suffix(".key").name
            assert (allowed / public).read_bytes() == (tmp_path / "keys" / public).read_bytes()


def test_the_walkthrough_names_agree_with_the_readme() -> None:
    """The pairs the README makes (``broker``, ``trainer``) are made under the same names and
    directory by the compose walk-through, and docker-compose.yml mounts those names."""
    readme = [argv for b in blocks(ROOT / "README.md") for line in shell_lines(b.code)
              for argv in commands(line)]
    theirs, ours = generated_names(readme), generated_names(key_block())
    shared = set(theirs) & set(ours)
    assert {"broker", "trainer"} <= shared
    assert all(theirs[n] == ours[n] == "keys" for n in shared)
    secrets, _ = key_mounts(COMPOSE)
    assert {f"keys/{n}.key_secret" for n in ("broker", "trainer")} <= set(secrets.values())


def test_the_data_machine_file_mounts_its_keys_as_secrets() -> None:
    """docker-compose.producers.yml: the producer's secret and the broker's public key are
    compose secrets (a missing one stops `up`), nothing from FEEDLINE_KEYS a bare bind."""
    secrets, volumes = key_mounts(COMPOSE_PRODUCERS)
    assert sorted(secrets.values()) == ["keys/broker.key", "keys/producer.key_secret"]
    assert volumes == []
