"""The OpenAI-compatible HTTP API: the aiohttp server and its connection limits, JSON bodies -> prepared
requests, text deltas -> OpenAI's response and chunk bodies, OpenAI's error shape, and chat tools.

Only this room knows OpenAI's JSON; what KServe shares with it (output constraints) lives in gateway.prepare.
"""
