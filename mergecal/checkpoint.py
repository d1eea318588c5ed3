"""safetensors checkpoints: lazy reading (single file or sharded ``*.index.json``) and atomic writing.

A ``TensorSource`` exposes key names, shapes and dtypes from metadata and loads one tensor at a
time, so a merge can walk a 7B-class model key by key without holding whole models in memory.
Nothing here unpickles: safetensors only. Checkpoint directories are written through
``mergecal.outputs.OutputDir``: never over an input or a directory mergecal did not write.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import CheckpointError, OutputError
from .outputs import INDEX_SUFFIX, MARKER, OutputDir, umask  # noqa: F401  (MARKER: re-exported)

# safetensors dtype codes -> torch dtypes (what safe_open's get_slice().get_dtype() reports)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def convert_hint(path: Path) -> str:
    """A one-line conversion of a pickled state dict to safetensors, loading tensors only."""
    out = path.with_suffix(".safetensors")
    return (f"convert it with: python -c \"import torch; from safetensors.torch import save_file; "
            f"save_file({{k: v.contiguous() for k, v in torch.load('{path}', weights_only=True).items()}}, '{out}')\"")


_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def input_kind(path: Path, missing: str | None = None) -> str:
    """``"dir"`` or ``"file"`` for an input path (symlinks followed), from its ``stat`` alone; a one-line
    CheckpointError for a path that is missing (the message ``missing``), unreachable, or not a regular file: a FIFO,
    device or socket is refused before anything opens it (opening a FIFO waits for a writer, so the merge would
    hang)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(missing or f"{path}: checkpoint not found") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied (a directory on its path cannot be searched by this "
                              "user)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    kind = next((name for test, name in _SPECIAL_FILES if test(mode)), "not a regular file")
    raise CheckpointError(f"{path}: is {kind}; a checkpoint must be a regular file (or a directory of them)")


def readable_file(path: Path, missing: str | None = None) -> Path:
    """``path`` if it is a regular file this process may read (``input_kind``, then an open that cannot block);
    a one-line CheckpointError otherwise. safetensors reports an unreadable file as "No such file or directory"."""
    if input_kind(path, missing) != "file":
        raise CheckpointError(f"{path}: is a directory, expected a file")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # O_NONBLOCK: even a FIFO swapped in since the stat
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied (the file is not readable by this user)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    return path


def shard_file(index: Path, key: str, shard: str) -> Path:
    """The readable file that ``index``'s weight_map names for ``key``. It must resolve, symlinks followed, inside
    the folder that holds the index: an index may not make a merge read files elsewhere (``../../x``, ``/etc/..``).
    That folder is taken where the index is and where it links to (Hugging Face's cache links an index and its
    shards into one ``blobs/`` folder)."""
    path = index.parent / shard
    real = Path(os.path.realpath(path))
    folders = (Path(os.path.realpath(index.parent)), Path(os.path.realpath(index)).parent)
    if not any(folder in real.parents for folder in folders):
        raise CheckpointError(f"{index}: shard {shard!r} for key {key!r} is not a file inside the index's folder "
                              f"({real}); an index may name only shards beside it")
    return readable_file(path, missing=f"{index}: shard {shard!r} for key {key!r} not found at {path}")


def read_index(path: Path) -> dict[str, Path]:
    """``{key: shard file}`` of a sharded safetensors ``*.index.json``, every shard checked by ``shard_file``."""
    try:
        weight_map = json.loads(readable_file(path).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: not a safetensors index "
                              f"(expected a JSON object with 'weight_map'): {err}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        got = type(weight_map).__name__ if not isinstance(weight_map, dict) else "a non-string shard"
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard files, got {got}")
    return {key: shard_file(path, key, shard) for key, shard in weight_map.items()}


def _cannot_write(output: Path, reason: str) -> OutputError:
    return OutputError(f"{output}: cannot write the output ({reason})")


def _write_reason(err: Exception) -> str:
    """The operating system's words in a safetensors write error ('Error while serializing: I/O error: No space
    left on device (os error 28) at path ...'), else its message."""
    found = re.search(r"\(os error (\d+)\)", str(err))
    return os.strerror(int(found.group(1))) if found else str(err).removeprefix("Error while serializing: ")


def _write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str],
                      output: Path) -> None:
    """``save_file`` into ``path`` with a failure (a full disk, say) as one OutputError naming ``output``, what the
    caller is writing, instead of safetensors' raw error."""
    try:
        save_file(tensors, str(path), metadata=dict(metadata))
        _sort_metadata(path)
        _readable(path)
    except SafetensorError as err:
        raise _cannot_write(output, _write_reason(err)) from None
    except OSError as err:
        raise _cannot_write(output, err.strerror or str(err)) from None


