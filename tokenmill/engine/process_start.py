"""How engine-core processes start: forked from a server process that has already imported the engine.

A spawned core pays the interpreter start and `import torch` (~3 s here) before it can read a weight, and the
front end pays them too. Python's fork server (multiprocessing "forkserver") imports the modules named below once;
each core is then a fork of it. Started at the top of `tokenmill serve`, its imports run on one core while the
front end imports its own on the other. Nothing has run an OpenMP region in the fork server, so each core's
thread pool starts fresh after the fork. Where the platform has no fork server, cores are spawned.

Stdlib only at the top: importing this module must not import torch.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver

# what a core imports before it loads a model
PRELOAD = ["torch", "tokenmill.engine.core_proc", "tokenmill.engine.core_loop", "tokenmill.engine.llm_engine",
           "tokenmill.engine.fork_ready"]


def core_process_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_core_server() -> None:
    """Start the fork server now (it imports PRELOAD in its own process) instead of at the first core's launch."""
    if core_process_context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()
