"""The tokenmill.v1 API: .proto sources and generated stubs under protos/tokenmill/v1 (regenerate with
`python -m protos.generate`), and protos.codec, the one converter between domain objects and the
internal messages."""
