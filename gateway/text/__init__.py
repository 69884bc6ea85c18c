"""Text <-> token ids: the tokenizers (Hugging Face, GGUF), chat templates, incremental detokenization,
stop strings, one request's token stream -> text stream, and the tool-call syntaxes with their parsers.

The bottom room of the gateway: it imports no other gateway room.
"""
