"""Server defaults, importable without FastAPI/uvicorn (the CLI builds its help from them)."""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Requests allowed to wait for the engine before new ones get HTTP 429.
DEFAULT_MAX_QUEUE_LEN = 256
# Results of /v1/responses kept for GET and previous_response_id (oldest dropped first).
DEFAULT_MAX_STORED_RESPONSES = 1000
# Larger request bodies get HTTP 413 (a 128k-token prompt is well under 1 MiB of text).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Seconds running requests may take to finish after SIGINT/SIGTERM before being aborted.
DEFAULT_SHUTDOWN_GRACE_S = 5.0
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Reasoning parsers of `serve --reasoning-parser` (server/reasoning.py defines them).
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# Tool-call parsers of `serve --tool-call-parser` (server/tool_parsers.py defines them).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
