# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""The command line, one module per command (generate, train, evaluate, demo), the
options they share (options), Ctrl-C (interrupt) and the parser (main). Run it as
`python -m paligemma_lib`; this package imports nothing slow by itself."""
