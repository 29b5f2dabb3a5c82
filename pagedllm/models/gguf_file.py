"""A GGUF file's metadata and tensors, read the way the loader needs them.

``gguf.GGUFReader`` builds a numpy view for every element of every array in
the metadata: on the default model's 49,152-token vocabulary and its merges
that is 2.6 s of an engine's 4.4 s start. The loader reads scalars, strings
and the vocabulary's length, never the strings themselves, so this reader
parses the same header with ``struct`` and skips arrays of strings, keeping
their lengths. Tensors are views of one read-only memory map, shaped and
typed as ``GGUFReader`` shapes them (tests/test_gguf_file.py checks both
against it, field by field and byte by byte).

Versions 2 and 3 of the format (little-endian). Anything else, or a file cut
short, is a :class:`~pagedllm.errors.ModelLoadError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.errors import ModelLoadError

# value types, numbered as the format numbers them: struct codes of the scalars; 8 string, 9 array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# tensor types GGUFReader hands out as typed arrays; the rest (quantized, bf16) as bytes
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class UnreadArray:
    """An array the reader skipped (of strings, or of arrays): only its length is kept."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class GGUFTensor:
    """One tensor: its GGUF name, type (``gguf.GGMLQuantizationType``), dims in GGUF order
    (``ne[0]`` first) and data (a view of the file's memory map)."""

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


class GGUFFile:
    """``fields``: metadata key -> Python scalar, str, list (arrays of scalars) or
    :class:`UnreadArray`; ``tensors``: :class:`GGUFTensor` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._data = np.memmap(self.path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        self._buffer = memoryview(self._data)
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, KeyError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc!r}") from exc

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self._buffer, self._at)
        self._at += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        if self._at + n > len(self._buffer):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self._buffer[self._at : self._at + n]).decode("utf-8")
        self._at += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("IQ")
            if item in SCALARS:
                size = struct.calcsize("<" + SCALARS[item])
                if self._at + count * size > len(self._buffer):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self._buffer, dtype="<" + SCALARS[item], count=count, offset=self._at)
                self._at += count * size
                return values.tolist()
            for _ in range(count):
                self._skip(item)
            return UnreadArray(count)
        raise ValueError(f"unknown GGUF value type {kind}")

    def _skip(self, kind: int) -> None:
        if kind == STRING:  # no decoding
            (n,) = self._unpack("Q")
            self._at += n
        else:
            self._value(kind)

    def _parse(self) -> None:
        import gguf

        self._at = 0
        magic, version = self._unpack("4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ModelLoadError(f"{self.path} is not a GGUF file of version 2 or 3")
        num_tensors, num_kv = self._unpack("QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (kind,) = self._unpack("I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            kind, offset = self._unpack("IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims)) if dims else 1
            nbytes = count // block * type_size
            begin = start + offset
            if begin + nbytes > len(self._data):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = self._data[begin : begin + nbytes]
            np_dims = tuple(int(d) for d in reversed(dims))
            if kind in _TYPED:
                data = raw.view(_TYPED[kind]).reshape(np_dims)
            else:  # bytes, one row of blocks per row of the tensor
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data))
