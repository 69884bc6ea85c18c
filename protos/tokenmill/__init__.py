"""Generated stubs live under protos.tokenmill.v1 (the proto package tokenmill.v1)."""
