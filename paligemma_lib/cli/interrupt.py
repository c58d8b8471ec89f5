# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""What Ctrl-C does in any command: one line on stderr and the shell's status for
SIGINT. Imported by `python -m paligemma_lib` before anything slow, so that Ctrl-C
during the imports prints no traceback either."""

import os
import sys

# What Ctrl-C says and the status it ends with; a command may replace it (train says
# where to resume, the demo stops quietly)
ON_INTERRUPT = {"message": lambda: "error: interrupted", "status": 130}


def interrupted(signum, frame):
    """Ctrl-C, in any phase: one line and, but for the demo, the shell's status for
    SIGINT (128 + 2). The demo is a server that runs until Ctrl-C, its documented way
    to stop: there it ends with status 0, as `python -m http.server` does.

    `os._exit`, not `sys.exit`: a `SystemExit` raised wherever the signal lands can be
    swallowed by a bare `except:` in a library being imported, and the run would go on
    and end with status 0. Nothing is half-written at this point but a `--draw` file
    (train's checkpoints are written to a staging folder and renamed when complete)."""
    sys.stdout.flush()
    # on a line of its own: a progress bar may hold the cursor mid-line
    print("\n" + ON_INTERRUPT["message"](), file=sys.stderr, flush=True)
    os._exit(ON_INTERRUPT["status"])
