"""Routing requests across data-parallel engine replicas: round-robin, least-load, and prefix-aware."""
