import pytest

from specdecode.files import write_atomic, write_png_atomic, write_text_atomic


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


def test_write_png_atomic_writes_a_png_and_no_temporary(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1))
    fig.subplots().plot([0, 1], [1, 0])
    write_png_atomic(fig, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
