"""Engine cores as Ray actors (`--distributed-executor-backend ray`).

Ray places the replicas on a running cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379`
on the others; with none running, `ray.init` starts one here) and restarts nothing by itself: the front end
supervises its replicas exactly as it does local processes. Requests do not travel through Ray: the front end
talks to each actor over the same ZeroMQ protocol as to a local core, on TCP sockets instead of IPC ones.
Ray is an optional extra (`pip install 'tokenmill[ray]'`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_proc import CoreProcessOptions, run_engine_core
from tokenmill.engine.replica import ProcessReplica, Replica

logger = logging.getLogger("tokenmill.engine")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") from exc
    return ray


class EngineCoreActor:
    """The Ray actor: one method that runs an engine core until it is told to stop (or dies)."""

    def run(self, config: EngineConfig, options: CoreProcessOptions) -> None:
        run_engine_core(config, options)


class _ActorProcess:
    """An engine-core actor, answering like the multiprocessing.Process a local replica has."""

    def __init__(self, ray: Any, actor: Any, done: Any) -> None:
        self._ray, self._actor, self._done = ray, actor, done

    def is_alive(self) -> bool:
        ready, _ = self._ray.wait([self._done], timeout=0)
        return not ready

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        try:
            self._ray.get(self._done)
        except Exception:  # noqa: BLE001 - the actor died or raised: a failure like a non-zero exit
            return 1
        return 0

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._done], timeout=timeout)


class RayReplica(ProcessReplica):
    """A replica whose core runs in a Ray actor holding `num_cpus` of the cluster's CPUs."""

    def __init__(self, index: int, config: EngineConfig, num_cpus: int, host: str, send_plans: bool = False,
                 kv_events: bool = True, log_level: str = "INFO") -> None:
        super().__init__(index, config, None, send_plans, kv_events, log_level)
        self.num_cpus = num_cpus
        self.host = host  # this front end's address as the cluster's nodes reach it

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        port = sock.bind_to_random_port("tcp://*")
        return f"tcp://{self.host}:{port}"

    def _spawn(self, options: CoreProcessOptions) -> Any:
        ray = _ray()
        options.num_threads = self.num_cpus
        actor = ray.remote(EngineCoreActor).options(num_cpus=self.num_cpus).remote()
        return _ActorProcess(ray, actor, actor.run.remote(self.config, options))


def launch_on_ray(config: EngineConfig, data_parallel_size: int, router: str, send_plans: bool = False,
                  log_level: str = "INFO") -> AsyncLLM:
    ray = _ray()
    if not ray.is_initialized():
        # RAY_ADDRESS, or the cluster `ray start` left on this machine, or else a new local one
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=log_level.upper(), log_to_driver=True)
    cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
    num_cpus = max(1, cluster_cpus // data_parallel_size)
    host = ray.util.get_node_ip_address() if hasattr(ray, "util") else socket.gethostbyname(socket.gethostname())
    logger.info("Ray cluster: %d CPUs on %d nodes; %d engine cores of %d CPUs each", cluster_cpus,
                len(ray.nodes()), data_parallel_size, num_cpus)
    replicas: list[Replica] = [
        RayReplica(i, config, num_cpus, host, send_plans, kv_events=data_parallel_size > 1, log_level=log_level)
        for i in range(data_parallel_size)
    ]
    return AsyncLLM.over_replicas(config, replicas, router)
