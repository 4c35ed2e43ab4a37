"""Reading ``.npz`` files that someone else may have written (a run folder copied in, a
checkpoint on a shared disk): each array's declared size is held to the bytes the file
holds before numpy allocates it.

``np.load`` trusts a member's header: an 8 MB file whose one deflated member declares 8 GiB
of zeros took 8 GiB to read, and a header declaring ``(2**40,)`` ended in a MemoryError
traceback. fedctl writes its ``.npz`` files uncompressed (``np.savez``), so a member is
stored, and its array cannot be larger than its bytes in the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

__all__ = ["load_npz", "NpzError"]


class NpzError(ValueError):
    """A ``.npz`` file that is not one fedctl wrote; the message is one line (the caller names
    the file)."""


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path``, after checking that each member is stored
    (not compressed) and declares no more bytes than it holds; never unpickles.

    Raises
    ------
    NpzError
        A compressed member, or one whose header declares more than the member holds.
    OSError, ValueError, zipfile.BadZipFile, EOFError
        As ``np.load`` raises them for a damaged file.
    """
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise NpzError(f"member {info.filename!r} is compressed: not a file "
                               f"fedctl wrote (its arrays are stored)")
            with zf.open(info) as member:
                major, _ = np.lib.format.read_magic(member)
                read_header = (np.lib.format.read_array_header_1_0 if major == 1
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(member)
                declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if dtype.hasobject or declared > info.file_size:
                    raise NpzError(f"member {info.filename!r} declares "
                                   f"{'objects' if dtype.hasobject else f'{declared} bytes'}, "
                                   f"more than the {info.file_size} it holds")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
