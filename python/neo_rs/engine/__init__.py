"""The engine: ``LLM`` (offline), ``LLMEngine`` (the step loop), ``AsyncEngine`` (serving), requests
and their outputs, the tokenizer and detokenizer, and per-iteration stats. vLLM's ``v1/engine``."""
