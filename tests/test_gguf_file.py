"""pagedllm's GGUF reader against the gguf package's own GGUFReader: the same fields (strings
arrays by length), the same tensors (names, types, dims, dtypes, shapes and bytes), on the
default model and on a written file with every value type, float and quantized tensors and
a custom alignment; a file that is not GGUF, or is cut short, is a ModelLoadError."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.errors import ModelLoadError
from pagedllm.models.gguf_file import GGUFFile, UnreadArray
from pagedllm.models.paths import default_model_path


def _reader_value(field):
    from gguf import GGUFValueType

    def one(part, value_type):
        return bytes(part).decode("utf-8") if value_type == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _assert_same_as_gguf_reader(path) -> GGUFFile:
    import gguf

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        field, value = theirs.fields[key], ours.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[1] == gguf.GGUFValueType.STRING:
            assert value == UnreadArray(len(field.data)), key
        elif field.types[0] == gguf.GGUFValueType.ARRAY and field.types[1] == gguf.GGUFValueType.ARRAY:
            assert isinstance(value, UnreadArray), key  # the reader's data lists the leaves: no outer count
        else:
            assert value == _reader_value(field), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == want.tensor_type and np.array_equal(mine.shape, want.shape), want.name
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape, want.name
        assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(want.data).view(np.uint8)), want.name
    return ours


def test_the_default_model_reads_as_the_gguf_package_reads_it():
    ours = _assert_same_as_gguf_reader(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.tensors) > 200


def _written(path, alignment: int | None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_array("a.strings", ["x", "yz", ""])
    writer.add_array("a.nested", [[1, 2], [3]])
    writer.add_array("a.floats", [0.5, -1.25, 3.0])
    for i, (add, value) in enumerate([
        (writer.add_uint8, 7), (writer.add_int8, -7), (writer.add_uint16, 700), (writer.add_int16, -700),
        (writer.add_uint32, 70000), (writer.add_int32, -70000), (writer.add_float32, 0.1), (writer.add_bool, True),
        (writer.add_uint64, 2**40), (writer.add_int64, -(2**40)), (writer.add_float64, 0.1),
        (writer.add_string, "naïve text"),
    ]):
        add(f"s.{i}", value)
    gen = np.random.default_rng(0)
    weights = gen.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("w.f32", weights)
    writer.add_tensor("w.f16", weights.astype(np.float16))
    writer.add_tensor("v.f32", gen.standard_normal(5).astype(np.float32))
    for name, qtype in (("w.q8_0", gguf.GGMLQuantizationType.Q8_0), ("w.q4_0", gguf.GGMLQuantizationType.Q4_0)):
        packed = gguf.quants.quantize(weights, qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
    path = tmp_path / "types.gguf"
    _written(path, alignment)
    ours = _assert_same_as_gguf_reader(path)
    assert ours.fields["s.11"] == "naïve text" and ours.fields["a.floats"] == [0.5, -1.25, 3.0]
    assert ours.fields["a.nested"] == UnreadArray(2) and ours.fields["a.strings"] == UnreadArray(3)
    assert len(ours.tensors) == 5


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_model_load_error(tmp_path):
    path = tmp_path / "types.gguf"
    _written(path, None)
    raw = path.read_bytes()
    for size in (3, 60, len(raw) // 2, len(raw) - 1):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(raw[:size])
        with pytest.raises(ModelLoadError, match="GGUF"):
            GGUFFile(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(other)
