"""The ``kvcdn`` command: thin click commands over the library, rich output for people.

Every command takes ``--json`` to print data for scripts instead. Library
errors become one line on stderr and a non-zero exit code, never a traceback.
One module per command group: ``publish`` (publish, refresh, calibrate), ``catalog``
(ls, inspect), ``keys``, ``edge`` (edge serve, warm), ``ask`` (ask, demo),
``models`` (cached model folders);
``app`` holds what they share.
"""

from __future__ import annotations

import os
import sys

from . import ask, catalog, edge, keys, models, publish  # noqa: F401  (each registers its commands)
from .app import cli

__all__ = ["cli", "main"]


def main() -> None:
    # kvcdn loads weights from local files only: keep transformers and
    # huggingface_hub off the network (the library passes local_files_only;
    # this also silences their update checks). The CLI is the host
    # application here, so the environment is its to set.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cli(prog_name="kvcdn")


if __name__ == "__main__":
    sys.exit(main())
