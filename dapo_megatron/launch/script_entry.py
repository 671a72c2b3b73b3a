"""How the `python -m dapo_megatron.launch.X` entry points the sbatch scripts call end: main()'s exit
code; a ValueError (a config or argument mistake) is one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_as_script(main: Callable[[], int], error_prefix: str) -> None:
    """error_prefix: what the stderr line starts with, e.g. "prepare: error:"."""
    try:
        code = main()
    except ValueError as err:
        print(f"{error_prefix} {err}", file=sys.stderr)
        code = 2
    raise SystemExit(code)
