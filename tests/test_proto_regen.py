"""Regenerating the gRPC stubs from proto/ must reproduce the committed files in mtc_rpc/ exactly."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from mtc_rpc import regen


def test_regen_matches_committed(tmp_path: Path) -> None:
    written = regen.generate(tmp_path)
    fresh = {p.name: p.read_text() for p in written}
    committed = {p.name: p.read_text() for p in regen.OUT_DIR.iterdir() if regen.is_generated(p.name)}
    expected = {p.stem for p in regen.proto_files()}
    assert {n.split("_pb2")[0] for n in fresh} == expected
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `python -m mtc_rpc.regen`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], f"stubs out of date, run `python -m mtc_rpc.regen`: {stale}"


def test_generated_imports_are_package_relative() -> None:
    for path in regen.OUT_DIR.iterdir():
        if not regen.is_generated(path.name):
            continue
        for line in path.read_text().splitlines():
            if line.startswith("import ") and "_pb2" in line:
                pytest.fail(f"{path.name}: top-level import of a generated module: {line!r}")
        if path.suffix == ".py":
            importlib.import_module(f"mtc_rpc.{path.stem}")


def test_regen_rewrites_cross_proto_imports_and_prunes_stale(tmp_path: Path) -> None:
    protos, out = tmp_path / "p", tmp_path / "o"
    protos.mkdir()
    out.mkdir()
    (protos / "a.proto").write_text('syntax = "proto3"; package mtc.v1; message A { int64 x = 1; }\n')
    (protos / "b.proto").write_text(
        'syntax = "proto3"; package mtc.v1; import "a.proto";\n'
        "message B { A a = 1; }\nservice T { rpc G(B) returns (A); }\n"
    )
    (out / "gone_pb2.py").write_text("# stale\n")
    (out / "keep.py").write_text("# not generated\n")
    regen.generate(out, protos)
    assert "from mtc_rpc import a_pb2 as a__pb2" in (out / "b_pb2.py").read_text()
    assert "from mtc_rpc import a_pb2 as a__pb2" in (out / "b_pb2_grpc.py").read_text()
    assert not (out / "gone_pb2.py").exists()
    assert (out / "keep.py").exists()
    first = {p.name: p.read_text() for p in out.iterdir()}
    regen.generate(out, protos)
    assert {p.name: p.read_text() for p in out.iterdir()} == first


def test_regen_bad_proto_raises_and_changes_nothing(tmp_path: Path) -> None:
    protos, out = tmp_path / "p", tmp_path / "o"
    protos.mkdir()
    out.mkdir()
    (protos / "bad.proto").write_text('syntax = "proto3"; message {')
    with pytest.raises(RuntimeError, match="protoc failed"):
        regen.generate(out, protos)
    assert list(out.iterdir()) == []


def test_proto_dir_is_not_a_package() -> None:
    # A package named `proto` would shadow proto-plus, which google-cloud-storage imports as `proto`.
    assert not (regen.PROTO_DIR / "__init__.py").exists()
