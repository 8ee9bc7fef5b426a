"""new_dir: a command's output directory is new or empty, and appears only when written whole."""
import pytest

from specdec.config import ConfigError
from specdec.model.output_dir import check_new_dir, new_dir


def test_a_directory_appears_only_when_written_whole(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with new_dir(out) as partial:
            (partial / "model.safetensors").write_text("half")
            raise RuntimeError("interrupted")
    assert not out.exists() and not (tmp_path / "model.partial").exists()
    with new_dir(out) as partial:
        (partial / "config.json").write_text("{}")
        assert not out.exists()
    assert [p.name for p in out.iterdir()] == ["config.json"]
    (tmp_path / "empty").mkdir()
    with new_dir(tmp_path / "empty") as partial:  # an empty directory may be given
        (partial / "a").write_text("")
    assert (tmp_path / "empty" / "a").exists()


def test_a_directory_with_anything_in_it_or_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for out in (tmp_path, tmp_path / "file"):
        with pytest.raises(ConfigError, match="not an empty directory"):
            check_new_dir(out)
        with pytest.raises(ConfigError):
            with new_dir(out):
                pass
    assert (tmp_path / "file").read_text() == "x"
