"""Real servers for integration tests, started on 127.0.0.1 and stopped cleanly: PostgreSQL, an MLflow tracking
server (artifacts proxied through it), a Prefect server, and a Dask scheduler with its workers.

Plain functions and context managers (no fixtures, no tests): a test or a fixture wraps them, e.g.::

    with postgres_server(tmp_path / "pg") as pg_uri, mlflow_server(pg_uri, tmp_path / "artifacts") as url:
        MlflowClient(tracking_uri=url) ...

Each server runs as the leader of its own process group (its workers included) and is stopped whole: SIGTERM,
then SIGKILL for what is left (mergecal.ui.stop); PostgreSQL is stopped with ``pg_ctl stop -m fast``. Every
server writes its output to a log file, whose tail is in the error when it does not come up.

PostgreSQL comes from Debian's ``postgresql`` package (``apt-get install -y postgresql``). Without its binaries
:func:`postgres_server` skips the test, unless ``CI`` is set: there it fails, so CI cannot silently lose the
Postgres tests.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from mergecal import offline
from mergecal.ui import Server, stop, wait_until_up

HOST = "127.0.0.1"
PG_USER = "mergecal"
PG_DATABASE = "mergecal"
PG_SYSTEM_USER = "postgres"  # initdb and postgres refuse to run as root: as root they run as this user
# the Prefect server's own output (its services' errors included), under its home
PREFECT_SERVER_LOG = "prefect-server.log"
MLFLOW_SERVER_LOG = "mlflow-server.log"


# ------------------------------------------------------------------------------------------------ common pieces

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def quiet_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: os.environ) with the project's offline/quiet variables (mergecal/offline.py) forced on,
    MLflow's job execution off, and ``extra`` on top."""
    env = dict(os.environ if base is None else base)
    env.update(offline.OFFLINE_ENV)
    env.update({"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    env.update(extra)
    return env


def log_tail(path: Path | str, chars: int = 4000) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return text[-chars:]


@contextmanager
def _running(server: Server, env: dict[str, str], log_path: Path, timeout: float, cwd: Path | None = None
             ) -> Iterator[subprocess.Popen]:
    """Start ``server`` (own process group, output to ``log_path``), wait for its health URL, stop it at exit;
    yields the process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(server.command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    try:
        try:
            wait_until_up(server, proc, timeout)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n--- {log_path} (tail) ---\n{log_tail(log_path)}") from None
        yield proc
    finally:
        stop(proc)


def wait_for_url(url: str, timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer on {url} within {timeout:g} s")
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------------ PostgreSQL

def find_pg_bindir() -> Path | None:
    """The directory of PostgreSQL's server binaries (initdb, pg_ctl): ``pg_config --bindir`` where that holds
    initdb (Debian's pg_config may come from libpq-dev alone), else the newest /usr/lib/postgresql/*/bin."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and (Path(out) / "initdb").is_file():
            return Path(out)
    candidates = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if (Path(p) / "initdb").is_file()]

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", path.parent.name)) or (0,)

    if candidates:
        return max(candidates, key=version)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _missing(reason: str) -> None:
    """Skip the test, or fail it under CI (where PostgreSQL must be installed)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the PostgreSQL tests: install Debian's PostgreSQL "
                    "(apt-get install -y postgresql)", pytrace=False)
    pytest.skip(reason)


def require_pg_bindir() -> Path:
    bindir = find_pg_bindir()
    if bindir is None:
        _missing("PostgreSQL server binaries (initdb, pg_ctl) not found")
    return bindir


def _as_pg_user(command: list[str]) -> list[str]:
    """``command`` as run by the ``postgres`` system user when we are root (initdb and postgres refuse root)."""
    if os.geteuid() != 0:
        return command
    if shutil.which("runuser"):
        return ["runuser", "-u", PG_SYSTEM_USER, "--", *command]
    return ["setpriv", f"--reuid={PG_SYSTEM_USER}", f"--regid={PG_SYSTEM_USER}", "--init-groups", *command]


def _run(command: list[str], what: str, cwd: Path, env: dict[str, str], timeout: float = 120.0) -> None:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {' '.join(command)}\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


@contextmanager
def postgres_server(tmp_dir: Path | str, *, user: str = PG_USER, database: str = PG_DATABASE,
                    timeout: float = 60.0) -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1:<free port>, trust auth, with superuser role ``user`` and
    database ``database``; yields ``postgresql+psycopg://user@127.0.0.1:PORT/database``.

    The cluster lives in ``tmp_dir`` (data, socket, log). As root it runs as the ``postgres`` system user, and
    since pytest's tmp_path sits under a 0700 directory that user cannot enter, the cluster then lives in a
    fresh directory under the system temp dir, owned by ``postgres`` and removed at exit. A too-long ``tmp_dir``
    (Unix socket paths are limited to 107 bytes) gets the same treatment. Skips (fails under CI) without the
    binaries."""
    bindir = require_pg_bindir()
    as_root = os.geteuid() == 0
    if as_root:
        import pwd

        try:
            pg_pw = pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            _missing(f"running as root and there is no {PG_SYSTEM_USER!r} system user to run PostgreSQL as")
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    own_dir = as_root or len(str(tmp_dir)) > 60
    base = Path(tempfile.mkdtemp(prefix="mergecal-pg-")) if own_dir else tmp_dir
    data, sockets, log = base / "data", base / "sock", base / "postgres.log"
    sockets.mkdir(exist_ok=True)
    if as_root:
        for path in (base, sockets):
            os.chown(path, pg_pw.pw_uid, pg_pw.pw_gid)
    env = dict(os.environ, LC_ALL="C", LANG="C")
    env.pop("PGDATA", None)
    port = free_port()
    started = False
    try:
        try:
            _run(_as_pg_user([str(bindir / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                              "--encoding=UTF8", "--no-locale", "--no-sync"]), "initdb", base, env)
            with open(data / "postgresql.conf", "a") as conf:  # root may append; the owner stays postgres
                conf.write(f"\n# lab_servers.postgres_server\nlisten_addresses = '{HOST}'\nport = {port}\n"
                           f"unix_socket_directories = '{sockets}'\nfsync = off\nsynchronous_commit = off\n"
                           "full_page_writes = off\n")
            started = True  # from here on, stop it (pg_ctl stop on a cluster that never started only fails)
            _run(_as_pg_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t",
                              str(int(timeout)), "start"]), "pg_ctl start", base, env, timeout + 30)
            _run([str(bindir / "createdb"), "-h", HOST, "-p", str(port), "-U", user, database], "createdb", base,
                 env)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"PostgreSQL did not start: {exc}\n--- {log} (tail) ---\n{log_tail(log)}") from None
        yield f"postgresql+psycopg://{user}@{HOST}:{port}/{database}"
    finally:
        if started:
            subprocess.run(_as_pg_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                           cwd=base, env=env, capture_output=True, timeout=120)
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ MLflow

