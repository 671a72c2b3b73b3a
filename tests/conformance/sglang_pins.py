"""Settings shared by the conformance fixtures and tests (a module of its own: `from conftest import`
would pick whichever conftest.py the full suite imported first)."""

SGLANG_VERSION = "0.5.21"  # docs/sglang.md was verified against this release
ORACLE_TP_SIZE = 2
CONTEXT_LENGTH = 256  # the tiny checkpoint's max_position_embeddings; both servers get it explicitly
