"""`corrallm fake-backend`: a fake OpenAI-compatible backend process that acts like llama-server.

Used by the demo config, the integration tests and the benchmarks. Run it as
`corrallm fake-backend --port P ...` or `python -m corrallm.fake_backend --port P ...`.
"""

from __future__ import annotations


def main(argv: list[str]) -> None:
    """Parse `argv` (without the subcommand) and serve until signalled."""
    from corrallm.fake_backend.server import main as serve_main

    serve_main(argv)


__all__ = ["main"]
