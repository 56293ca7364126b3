"""Make hal-core, hal-cpu, hal-cupy and hal-cuda importable and discoverable on a machine without network or hatchling.

Writes a ``<name>-<version>.dist-info`` (METADATA, entry_points.txt, RECORD)
for each distribution into SITE, read from its pyproject.toml, and a
``hal-src.pth`` naming the four source folders. With SITE and those folders
on ``PYTHONPATH`` (what gpu_check.sh does), or with SITE a site-packages
folder (whose ``.pth`` files Python reads), ``import hal_core`` works and
``importlib.metadata`` finds the ``hal`` entry points and the ``hal`` command as
after ``pip install -e``: no hatchling, no network. Only the standard
library is used (Python >= 3.11).

Usage: ``python benchmarks/offline_install.py SITE``
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: (project folder, import package folder)
PROJECTS = ((ROOT, ROOT / "src"), (ROOT / "plugins" / "hal_cpu", ROOT / "plugins" / "hal_cpu" / "src"),
            (ROOT / "plugins" / "hal_cupy", ROOT / "plugins" / "hal_cupy" / "src"),
            (ROOT / "plugins" / "hal_cuda", ROOT / "plugins" / "hal_cuda" / "src"))


def _version(project: Path, config: dict) -> str:
    static = config["project"].get("version")
    if static:
        return static
    tool = config["tool"]
    if "hatch" in tool:
        path = project / tool["hatch"]["version"]["path"]
    else:  # setuptools: version = {attr = "pkg.module.__version__"}, packages under src/
        module = tool["setuptools"]["dynamic"]["version"]["attr"].rsplit(".", 1)[0]
        path = project / "src" / (module.replace(".", "/") + ".py")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', path.read_text(), re.M)
    if match is None:
        raise SystemExit(f"no __version__ in {path}")
    return match.group(1)


def write_dist_info(project: Path, site: Path) -> str:
    config = tomllib.loads((project / "pyproject.toml").read_text())
    name, version = config["project"]["name"], _version(project, config)
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = dict(config["project"].get("entry-points", {}))
    if "scripts" in config["project"]:
        groups["console_scripts"] = config["project"]["scripts"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (folder / "entry_points.txt").write_text("\n".join(lines))
    (folder / "INSTALLER").write_text("hal offline_install\n")
    (folder / "RECORD").write_text("")
    return f"{name} {version}"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    site = Path(argv[0]).resolve()
    site.mkdir(parents=True, exist_ok=True)
    done = [write_dist_info(project, site) for project, _ in PROJECTS if (project / "pyproject.toml").is_file()]
    (site / "hal-src.pth").write_text("\n".join(str(src) for _, src in PROJECTS) + "\n")
    print(f"offline_install: {', '.join(done)} -> {site}")


if __name__ == "__main__":
    main(sys.argv[1:])
