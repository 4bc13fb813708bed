"""loomrl/errors.py: the one helper that cuts an error to what a line can hold."""

from __future__ import annotations

from loomrl.errors import error_line, error_tail, folded, named_line


def test_an_error_reads_as_its_first_or_last_line_and_an_empty_one_as_its_type():
    err = RuntimeError("\n  ray actor on node 10.0.0.2 failed\n\nTraceback ...\nValueError: bad shape\n")
    assert error_line(err) == "ray actor on node 10.0.0.2 failed"
    assert error_line(err, end=True) == "ValueError: bad shape"
    assert error_tail(err, 2) == "Traceback ...\nValueError: bad shape"
    assert error_line(KeyError()) == "KeyError" and error_line(TimeoutError(), end=True) == "TimeoutError"
    assert error_tail(OSError()) == "OSError" and error_line("") == ""


def test_named_line_and_folded_keep_what_a_log_line_can_hold():
    assert named_line(ValueError("no\nmore")) == "ValueError: no" and named_line(ValueError()) == "ValueError"
    assert named_line(ValueError("x" * 500), 10) == "ValueError: " + "x" * 10
    assert folded("a\n\n  b  \nc") == "a | b | c"
    long = "\n".join(f"line {i}" for i in range(200))
    assert folded(long, 40).endswith("line 199") and len(folded(long, 40)) == 43
