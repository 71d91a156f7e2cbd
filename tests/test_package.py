"""The extension module imports and exposes its exception hierarchy."""

import kvshare
from kvshare import _core


def test_version_matches_package():
    assert kvshare.__version__ == "0.1.0"


def test_exceptions_form_a_hierarchy():
    for name in ["OutOfBlocks", "InvalidArgument", "CorruptEntry", "FingerprintMismatch",
                 "PathEscape", "OverBudget", "CacheIoError"]:
        cls = getattr(_core, name)
        assert issubclass(cls, _core.KvshareError)
        assert issubclass(_core.KvshareError, Exception)
