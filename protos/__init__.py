"""The wire: `.proto` sources and generated stubs under protos/tokenmill/v1 (regenerate with
`python -m protos.generate`) and protos/kserve, and the codecs (`protos.codec`, `protos.kserve.codec`),
the one place that converts between `core/` types and the messages. Imports only `core` of ours."""
