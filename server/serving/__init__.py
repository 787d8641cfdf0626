"""The query path inside the server: micro-batching, embedding for the compatibility routes, upsert jobs."""