@contextmanager
def mlflow_server(backend_uri: str, artifacts_dir: Path | str, *, log_path: Path | str | None = None,
                  timeout: float = 180.0, port: int | None = None) -> Iterator[str]:
    """An MLflow tracking server over ``backend_uri`` that proxies artifacts into ``artifacts_dir`` (experiments
    created without an artifact location get ``mlflow-artifacts:/<id>``); yields ``http://127.0.0.1:PORT``.

    One worker, job execution off (its job consumers would be separate processes outliving the server). The
    default host check already admits 127.0.0.1 and localhost, so no ``--allowed-hosts`` is needed. Output goes
    to ``log_path`` (default: mlflow-server.log beside ``artifacts_dir``). ``port``: a given one (a restart on the
    same address), else a free one."""
    artifacts_dir = Path(artifacts_dir).resolve()
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else artifacts_dir.parent / MLFLOW_SERVER_LOG
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri, "--serve-artifacts",
               "--artifacts-destination", str(artifacts_dir), "--host", HOST, "--port", str(port), "--workers", "1"]
    env = quiet_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    # the server's cwd: where a misconfigured server would drop ./mlruns or ./mlartifacts
    with _running(Server("MLflow server", command, url, f"{url}/health"), env, log_path, timeout,
                  cwd=artifacts_dir.parent):
        yield url


# ------------------------------------------------------------------------------------------------ Prefect

