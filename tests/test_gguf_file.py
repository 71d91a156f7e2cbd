"""Our GGUF parser against the `gguf` package's reader, and its errors on damaged files."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from kvshare.model.gguf_file import GGUFError, GGUFFile

DATA = Path(__file__).parent / "data" / "models"


@pytest.mark.parametrize("name", ["tiny-qwen35.gguf", "tiny-lfm2.gguf"])
def test_matches_gguf_reader(name):
    path = DATA / name
    ours = GGUFFile(path)
    ref = GGUFReader(str(path))
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(ref_keys)
    for key in ref_keys:
        expected = ref.fields[key].contents()
        got = ours.metadata[key]
        if isinstance(expected, list) and expected and isinstance(expected[0], float):
            np.testing.assert_allclose(got, expected)
        else:
            assert got == expected, key
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in t.shape)
        np.testing.assert_array_equal(ours.raw(t.name), np.asarray(t.data).view(np.uint8).ravel())


def test_truncated_file_is_a_clear_error(tmp_path):
    data = (DATA / "tiny-lfm2.gguf").read_bytes()
    for cut in [0, 3, 100, len(data) // 2, len(data) - 1]:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError):
            GGUFFile(bad)


def test_wrong_magic_and_missing_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GGUFError, match="magic"):
        GGUFFile(bad)
    with pytest.raises(GGUFError, match="not found"):
        GGUFFile(tmp_path / "missing.gguf")
