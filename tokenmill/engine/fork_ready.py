"""Imported last by the engine-core fork server (process_start.PRELOAD), before it forks any core.

- Everything imported so far leaves the garbage collector's sight (gc.freeze), so a forked core's collections
  neither walk those objects nor write to their pages (which would copy every such page into the core: measured
  here, a 1.7 s first collection and ~100 MB more resident memory per core).
- The fork server ignores SIGTERM (Python's fork server ignores only SIGINT): a supervisor that signals the
  server's whole process group (systemd's KillMode=control-group, `kill -- -PGID`) would otherwise kill it, and
  with it every core forked from it, in the middle of the front end's drain. It goes when the front end does
  (its end of the fork server's pipe closes).
"""

import gc
import signal

gc.freeze()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
