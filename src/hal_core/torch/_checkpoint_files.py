"""The files of a checkpoint folder, each resolved inside it, and the tensors they hold, header first.

Every file :func:`~hal_core.torch.load_quantized` reads (``config.json``,
``model.safetensors.index.json``, the ``*.safetensors`` files) is resolved,
symlinks followed, and must land inside the checkpoint folder, or inside the
Hugging Face cache repository folder it belongs to: in
``models--org--name/snapshots/<revision>/`` every file is a symlink to
``../../blobs/<hash>``, so when the folder is such a snapshot, the
``models--org--name/`` folder (the one holding ``snapshots/`` and ``blobs/``)
is inside too. A shard name in the index must be a plain relative name: an
absolute path or a ``..`` is refused before anything is opened. Every file
must be a regular file (a FIFO or a device is refused before it is opened);
a JSON file is at most 64 MiB.

:class:`Tensors` opens the safetensors files and answers each tensor's shape
and dtype from the headers alone (nothing is read), so the loader checks
every tensor against the model before it reads any; :meth:`Tensors.read`
then reads one tensor. Every failure is a :class:`~hal_core.CheckpointError`
naming the file, and the key where there is one.
"""

from __future__ import annotations

import json
import os
import stat
from contextlib import ExitStack
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .._errors import CheckpointError

__all__ = ["INDEX", "Folder", "Tensors"]

INDEX = "model.safetensors.index.json"
_MAX_JSON_BYTES = 64 << 20


class Folder:
    """A checkpoint folder: where its files may resolve to, and its files resolved safely."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.given = Path(path)
        try:
            self.root = self.given.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # missing, unreadable, or a symlink loop
            raise CheckpointError(f"argument 'path': expected a directory holding config.json and "
                                  f"*.safetensors, got {str(path)!r} ({exc})") from exc
        if not self.root.is_dir():
            raise CheckpointError(f"argument 'path': expected a directory holding config.json and *.safetensors, "
                                  f"got {str(path)!r} (not a directory)")
        self.roots = [self.root]
        repo = self.root.parent.parent
        if (self.root.parent.name == "snapshots" and repo.name.startswith("models--")
                and (repo / "blobs").is_dir()):
            self.roots.append(repo)  # the Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<hash>

    def show(self, name: str) -> str:
        """The path of ``name`` as the caller spelled the folder, for messages."""
        return str(self.given / name)

    def has(self, name: str) -> bool:
        """Whether an entry called ``name`` exists in the folder (a dangling or outward symlink counts)."""
        return os.path.lexists(self.given / name)

    def file(self, name: str, source: str = "") -> Path:
        """The resolved path of the regular file ``name``; CheckpointError if it is missing or lies outside.

        ``source`` says where the name came from (an index entry), for messages.
        """
        where = f"{source} names {name!r}: " if source else f"{self.show(name)}: "
        if not _is_plain_relative(name):
            raise CheckpointError(f"{where}expected a file name inside the checkpoint folder {str(self.given)!r} "
                                  f"(no absolute path, no '..')")
        try:
            resolved = (self.root / name).resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{where}no such file in the checkpoint folder, or a broken or looping "
                                  f"symlink ({exc})") from exc
        if not any(resolved.is_relative_to(root) for root in self.roots):
            inside = " or its Hugging Face cache repository" if len(self.roots) > 1 else ""
            raise CheckpointError(f"{where}it resolves to {str(resolved)!r}, outside the checkpoint folder "
                                  f"{str(self.root)!r}{inside}; hal reads only files inside it")
        try:
            mode = resolved.stat().st_mode
        except OSError as exc:
            raise CheckpointError(f"{where}cannot be read ({exc})") from exc
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{where}{str(resolved)!r} is not a regular file")
        return resolved

    def read_json(self, name: str) -> dict[str, Any]:
        """The JSON object in file ``name``; CheckpointError naming the file if it is not one."""
        resolved = self.file(name)
        try:
            size = resolved.stat().st_size
            if size > _MAX_JSON_BYTES:
                raise CheckpointError(f"{self.show(name)}: {size} bytes, more than the {_MAX_JSON_BYTES} a JSON file "
                                      f"of a checkpoint may hold")
            document = json.loads(resolved.read_bytes())
        except OSError as exc:
            raise CheckpointError(f"{self.show(name)}: cannot be read ({exc})") from exc
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{self.show(name)}: not valid JSON ({exc})") from exc
        if not isinstance(document, dict):
            raise CheckpointError(f"{self.show(name)}: expected a JSON object, got {type(document).__name__}")
        return document

    def tensor_files(self) -> tuple[list[tuple[str, Path]], dict[str, str] | None]:
        """The safetensors files to open (name, resolved path), and the index's ``weight_map`` if there is one."""
        if not self.has(INDEX):
            names = sorted(p.name for p in self.root.glob("*.safetensors"))
            if not names:
                raise CheckpointError(f"argument 'path': no *.safetensors file in {str(self.given)!r}")
            return [(name, self.file(name)) for name in names], None
        weight_map = self.read_json(INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{self.show(INDEX)}: weight_map: expected a JSON object of tensor name -> file "
                                  f"name, got {type(weight_map).__name__ if weight_map is not None else 'none'}")
        if not weight_map:
            raise CheckpointError(f"{self.show(INDEX)}: weight_map lists no tensor")
        files: dict[str, Path] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name:
                raise CheckpointError(f"{self.show(INDEX)}: weight_map[{key!r}]: expected a file name, got {name!r}")
            if name not in files:
                files[name] = self.file(name, f"{self.show(INDEX)}: weight_map[{key!r}]")
        return sorted(files.items()), weight_map


