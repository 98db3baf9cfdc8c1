"""The server tests use the same child-process launcher as the benchmarks."""

from tokenmill.bench.server_process import LiveServer, free_port, live_server

__all__ = ["LiveServer", "free_port", "live_server"]
