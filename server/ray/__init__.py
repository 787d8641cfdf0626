"""``qswap serve --ray``: the same app on Ray Serve (ingress, encoder deployment, shared index and registry)."""
