"""The loader's GGUF reader gives every field and tensor exactly as gguf.GGUFReader does."""
import numpy as np
from gguf import GGUFReader, GGUFWriter

from worker.loader import default_model_path
from worker.loader.gguf_reader import FastGGUFReader


def assert_same_reading(path) -> None:
    expected, actual = GGUFReader(str(path)), FastGGUFReader(str(path))
    assert list(actual.fields) == list(expected.fields)
    for name, field in expected.fields.items():
        ours = actual.fields[name]
        assert (ours.offset, ours.name, ours.data) == (field.offset, field.name, field.data), name
        assert ours.types == field.types, name
        assert len(ours.parts) == len(field.parts), name
        for part, expected_part in zip(ours.parts, field.parts):
            assert part.dtype == expected_part.dtype and part.shape == expected_part.shape, name
            assert np.array_equal(part, expected_part), name
        assert ours.contents() == field.contents(), name
    assert actual.data_offset == expected.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in actual.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in expected.tensors]


def test_default_model_reads_as_gguf_reads_it():
    assert_same_reading(default_model_path())


def test_every_array_type_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "ünïcode", "x" * 300, "end"])
    writer.add_array("test.ints", list(range(-2, 3)))
    writer.add_array("test.floats", [0.5, -1.25, 3.0, 1e-8, 7.0])
    writer.add_array("test.bools", [True, False, True, True, False])
    writer.add_string("test.after", "still in step")
    writer.add_uint32("test.scalar", 7)
    writer.add_tensor("weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(path)
    fields = FastGGUFReader(str(path)).fields
    assert fields["test.strings"].contents() == ["", "a", "ünïcode", "x" * 300, "end"]
    assert fields["test.after"].contents() == "still in step"
