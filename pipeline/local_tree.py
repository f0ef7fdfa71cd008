"""Reading a local directory to publish it, taking nothing from outside it.

:func:`read_tree` first checks the whole tree (:func:`tree_files`): a symbolic link that
leaves the directory or dangles, or anything but regular files and directories, is
refused before a byte is read. It then opens each file from the directory down, one
component at a time with ``O_NOFOLLOW``, and checks the opened descriptor: a regular file
whose hard links are all among the directory's files. A file or directory swapped for a
link between the check and the read is refused, never read. An inner link is read at the
target checked for it.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


class UnsafeTree(ValueError):
    """The directory holds something that is not its own regular file (message: the path)."""


def read_tree(local_dir: Path, keep: Callable[[str], bool] | None = None
              ) -> Iterator[tuple[str, BinaryIO]]:
    """``(relative POSIX path, open file)`` of every regular file under ``local_dir``,
    sorted; with ``keep``, only the paths it accepts. The whole tree is checked before the
    first file is yielded."""
    files = tree_files(local_dir)
    root = local_dir.resolve()
    links = Counter((i.st_dev, i.st_ino) for i in (  # hard links among all the files
        os.stat(root / at, follow_symlinks=False) for at in set(files.values())))
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for p, inside in files.items():
            rel = p.relative_to(local_dir).as_posix()
            if keep is None or keep(rel):
                with _open_inside(root_fd, root, inside, links) as src:
                    yield rel, src
    finally:
        os.close(root_fd)


def _open_inside(root_fd: int, root: Path, inside: Path,
                 links: Counter[tuple[int, int]]) -> BinaryIO:
    """``root/inside`` opened for reading one component at a time from ``root_fd``, following
    no symbolic link; refused unless it is a regular file whose hard links are all among
    the directory's files (``links``: how many each inode has there)."""
    fds, fd = [], root_fd
    try:
        for part in inside.parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            fds.append(fd)
        fd = os.open(inside.parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as e:  # ELOOP: a link where a file or directory was when checked
        raise UnsafeTree(f"{root / inside}: changed while it was published (now "
                         f"{os.strerror(e.errno) if e.errno else e}); nothing of it was "
                         "read") from None
    finally:
        for d in fds:
            os.close(d)
    info = os.fstat(fd)
    inside_links = links[(info.st_dev, info.st_ino)]
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > max(inside_links, 1):
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else \
            f"a file with {info.st_nlink} hard links, {info.st_nlink - inside_links} outside " \
            "the directory"
        raise UnsafeTree(f"{root / inside}: {what}; copy the file into the directory "
                         "instead")
    return os.fdopen(fd, "rb")


def tree_files(local_dir: Path) -> dict[Path, Path]:
    """Every regular file under ``local_dir`` (sorted), each with the path to read it at
    relative to the resolved directory: its own, or an inner link's target. Links leaving
    the directory, dangling links and anything but files and directories are refused."""
    root = local_dir.resolve()
    files = {}
    for p in sorted(local_dir.rglob("*")):
        read_at = p.relative_to(local_dir)
        if p.is_symlink():
            target = p.resolve()
            if not target.is_relative_to(root):
                raise UnsafeTree(f"{p}: a symbolic link to {os.readlink(p)}, outside {root}; "
                                 "copy the file into the directory instead")
            if not target.exists():
                raise UnsafeTree(f"{p}: a symbolic link to {os.readlink(p)}, which is missing")
            read_at = target.relative_to(root)
        mode = p.stat().st_mode
        if stat.S_ISREG(mode):
            files[p] = read_at
        elif not stat.S_ISDIR(mode):
            raise UnsafeTree(f"{p}: not a regular file or directory")
    return files
