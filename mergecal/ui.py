"""``mergecal ui``: the MLflow UI over the benchmark's tracking store and the Prefect UI, on 127.0.0.1.

Each server runs in its own process group (its workers included), so Ctrl-C stops the whole group and
nothing is left listening. MLflow runs with one worker and job execution off: its job consumers are
otherwise separate processes that can outlive the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .errors import MergecalError, ParameterError

HOST = "127.0.0.1"
QUIET_ENV = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@dataclass(frozen=True)
class Server:
    name: str
    command: list[str]
    url: str  # what a browser opens
    health: str  # answers 200 once the server is up


def mlflow_server(mlflow_uri: str, port: int = 5000) -> Server:
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", mlflow_uri, "--host", HOST,
               "--port", str(port), "--workers", "1"]
    return Server("MLflow UI", command, f"http://{HOST}:{port}", f"http://{HOST}:{port}/health")


def prefect_server(port: int = 4200) -> Server:
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    return Server("Prefect UI", command, f"http://{HOST}:{port}", f"http://{HOST}:{port}/api/health")


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with telemetry off and MLflow's job execution disabled."""
    env = dict(os.environ if base is None else base)
    env.update(QUIET_ENV)
    return env


def check_port_number(port: int, option: str) -> None:
    if not 1 <= port <= 65535:  # socket.bind raises OverflowError above 65535
        raise ParameterError(f"{option} {port}: expected a port number from 1 to 65535")


def check_port_free(port: int, option: str) -> None:
    check_port_number(port, option)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            raise ParameterError(f"{option} {port}: port already in use on {HOST}") from None


def start(server: Server, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``server`` as the leader of a new process group (so it can be stopped whole)."""
    return subprocess.Popen(server.command, env=server_env() if env is None else env, start_new_session=True)


def wait_until_up(server: Server, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll ``server.health`` until it answers; fail early if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MergecalError(f"{server.name}: exited with status {proc.returncode} before answering on {server.url}")
        try:
            with urllib.request.urlopen(server.health, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    raise MergecalError(f"{server.name}: no answer on {server.health} within {timeout:g} s")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``timeout``; returns when the group is gone."""
    pgid = proc.pid  # leader of its own session, so its pid is the group id
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                return
            time.sleep(0.1)
    proc.wait()


def serve_ui(mlflow_uri: str, *, mlflow_port: int = 5000, prefect_port: int = 4200, prefect: bool = True,
             mlflow: bool = True, startup_timeout: float = 120.0) -> int:
    """Run the MLflow UI (and the Prefect UI) until Ctrl-C; print their URLs once they answer."""
    servers = [(mlflow_server(mlflow_uri, mlflow_port), "--mlflow-port", mlflow_port)] if mlflow else []
    if prefect:
        servers.append((prefect_server(prefect_port), "--prefect-port", prefect_port))
    for _, option, port in servers:
        check_port_free(port, option)
    running: list[tuple[Server, subprocess.Popen]] = []
    previous = _interrupt_on_signals()
    try:
        for server, _, _ in servers:
            running.append((server, start(server)))
        for server, proc in running:
            wait_until_up(server, proc, startup_timeout)
            print(f"{server.name}: {server.url}", flush=True)
        print("Ctrl-C stops them.", flush=True)
        while True:
            for server, proc in running:
                if proc.poll() is not None:
                    raise MergecalError(f"{server.name}: exited with status {proc.returncode}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        for _, proc in reversed(running):
            stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupt_on_signals() -> dict:
    """Ctrl-C and SIGTERM both end ``serve_ui`` through its cleanup, also where SIGINT was ignored (a
    background job); returns the previous handlers. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
