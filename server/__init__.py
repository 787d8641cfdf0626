"""The HTTP search service: ``qswap serve``.

``qswap.server.http.app.create_app(ServerSettings(...))`` builds the FastAPI app; the CLI runs it
with uvicorn. Importing this package loads nothing heavy.
"""
