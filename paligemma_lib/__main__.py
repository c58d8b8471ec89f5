# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""Command line: answer one prompt about one image; train; evaluate; the demo.

    python -m paligemma_lib generate --image PATH --prompt "caption en" [--model DIR]
                                     [--quantize int8]
    python -m paligemma_lib train --config nano --out DIR --steps N [--resume]
    torchrun --nproc_per_node 2 -m paligemma_lib train ...      # DDP
    python -m paligemma_lib evaluate --world shapes --split test [--model DIR]
    python -m paligemma_lib demo [--model DIR] [--adapter DIR] [--host H] [--port N]

--model defaults to nano, the small model shipped in the package (chapter 11).
Each command is a module of paligemma_lib.cli.

Bad input (a missing file, an unreadable image, a folder that is not a checkpoint)
ends with one line on stderr and exit status 1, not a traceback."""

import signal
import sys

from .cli.interrupt import interrupted

# Run as a program: first, before the slow imports, so that Ctrl-C never prints a
# traceback. (Imported, by the tests, it leaves the caller's Ctrl-C alone.)
if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)

from .cli.main import main  # noqa: E402  (torch loads in main, for a command)

if __name__ == "__main__":
    sys.exit(main())
