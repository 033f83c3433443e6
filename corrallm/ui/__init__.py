"""The dashboard (SPEC §11 D1): server-rendered pages and small hand-written JS, no build step."""
