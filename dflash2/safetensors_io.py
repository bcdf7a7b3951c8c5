"""safetensors files that other accounts can read, and files made durable (`fsync_path`,
`write_durably`).

`safetensors.torch.save_file` (and `save_pretrained`, which writes through it) creates every file
with mode 0600, whatever the umask: an export, a checkpoint or a features directory written by one
account could not be read by a server or a job of another, though every other file beside it can.
`save_tensors` writes through it and then gives the file the mode a plain `open` would (0666 less
the umask: 0644 under the usual 022, 0664 under 002); `readable_like_other_files` does the same for
the safetensors files another library wrote into a directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not atomic with respect to other threads)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The permission bits a new file gets from `open` in this process: 0o666 less the umask."""
    return 0o666 & ~_umask()


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """`safetensors.torch.save_file`, the file then given the mode of any other new file (`file_mode`)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


def readable_like_other_files(directory: str | Path) -> None:
    """Give the *.safetensors files directly in `directory` (a `save_pretrained` output) the mode of
    any other new file (`file_mode`)."""
    mode = file_mode()
    for path in Path(directory).glob("*.safetensors"):
        os.chmod(path, mode)


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk (a checkpoint's files before its
    COMPLETE marker, a feature shard before the manifest that lists it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | Path, text: str) -> None:
    """Write `text` to `path` and flush it to the disk before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
