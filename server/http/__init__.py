"""The HTTP edge: app factory, auth, connections, logs, metrics, errors, request/response models, rendering."""
