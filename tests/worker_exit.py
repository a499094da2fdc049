"""How the multi-process test workers end: after their results are printed and their process groups destroyed,
without Python's interpreter finalisation, where gloo's worker threads can still hold async work whose tensors
need the GIL: that aborts the process ("terminate called without an active exception", SIGABRT) now and then on
a loaded machine, after every check passed."""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """``main()``, then exit 0 without finalising; an exception in ``main`` propagates as usual (non-zero exit)."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
