import pytest

from specdecode.files import write_atomic, write_text_atomic


def test_write_text_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "best.json"
    write_text_atomic(path, "old\n")
    write_text_atomic(path, "new\n")
    assert path.read_text(encoding="utf-8") == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json"]


def test_a_failing_writer_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "plot.png"
    write_text_atomic(path, "old")

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, fail)
    assert path.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
