"""Generated stubs of the tokenmill.v1 protos; regenerate with `python -m protos.generate`."""
