"""The router's OpenAI-compatible HTTP API (R2): `/v1/completions`, `/v1/chat/completions` (SSE),
`/v1/models`, `/health`, `/metrics`.

Modules: parse (request bodies -> GenerateRequest, 400 naming the field), render (GenerateResponse
-> OpenAI objects and stream chunks), errors (OpenAI's error shape, exception -> HTTP status),
server (the aiohttp app, on the router's event loop; HttpApi, HttpConfig).
"""

from router.http_api.server import Backend, HttpApi, HttpConfig

__all__ = ["Backend", "HttpApi", "HttpConfig"]
