"""Discovery's entry-point reader agrees with importlib.metadata, which it replaces at start-up."""

from __future__ import annotations

import importlib
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from hal_core._entry_points import entry_points


def _reference(group: str) -> list[tuple[str, str, str, str]]:
    """Independent: what importlib.metadata reports for ``group`` (name, value, distribution, version)."""
    return sorted((ep.name, ep.value, ep.dist.metadata["Name"], ep.dist.version)
                  for ep in metadata.entry_points(group=group))


def _ours(group: str) -> list[tuple[str, str, str, str]]:
    return sorted((ep.name, ep.value, ep.distribution, ep.version) for ep in entry_points(group))


def _groups() -> set[str]:
    return {ep.group for dist in metadata.distributions() for ep in dist.entry_points}


def test_every_group_of_this_environment_reads_the_same() -> None:
    """Each entry-point group of every installed distribution: the same entries, names and versions."""
    groups = _groups() | {"hal"}
    assert "hal" in groups and "console_scripts" in groups
    for group in sorted(groups):
        assert _ours(group) == _reference(group), group


def _dist(site: Path, folder: str, name: str, version: str, entry_points_text: str, *, egg: bool = False) -> None:
    info = site / folder
    info.mkdir()
    (info / ("PKG-INFO" if egg else "METADATA")).write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\nName: not-a-header\n")
    (info / "entry_points.txt").write_text(entry_points_text)


def test_folders_eggs_comments_duplicates_and_zips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dist-info and egg-info folders, comments, other groups, a shadowed duplicate later on the path, a zip."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _dist(first, "hal_reader_a-1.0.dist-info", "hal-reader-a", "1.0",
          "# a comment\n[console_scripts]\nx = y:z\n\n[hal]\nreader_a = hal_reader_a._plugin\n"
          "reader_a2 = hal_reader_a.sub:hook.attr [extra]\n")
    _dist(first, "hal_reader_b.egg-info", "hal_reader_b", "2.0", "[hal]\nreader_b=hal_reader_b\n", egg=True)
    _dist(second, "hal_reader_a-0.9.dist-info", "hal-reader-a", "0.9", "[hal]\nshadowed = hal_reader_a_old\n")
    archive = tmp_path / "bundle.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.writestr("hal_reader_z-3.0.dist-info/METADATA",
                        "Metadata-Version: 2.1\nName: hal-reader-z\nVersion: 3.0\n")
        bundle.writestr("hal_reader_z-3.0.dist-info/entry_points.txt", "[hal]\nreader_z = hal_reader_z\n")
    for entry in (archive, second, first):  # first ends up first on sys.path
        monkeypatch.syspath_prepend(str(entry))
    importlib.invalidate_caches()
    ours = [row for row in _ours("hal") if "reader" in row[0] or "shadowed" in row[0]]
    assert ours == [
        ("reader_a", "hal_reader_a._plugin", "hal-reader-a", "1.0"),
        ("reader_a2", "hal_reader_a.sub:hook.attr [extra]", "hal-reader-a", "1.0"),
        ("reader_b", "hal_reader_b", "hal_reader_b", "2.0"),
        ("reader_z", "hal_reader_z", "hal-reader-z", "3.0"),
    ]
    assert _ours("hal") == _reference("hal")


def test_load_imports_the_module_and_walks_the_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``module:attr.attr`` resolves like importlib.metadata's EntryPoint.load; a malformed value is an error."""
    (tmp_path / "hal_reader_mod.py").write_text("class Hook:\n    attr = 42\n")
    _dist(tmp_path, "hal_reader_mod-1.0.dist-info", "hal-reader-mod", "1.0",
          "[hal]\nwhole = hal_reader_mod\npart = hal_reader_mod:Hook.attr\nbad = not a value\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        found = {ep.name: ep for ep in entry_points("hal") if ep.distribution == "hal-reader-mod"}
        assert found["whole"].load() is sys.modules["hal_reader_mod"]
        assert found["part"].load() == 42
        with pytest.raises(ValueError, match="bad"):
            found["bad"].load()
    finally:
        sys.modules.pop("hal_reader_mod", None)
