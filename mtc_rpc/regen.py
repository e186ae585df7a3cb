"""Regenerate the gRPC/protobuf stubs in ``mtc_rpc/`` from every ``proto/*.proto`` (``python -m mtc_rpc.regen``).

protoc writes ``import peer_pb2 as peer__pb2``, which only works with ``mtc_rpc/`` on ``sys.path``;
we rewrite such imports of sibling generated modules to ``from mtc_rpc import peer_pb2 as peer__pb2``.
The output is a pure function of the .proto sources and the pinned grpcio-tools, so
``tests/test_proto_regen.py`` can regenerate into a temporary directory and demand no diff.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

PACKAGE = "mtc_rpc"
REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = REPO_ROOT / PACKAGE
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

# `import foo_pb2 as foo__pb2` (in *_pb2.py and *_pb2_grpc.py) and `import foo_pb2 as _foo_pb2` (*.pyi).
_IMPORT_RE = re.compile(r"^import (?P<mod>[A-Za-z_][A-Za-z0-9_]*_pb2) as (?P<alias>\w+)$", re.MULTILINE)
# `from foo_pb2 import Bar as _Bar` (*.pyi).
_FROM_RE = re.compile(r"^from (?P<mod>[A-Za-z_][A-Za-z0-9_]*_pb2) import ", re.MULTILINE)


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Every .proto source, sorted so the run is deterministic."""
    return sorted(Path(proto_dir).glob("*.proto"))


def is_generated(name: str) -> bool:
    return name.endswith(GENERATED_SUFFIXES)


def _fix_imports(text: str, local_modules: set[str]) -> str:
    def repl_import(m: re.Match[str]) -> str:
        if m["mod"] not in local_modules:
            return m.group(0)
        return f"from {PACKAGE} import {m['mod']} as {m['alias']}"

    def repl_from(m: re.Match[str]) -> str:
        if m["mod"] not in local_modules:
            return m.group(0)
        return f"from {PACKAGE}.{m['mod']} import "

    return _FROM_RE.sub(repl_from, _IMPORT_RE.sub(repl_import, text))


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every proto in ``proto_dir`` into ``out_dir``; returns the generated files (sorted).

    Generated files in ``out_dir`` that no longer correspond to a .proto are removed; nothing else in
    ``out_dir`` is touched. Raises RuntimeError when protoc fails (and then changes nothing).
    """
    from grpc_tools import protoc

    protos = proto_files(proto_dir)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mtc-regen-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(p.name for p in protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} for {[p.name for p in protos]}")
        produced = sorted(p for p in Path(tmp).iterdir() if is_generated(p.name))
        local_modules = {p.name[: -len(".py")] for p in produced if p.name.endswith("_pb2.py")}
        written = []
        for src in produced:
            text = _fix_imports(src.read_text(), local_modules)
            dst = out_dir / src.name
            if not dst.exists() or dst.read_text() != text:
                dst.write_text(text)
            written.append(dst)
    keep = {p.name for p in written}
    for stale in out_dir.iterdir():
        if is_generated(stale.name) and stale.name not in keep:
            stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (default: mtc_rpc/)")
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR)
    args = parser.parse_args(argv)
    try:
        written = generate(args.out, args.proto_dir)
    except RuntimeError as e:
        print(f"regen: {e}", file=sys.stderr)
        return 1
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
