"""corrallm: one OpenAI-compatible gateway in front of many LLM and audio backends."""

__version__ = "0.1.0"