def _is_plain_relative(name: str) -> bool:
    """A non-empty relative name with no ``..`` (under POSIX and Windows rules alike) and no NUL."""
    if not name or "\0" in name:
        return False
    paths: tuple[PurePath, ...] = (PurePosixPath(name), PureWindowsPath(name))
    return not any(p.is_absolute() or p.anchor or ".." in p.parts for p in paths)


class Tensors:
    """Every tensor name of a checkpoint and which open file holds it; headers for free, data one tensor at a time."""

    def __init__(self, folder: Folder, stack: ExitStack) -> None:
        from safetensors import SafetensorError, safe_open

        files, weight_map = folder.tensor_files()
        self.where: dict[str, tuple[str, Any]] = {}
        for name, path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                keys = list(handle.keys())
            except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as exc:
                raise CheckpointError(f"{folder.show(name)}: not a readable safetensors file "
                                      f"({type(exc).__name__}: {exc})") from exc
            for key in keys:
                if key in self.where:
                    raise CheckpointError(f"tensor {key!r} is stored twice: in {folder.show(self.where[key][0])} "
                                          f"and in {folder.show(name)}")
                self.where[key] = (name, handle)
        for key, name in (weight_map or {}).items():
            if self.where.get(key, (None,))[0] != name:
                raise CheckpointError(f"{folder.show(INDEX)}: weight_map[{key!r}] names {name!r}, but "
                                      f"{folder.show(name)} does not hold {key!r}")
        self.folder = folder
        #: The resolved paths of the files read (as ``/proc/self/maps`` names their mappings).
        self.paths = {str(Path(path).resolve()) for _, path in files}
        self._errors = (SafetensorError, OSError, RuntimeError, ValueError, TypeError)  # what a read may raise
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def show(self, key: str) -> str:
        """``key`` and the file holding it, for messages."""
        return f"{key!r} in {self.folder.show(self.where[key][0])}"

    def header(self, key: str) -> tuple[tuple[int, ...], str]:
        """The stored shape and safetensors dtype (``"I32"``, ``"F16"``, ...) of ``key``, read from the header only."""
        try:
            view = self.where[key][1].get_slice(key)
            return tuple(int(d) for d in view.get_shape()), str(view.get_dtype())
        except self._errors as exc:
            raise CheckpointError(f"{self.show(key)}: cannot read its header ({type(exc).__name__}: {exc})") from exc

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (its data read now)."""
        self.used.add(key)
        try:
            return self.where[key][1].get_tensor(key)
        except self._errors as exc:
            raise CheckpointError(f"{self.show(key)}: cannot be read ({type(exc).__name__}: {exc})") from exc