def weights_candidates(directory: Path) -> list[Path]:
    """The files a checkpoint directory's weights may be read from, as HF writes them: ``model.safetensors`` /
    ``model.safetensors.index.json``, else every ``*.index.json``, else every ``*.safetensors`` (one expected)."""
    found = [c for c in (directory / "model.safetensors", directory / f"model.safetensors{INDEX_SUFFIX}") if c.exists()]
    return found or sorted(directory.glob(f"*{INDEX_SUFFIX}")) or sorted(directory.glob("*.safetensors"))


def weights_entry(directory: Path) -> Path:
    """The one safetensors file or index a checkpoint directory is read from (``weights_candidates``)."""
    found = weights_candidates(directory)
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not found and pickles:
        raise CheckpointError(f"{directory}: holds only pickled weights ({pickles[0].name}), and pickled "
                              f"checkpoints are not read (unpickling can run code); {convert_hint(pickles[0])}")
    if len(found) != 1:
        raise CheckpointError(f"{directory}: expected exactly one *.safetensors file or *{INDEX_SUFFIX} in the "
                              f"directory, found {len(found)}")
    return found[0]


def check_safetensors_name(path: Path) -> None:
    """A checkpoint file is read only as safetensors (a pickle is named as such)."""
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickled checkpoints are not read here (unpickling can run code); "
                              f"{convert_hint(path)}")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: expected a .safetensors file or a *{INDEX_SUFFIX}")


def safetensors_files(path: Path) -> list[Path]:
    """Every file ``SafetensorsSource(path)`` reads: the safetensors file, or the index and its shards."""
    entry = weights_entry(path) if path.is_dir() else path
    if entry.name.endswith(INDEX_SUFFIX):
        return [entry, *dict.fromkeys(read_index(entry).values())]
    check_safetensors_name(entry)
    return [entry]


@runtime_checkable
class TensorSource(Protocol):
    """Read-only, key-by-key access to a state dict."""

    name: str

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def get(self, key: str) -> torch.Tensor: ...


class DictSource:
    """A ``TensorSource`` over an in-memory ``{name: tensor}`` mapping (never modified)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], name: str = "state_dict"):
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{name}: key {key!r} holds {type(value).__name__}, expected a torch.Tensor")
        self._tensors = tensors
        self.name = name

    def keys(self) -> list[str]:
        return list(self._tensors.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._tensors[key][start:stop]


class SafetensorsSource:
    """A lazy ``TensorSource`` over a ``.safetensors`` file, a sharded ``*.index.json``, or a directory
    holding either (``model.safetensors`` / ``model.safetensors.index.json``, as HF writes them)."""

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        self.path = Path(path)
        self.name = name or str(self.path)
        self._key_to_file = self._resolve(self.path)
        self._handles: dict[Path, object] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in dict.fromkeys(self._key_to_file.values()):
            handle = self._open(file)
            present = set(handle.keys())
            for key in (k for k, f in self._key_to_file.items() if f == file):
                if key not in present:
                    raise CheckpointError(f"{file}: key {key!r} is listed in the index but missing from the shard")
                tensor_slice = handle.get_slice(key)
                code = tensor_slice.get_dtype()
                if code not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{file}: key {key!r} has unsupported dtype {code}")
                self._meta[key] = (tuple(tensor_slice.get_shape()), _SAFETENSORS_DTYPES[code])

    @staticmethod
    def _resolve(path: Path) -> dict[str, Path]:
        if input_kind(path) == "dir":
            try:
                os.listdir(path)
            except PermissionError:
                raise CheckpointError(f"{path}: permission denied (the directory cannot be listed by this "
                                      "user)") from None
            path = weights_entry(path)
        readable_file(path)
        if path.name.endswith(INDEX_SUFFIX):
            return read_index(path)
        check_safetensors_name(path)
        handle = SafetensorsSource._open_file(path)
        return {key: path for key in handle.keys()}

    @staticmethod
    def _open_file(path: Path):
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from None

    def _open(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open_file(path)
        return self._handles[path]

    def keys(self) -> list[str]:
        return list(self._key_to_file)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][1]

    def get(self, key: str) -> torch.Tensor:
        return self._open(self._key_to_file[key]).get_tensor(key)

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a key (its first dimension), read from the file alone."""
        return self._open(self._key_to_file[key]).get_slice(key)[start:stop]

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the first file (for a sharded checkpoint, of the first shard)."""
        first = next(iter(self._key_to_file.values()), None)
        return (self._open(first).metadata() or {}) if first else {}


def as_source(obj: TensorSource | Mapping[str, torch.Tensor] | str | os.PathLike,
              name: str | None = None) -> TensorSource:
    """Wrap a mapping or a path as a ``TensorSource`` (sources pass through)."""
    if isinstance(obj, (str, os.PathLike)):
        return SafetensorsSource(obj, name=f"{name} ({obj})" if name else None)
    if isinstance(obj, Mapping):
        return DictSource(obj, name=name or "state_dict")
    if isinstance(obj, TensorSource):
        return obj
    raise CheckpointError(f"{name or 'input'}: expected a state dict, a TensorSource or a path, "
                          f"got {type(obj).__name__}")


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a whole safetensors checkpoint (single or sharded) into memory."""
    source = SafetensorsSource(path)
    return {key: source.get(key) for key in source.keys()}


