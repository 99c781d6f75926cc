"""The OpenAI-compatible streaming server (aiohttp) on the neo_rs engine: ``python -m neo_rs.serve``."""
