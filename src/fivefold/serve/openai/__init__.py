"""The OpenAI-compatible HTTP server: protocol.py (request and response bodies, pydantic),
serving.py (the engine's thread and the endpoints' logic), api_server.py (FastAPI routes,
uvicorn, `fivefold serve`). The only modules of fivefold that import fastapi or pydantic."""