def prefect_env(api_url: str, home: Path | str, base: Mapping[str, str] | None = None, **extra: str
                ) -> dict[str, str]:
    """The environment of a Prefect client process (CLI, ``serve``, a worker) talking to the server at
    ``api_url``: PREFECT_API_URL, PREFECT_HOME, telemetry off, the hubs offline (as the Makefile exports)."""
    env = quiet_env(base)
    for name in ("PREFECT_PROFILE", "PREFECT_API_KEY", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"):
        env.pop(name, None)
    env.update({"PREFECT_API_URL": api_url, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DO_NOT_TRACK": "true"})
    env.update(extra)
    return env


@contextmanager
def prefect_server(home_dir: Path | str, *, ui: bool = False, timeout: float = 180.0, **extra_env: str
                   ) -> Iterator[str]:
    """A Prefect server (API, services: scheduler, late runs, ...) on 127.0.0.1:<free port> with its own SQLite
    database under ``home_dir`` (PREFECT_HOME); yields the API URL ``http://127.0.0.1:PORT/api``. Its output,
    service errors included, goes to ``home_dir/prefect-server.log``. ``ui=False`` (default) skips building the
    UI's static files on start."""
    home_dir = Path(home_dir).resolve()
    home_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://{HOST}:{port}"
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    env = prefect_env(f"{url}/api", home_dir)
    env.pop("PREFECT_API_URL")  # the server's own settings: it serves, it is no client
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)
    env["PREFECT_UI_ENABLED"] = "true" if ui else "false"
    env.update(extra_env)
    with _running(Server("Prefect server", command, url, f"{url}/api/health"), env, home_dir / PREFECT_SERVER_LOG,
                  timeout, cwd=home_dir):
        yield f"{url}/api"


def flow_runs(api_url: str, flow: str, deployment: str, state: str | None = None) -> list[dict]:
    """The flow runs of ``flow``/``deployment`` on the Prefect server at ``api_url`` (in ``state``, a state type)."""
    import httpx

    body = {"deployments": {"name": {"any_": [deployment]}}, "flows": {"name": {"any_": [flow]}}}
    if state:
        body["flow_runs"] = {"state": {"type": {"any_": [state]}}}
    response = httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=10)
    response.raise_for_status()
    return response.json()


def completed_run(api_url: str, flow: str, deployment: str, timeout: float, watch: subprocess.Popen | None = None
                  ) -> dict:
    """The first COMPLETED run of ``flow``/``deployment`` within ``timeout`` seconds (AssertionError naming every
    run's state otherwise; early when the ``watch`` process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = flow_runs(api_url, flow, deployment, "COMPLETED")
        if done:
            return done[0]
        if watch is not None and watch.poll() is not None:
            break
        time.sleep(1)
    states = [(r["name"], r["state_type"], r["state_name"]) for r in flow_runs(api_url, flow, deployment)]
    raise AssertionError(f"no COMPLETED run of {flow}/{deployment} within {timeout:g} s; runs: {states}")


# ------------------------------------------------------------------------------------------------ Dask

def host_env(**extra: str) -> dict[str, str]:
    """A process as on another host of the lab: the project installed (this interpreter's environment), but no
    PYTHONPATH and no tracking or Prefect settings of this one."""
    env = quiet_env()
    for name in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MERGECAL_ROOT"):
        env.pop(name, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@contextmanager
def dask_scheduler(work_dir: Path | str, timeout: float = 120.0) -> Iterator[str]:
    """``dask scheduler`` on 127.0.0.1:<free port>, started in ``work_dir``; yields its address."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    port, dashboard = free_port(), free_port()
    address = f"tcp://{HOST}:{port}"
    command = [str(Path(sys.executable).parent / "dask"), "scheduler", "--host", HOST, "--port", str(port),
               "--dashboard-address", f"{HOST}:{dashboard}"]
    with _running(Server("Dask scheduler", command, address, f"http://{HOST}:{dashboard}/health"), host_env(),
                  work_dir / "scheduler.log", timeout, cwd=work_dir):
        yield address


@contextmanager
def dask_worker(address: str, work_dir: Path | str, name: str, *, preload: Path | str | None = None,
                timeout: float = 120.0, **env: str) -> Iterator[subprocess.Popen]:
    """One ``dask worker`` (one thread, no nanny: killed, it stays dead) of the scheduler at ``address``, started
    in ``work_dir`` with ``host_env(**env)``; yields its process."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    dashboard = free_port()
    command = [str(Path(sys.executable).parent / "dask"), "worker", address, "--nthreads", "1", "--no-nanny",
               "--name", name, "--host", HOST, "--dashboard-address", f"{HOST}:{dashboard}",
               "--local-directory", str(work_dir / "dask-scratch")]
    if preload:
        command += ["--preload", str(preload)]
    with _running(Server(f"Dask worker {name}", command, address, f"http://{HOST}:{dashboard}/health"),
                  host_env(**env), work_dir / "worker.log", timeout, cwd=work_dir) as proc:
        yield proc
