"""A checkpoint folder's tensors by name across its safetensors shards, every file confined to the folder
(or, for a Hugging Face cache snapshot, to its repository's ``blobs/``)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import numpy as np

from .._errors import CheckpointError
from ._safetensors import SafetensorsFile

__all__ = ["Tensors"]


class Tensors:
    """``model.safetensors`` or the shards of ``model.safetensors.index.json``; tensors read on demand."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        self._files: dict[str, Path] = {}
        self._opened: dict[Path, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{index}: no readable weight_map ({exc!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is not a JSON object")
            for name, file in weight_map.items():
                self._files[name] = self._confined(file, f"{index}: tensor {name!r} names")
        elif (folder / "model.safetensors").exists():
            single = SafetensorsFile(self._confined("model.safetensors", str(folder)))
            self._files = dict.fromkeys(single, single.path)
            self._opened[single.path] = single
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")

    def _confined(self, file: object, where: str) -> Path:
        """The resolved path of shard ``file``: a file directly in the folder (a symlink may not lead out)."""
        root = self.folder.resolve()
        if not isinstance(file, str) or Path(file).is_absolute() or Path(file).name != file:
            raise CheckpointError(f"{where} {file!r}: a shard must be a file name in {self.folder}")
        path = (self.folder / file).resolve()
        if path.parent != root and not path.is_relative_to(_hub_blobs(root)):
            raise CheckpointError(f"{where} {file!r}, which leads out of {self.folder} (to {path})")
        if not path.is_file():
            raise CheckpointError(f"{where} {file!r}, which is missing from {self.folder}")
        return path

    def drop_pages(self) -> None:
        """:meth:`SafetensorsFile.drop_pages` on every file opened so far."""
        for file in self._opened.values():
            file.drop_pages()

    def has(self, name: str) -> bool:
        return name in self._files

    def _file(self, name: str) -> SafetensorsFile:
        path = self._files.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        if path not in self._opened:
            self._opened[path] = SafetensorsFile(path)
        file = self._opened[path]
        if name not in file:
            raise CheckpointError(f"{path}: tensor {name!r} is missing (the index names this file)")
        return file

    def check(self, name: str, shape: tuple[int, ...], dtypes: Collection[str] = ("F32", "F16", "BF16"),
              layout: str = "") -> None:
        """CheckpointError naming the file and tensor unless its header has ``shape`` and one of ``dtypes``."""
        file = self._file(name)
        found, code = file.shape(name), file.dtype_code(name)
        if found != tuple(shape):
            why = f" ({layout})" if layout else ""
            raise CheckpointError(f"{file.path}: tensor {name!r} has shape {list(found)}, the config gives "
                                  f"{list(shape)}{why}")
        if code not in dtypes:
            raise CheckpointError(f"{file.path}: tensor {name!r} is {code}, expected one of "
                                  f"{', '.join(sorted(dtypes))}")

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor (its pages are read when used)."""
        return self._file(name)[name]


def _hub_blobs(root: Path) -> Path:
    """Where a Hugging Face cache snapshot's files lead: ``models--*/snapshots/<rev>/f`` -> ``models--*/blobs/``
    (the folder itself when ``root`` is no snapshot, so nothing more is allowed)."""
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo / "blobs"
    return root
