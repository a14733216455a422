"""Writes that the disk refuses: one line naming what could not be written."""

import errno

import pytest

from megatron_lns.base.disk import (
    DiskFullError,
    as_user_error,
    byte_size,
    disk_full_error,
    disk_full_reported,
)
from megatron_lns.base.exit_status import exit_status


def test_a_full_disk_in_a_writer_becomes_one_line_naming_what_it_wrote(tmp_path):
    with pytest.raises(DiskFullError) as info, disk_full_reported(tmp_path / "out.bin", 2048):
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(info.value)
    assert message.startswith(f"cannot write {tmp_path / 'out.bin'}: no space left on device (")
    assert message.endswith("free there, about 2.0 KiB needed)")
    with pytest.raises(DiskFullError, match="disk quota exceeded"), disk_full_reported(tmp_path):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(PermissionError), disk_full_reported(tmp_path):  # not the disk's
        raise PermissionError(errno.EACCES, "Permission denied")


def test_read_only_names_no_space_and_sizes_read_plainly(tmp_path):
    err = OSError(errno.EROFS, "Read-only file system")
    assert str(disk_full_error(tmp_path, err)) == f"cannot write {tmp_path}: read-only file system"
    assert [byte_size(n) for n in (5, 2048, 3 << 30)] == ["5 B", "2.0 KiB", "3.0 GiB"]


def test_a_full_disk_no_writer_reported_still_ends_in_one_line(capsys):
    """The last resort of every entry point: an ``OSError`` of a full disk is a user
    error, naming the file where the error does; any other stays a bug (traceback)."""

    def body():
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    assert exit_status(body) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write /data/run/metrics.jsonl: no space left on device")
    assert err.count("\n") == 1
    assert as_user_error(OSError(errno.EIO, "I/O error")) is None
    with pytest.raises(OSError):
        exit_status(lambda: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))


def test_an_atomic_write_onto_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path):
    from helpers import fill_leaving, small_filesystem

    from megatron_lns.base.disk import write_text_atomically

    with small_filesystem(tmp_path / "disk", 64) as disk:
        write_text_atomically(disk / "config.yaml", "a: 1\n")
        fill_leaving(disk, 0)
        with pytest.raises(DiskFullError, match=r"; it stays as it was$"):
            write_text_atomically(disk / "config.yaml", "b: 2\n" * 4096, "; it stays as it was")
        assert (disk / "config.yaml").read_text() == "a: 1\n"
        assert sorted(p.name for p in disk.iterdir()) == ["config.yaml", "filler"]


def _df_free(directory) -> str:
    """What ``df`` shows as available on the filesystem of ``directory``, as the lines do."""
    import subprocess

    out = subprocess.run(
        ["df", "-B1", "--output=avail", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return f"{byte_size(int(out.split()[-1]))} free there"


def test_the_space_free_is_measured_once_the_failed_write_is_removed(tmp_path):
    """A write cut short by the disk leaves nothing; the line says the space free after
    that, as ``df`` shows it, not the 0 B of the moment it failed."""
    from helpers import fill_leaving, small_filesystem

    from megatron_lns.base.disk import write_text_atomically

    with small_filesystem(tmp_path / "disk", 64) as disk:
        fill_leaving(disk, 16 << 10)
        with pytest.raises(DiskFullError) as info:
            write_text_atomically(disk / "config.yaml", "b: 2\n" * 8192)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        assert f"({_df_free(disk)})" in str(info.value)
        assert "(0 B free there)" not in str(info.value)


def test_a_checkpoint_save_the_disk_refused_reports_the_space_its_removal_gave_back(tmp_path):
    from helpers import fill_leaving, small_filesystem

    from megatron_lns.training.checkpoint import write_failure

    with small_filesystem(tmp_path / "disk", 256) as disk:
        final = disk / "checkpoints" / "iter_0000002"
        partial = final.with_name("iter_0000002.partial")
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(b"\0" * (128 << 10))
        fill_leaving(disk, 0)
        err = write_failure(final, partial, OSError(errno.ENOSPC, "No space left on device"))
        message = str(err)
        assert not partial.exists()
        assert message.startswith(
            f"cannot write {final}: no space left on device ({_df_free(disk)})"
        )
        assert message.endswith(
            "; iter_0000002.partial removed, a rerun starts afresh once space is freed"
        )


def test_an_atomic_write_the_filesystem_refuses_is_one_line_and_leaves_no_temporary(tmp_path):
    """A directory where the file goes, or a file that may not be replaced: the user's to
    move, like a full disk; the old file stays as it was."""
    from helpers import immutable

    from megatron_lns.base.disk import WriteError, write_text_atomically

    (tmp_path / "run_status").mkdir()
    with pytest.raises(WriteError, match=f"^cannot write {tmp_path / 'run_status'}: is a dir"):
        write_text_atomically(tmp_path / "run_status", "finished 6\n", "; the run ended")
    (tmp_path / "config.yaml").write_text("a: 1\n")
    refused = pytest.raises(WriteError, match=r"config\.yaml: operation not permitted; it stays$")
    with immutable(tmp_path / "config.yaml"), refused:
        write_text_atomically(tmp_path / "config.yaml", "b: 2\n", "; it stays")
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "run_status"]