def _contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _sort_metadata(path: str | os.PathLike) -> None:
    """Rewrite a just-saved file's header with ``__metadata__`` in key order. safetensors 0.8 writes that
    map in a per-process random order (safetensors#584), so the same tensors and metadata would give
    different bytes, and DVC different hashes, from run to run. The header keeps its length (same entries,
    compact JSON, space padding as safetensors pads it), so the tensor data does not move."""
    with open(path, "r+b") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        metadata = header.get("__metadata__")
        if not metadata or len(metadata) < 2:
            return
        header["__metadata__"] = dict(sorted(metadata.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:  # cannot happen for the same entries; never corrupt the file over it
            raise CheckpointError(f"{path}: re-serialized safetensors header is longer than the original")
        fh.seek(8)
        fh.write(text.ljust(length, b" "))


def _readable(path: str | os.PathLike) -> None:
    """safetensors and mkstemp create files 0600; a checkpoint gets the permissions of any new file (umask)."""
    os.chmod(path, 0o666 & ~umask())


def save_state_dict(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                    metadata: Mapping[str, str] | None = None) -> Path:
    """Write one ``.safetensors`` file atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        _write_safetensors({k: _contiguous_cpu(v) for k, v in tensors.items()}, Path(tmp), metadata or {}, path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# safetensors' order of tensors in a file (its ``prepare``, version 0.8): dtypes in this order, then names ascending.
# ``ShardedCheckpointWriter`` lays out its shards the same way, so they equal ``save_file``'s byte for byte (tested).
_FILE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_DTYPE_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
_COPY_CHUNK = 64 * 1024**2


def _safetensors_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """The length-prefixed header ``save_file`` writes for ``(key, dtype code, shape, nbytes)`` entries already in
    file order: compact JSON, ``__metadata__`` first (keys sorted: ``_sort_metadata``; ``{}`` when empty, as
    ``save_file(metadata={})`` writes it), space-padded to 8 bytes."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for key, code, shape, nbytes in entries:
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")
    return struct.pack("<Q", len(text)) + text


def _copy_range(src: int, dst: int, offset: int, count: int) -> None:
    """Copy ``count`` bytes at ``offset`` of file ``src`` to ``dst``'s position: in the kernel where it can
    (``copy_file_range``), else in 64 MB chunks."""
    while count:
        try:
            done = os.copy_file_range(src, dst, min(count, _COPY_CHUNK), offset)
        except (AttributeError, OSError):  # not Linux, or a file system that refuses it: copy through memory
            done = os.write(dst, os.pread(src, min(count, _COPY_CHUNK), offset))
        if done == 0:
            raise OSError(f"short copy at byte {offset}")
        offset, count = offset + done, count - done


class ShardedCheckpointWriter:
    """Write a checkpoint directory tensor by tensor, in shards of at most ``max_shard_bytes``.

    Each tensor's bytes go to the shard's data file as it arrives, so memory holds one tensor, not a shard; a full
    shard is then written in safetensors' layout (header, tensors in its order) by a kernel copy from that file,
    equal byte for byte to ``save_file`` of the same tensors. Output goes to a
    staging directory beside ``out_dir`` that replaces ``out_dir`` only in ``close()``: an interrupted
    write leaves no half-written checkpoint at ``out_dir``. One shard is written as ``model.safetensors``;
    more as ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (HF's layout).
    ``out_dir`` must not hold any of ``inputs``; an existing directory that mergecal did not write is
    replaced only with ``overwrite=True`` (``mergecal.outputs``). Extra files may be put in ``staging``
    after ``finish()`` and before ``close()``.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3,
                 metadata: Mapping[str, str] | None = None, *, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False):
        if max_shard_bytes <= 0:
            raise CheckpointError(f"max_shard_bytes: expected a positive number of bytes, got {max_shard_bytes}")
        if sys.byteorder != "little":  # safetensors stores little-endian bytes; the data file holds memory's
            raise CheckpointError("ShardedCheckpointWriter: writes little-endian machines' tensors only")
        self.max_shard_bytes = max_shard_bytes
        self.metadata = dict(metadata or {})
        self._output = OutputDir(out_dir, inputs=inputs, overwrite=overwrite)
        self.out_dir = self._output.target
        self.staging = self._output.staging
        self._data = None  # the current shard's data file: tensors' bytes in arrival order
        self._entries: list[tuple[str, str, tuple[int, ...], int, int]] = []  # key, code, shape, nbytes, offset
        self._shard_bytes = 0
        self._keys: set[str] = set()
        self._shards: list[tuple[str, list[str]]] = []
        self._total_bytes = 0
        self._finished = False

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _DTYPE_CODES:
            raise CheckpointError(f"key {key!r}: dtype {tensor.dtype} cannot be written to safetensors")
        if key in self._keys:
            raise CheckpointError(f"key {key!r}: written twice to {self.out_dir}")
        self._keys.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if self._entries and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if self._data is None:
            self._data = open(self.staging / f"shard-{len(self._shards):05d}.data", "w+b")
        tensor = _contiguous_cpu(tensor)
        try:
            self._data.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        except OSError as err:  # a full disk, say
            raise _cannot_write(self.out_dir, err.strerror or str(err)) from None
        self._entries.append((key, _DTYPE_CODES[tensor.dtype], tuple(tensor.shape), nbytes, self._shard_bytes))
        self._shard_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        name = f"shard-{len(self._shards):05d}.safetensors"
        entries = sorted(self._entries, key=lambda e: (_FILE_ORDER.index(e[1]), e[0]))
        data = self._data or open(os.devnull, "rb")  # an empty checkpoint: one shard with no tensors
        try:
            data.flush()
            with open(self.staging / name, "wb") as out:
                out.write(_safetensors_header([e[:4] for e in entries], self.metadata))
                out.flush()
                for _, _, _, nbytes, offset in entries:
                    _copy_range(data.fileno(), out.fileno(), offset, nbytes)
            _readable(self.staging / name)
        except OSError as err:
            raise _cannot_write(self.out_dir, err.strerror or str(err)) from None
        finally:
            data.close()
            if self._data is not None:
                os.unlink(data.name)
        self._shards.append((name, [e[0] for e in self._entries]))
        self._data, self._entries, self._shard_bytes = None, [], 0

    def finish(self) -> None:
        """Write the last shard and the index into ``staging`` (``close`` then commits)."""
        if self._finished:
            return
        if self._entries or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.staging / self._shards[0][0], self.staging / "model.safetensors")
        else:
            weight_map = {}
            for i, (name, keys) in enumerate(self._shards, start=1):
                final = f"model-{i:05d}-of-{n:05d}.safetensors"
                os.replace(self.staging / name, self.staging / final)
                weight_map.update(dict.fromkeys(keys, final))
            index = {"metadata": {"total_size": self._total_bytes, **self.metadata}, "weight_map": weight_map}
            (self.staging / f"model.safetensors{INDEX_SUFFIX}").write_text(json.dumps(index, indent=2))
        self._finished = True

    def close(self) -> Path:
        try:
            self.finish()
        except OSError as err:  # the index on a full disk, say
            self.abort()
            raise _cannot_write(self.out_dir, err.strerror or str(err)) from None
        except BaseException:
            self.abort()
            raise
        return self._output.commit()

    def abort(self) -> None:
        if self._data is not None:
            self._data.close()
        self._output.abort()

    def __enter__(self) -> "ShardedCheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_checkpoint(items: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                    max_shard_bytes: int = 2 * 1024**3, metadata: Mapping[str, str] | None = None, *,
                    inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False) -> Path:
    """Write ``(key, tensor)`` pairs (e.g. a streaming merge) as a (possibly sharded) checkpoint directory.
    ``inputs``: the checkpoints the pairs are read from (the output may not hold them); ``overwrite``: replace
    an existing directory that mergecal did not write (see ``ShardedCheckpointWriter``)."""
    pairs = items.items() if isinstance(items, Mapping) else items
    with ShardedCheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, metadata=metadata, inputs=inputs,
                                 overwrite=overwrite) as writer:
        for key, tensor in pairs:
            writer.add(key, tensor)
    return Path(out_dir)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a text file atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; reports and metadata are meant to be read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
