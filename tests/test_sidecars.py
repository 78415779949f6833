"""Gzip sidecars: made for every compressible file, reused only for bytes already published."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from conftest import build_module

build = build_module()


def test_a_sidecar_is_reused_only_when_the_bytes_are_the_same(tmp_path: Path):
    old, stage = tmp_path / "old", tmp_path / "stage"
    for d in (old, stage):
        d.mkdir()
    (old / "same.html").write_text("<p>same</p>")
    (old / "same.html.gz").write_bytes(b"the published sidecar")  # marks where it came from
    (old / "changed.html").write_text("<p>before</p>")
    (old / "changed.html.gz").write_bytes(b"stale")
    (stage / "same.html").write_text("<p>same</p>")
    (stage / "changed.html").write_text("<p>after</p>")
    (stage / "new.css").write_text("p { color: red }")
    link = tmp_path / "public"
    os.symlink(old, link)
    build.write_gzip_sidecars(stage, link)
    assert (stage / "same.html.gz").read_bytes() == b"the published sidecar"
    assert gzip.decompress((stage / "changed.html.gz").read_bytes()) == b"<p>after</p>"
    assert gzip.decompress((stage / "new.css.gz").read_bytes()) == b"p { color: red }"


def test_without_a_published_build_every_sidecar_is_made(tmp_path: Path):
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.html").write_text("<p>a</p>")
    build.write_gzip_sidecars(stage, tmp_path / "public")
    assert gzip.decompress((stage / "a.html.gz").read_bytes()) == b"<p>a</p>"
