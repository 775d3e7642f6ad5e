"""The HTTP face of `ds4tp serve`: the Starlette app and its routes, uvicorn, server-sent events, /metrics."""
