"""Real servers on 127.0.0.1 (tests/lab_servers.py): MLflow over PostgreSQL with proxied artifacts shared by two
clients, Prefect's scheduler firing a served deployment, and a process work pool run by a worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mergecal.ui import stop

from lab_servers import (PREFECT_SERVER_LOG, completed_run, postgres_server, mlflow_server, prefect_env,  # noqa: I001
                         prefect_server)

pytestmark = pytest.mark.integration

FLOW_NAME = "lab-tiny"
FLOW_MODULE = "lab_tiny_flow"
FLOW_SOURCE = f'''
from prefect import flow


@flow(name="{FLOW_NAME}", log_prints=True)
def tiny(x: int = 1) -> int:
    print("tiny ran with", x)
    return x + 1
'''


# ------------------------------------------------------------------------------------------------ MLflow + Postgres

def test_mlflow_server_over_postgres_shares_runs_and_artifacts(tmp_path):
    from mlflow import MlflowClient
    from sqlalchemy import create_engine, text

    artifacts = tmp_path / "artifacts"
    with postgres_server(tmp_path / "pg") as pg_uri, mlflow_server(pg_uri, artifacts) as url:
        users = [MlflowClient(tracking_uri=url) for _ in range(2)]  # two checkouts, one shared server
        experiment_id = users[0].create_experiment("shared")  # no artifact_location: the server picks it
        experiment = users[1].get_experiment(experiment_id)
        assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
        run_ids = []
        for i, client in enumerate(users):
            checkout = tmp_path / f"checkout{i}"
            checkout.mkdir()
            (checkout / f"result{i}.txt").write_text(f"user {i}\n")
            run = client.create_run(experiment_id, run_name=f"user{i}")
            client.log_metric(run.info.run_id, "score", float(i))
            client.log_artifact(run.info.run_id, str(checkout / f"result{i}.txt"))
            client.set_terminated(run.info.run_id)
            run_ids.append(run.info.run_id)

        for i, run_id in enumerate(run_ids):
            stored = artifacts / experiment_id / run_id / "artifacts" / f"result{i}.txt"
            assert stored.read_text() == f"user {i}\n"
        seen = MlflowClient(tracking_uri=url).search_runs([experiment_id])
        assert sorted(r.info.run_id for r in seen) == sorted(run_ids)
        assert {r.data.metrics["score"] for r in seen} == {0.0, 1.0}

        engine = create_engine(pg_uri)
        try:
            with engine.connect() as conn:
                assert engine.dialect.name == "postgresql"
                assert conn.execute(text("SELECT count(*) FROM runs")).scalar_one() == 2
                stored_ids = conn.execute(text("SELECT run_uuid FROM runs WHERE experiment_id = :e"),
                                          {"e": int(experiment_id)}).scalars().all()
                assert sorted(stored_ids) == sorted(run_ids)
        finally:
            engine.dispose()
    for i in range(2):  # nothing written beside the checkouts: artifacts went through the server
        assert sorted(p.name for p in (tmp_path / f"checkout{i}").iterdir()) == [f"result{i}.txt"]


# ------------------------------------------------------------------------------------------------ Prefect

@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    """One Prefect server for the module's tests; yields (api_url, home, flow module dir)."""
    root = tmp_path_factory.mktemp("prefect")
    code = root / "code"
    code.mkdir()
    (code / f"{FLOW_MODULE}.py").write_text(FLOW_SOURCE)
    with prefect_server(root / "home") as api_url:
        yield api_url, root / "home", code


def client_env(prefect, **extra):
    api_url, home, code = prefect
    return prefect_env(api_url, home, PYTHONPATH=str(code), **extra)


def wait_for_completed_run(api_url: str, deployment: str, timeout: float, watch: subprocess.Popen | None = None
                           ) -> dict:
    return completed_run(api_url, FLOW_NAME, deployment, timeout, watch)


def stop_process(proc: subprocess.Popen) -> None:
    stop(proc, timeout=10)  # the whole process group: the runner's or worker's flow-run subprocesses too


def cli(env: dict, cwd, *args: str, timeout: float = 120) -> str:
    """``prefect ARGS`` against the test server; asserts exit 0, returns its stdout."""
    result = subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=cwd, capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (f"prefect {' '.join(args)}: exit {result.returncode}\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def test_prefect_scheduler_fires_served_deployment(prefect, tmp_path):
    api_url, home, code = prefect
    script = textwrap.dedent(f"""
        import prefect
        from prefect.deployments.runner import EntrypointType
        from {FLOW_MODULE} import tiny

        deployment = tiny.to_deployment(name="every-5s", interval=5, entrypoint_type=EntrypointType.MODULE_PATH)
        prefect.serve(deployment)
    """)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=code, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=client_env(prefect, PREFECT_RUNNER_POLL_FREQUENCY="2"))
    try:
        try:
            run = wait_for_completed_run(api_url, "every-5s", 90, watch=proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- serve log ---\n{log_path.read_text()[-3000:]}\n--- server log ---\n"
                                 f"{(home / PREFECT_SERVER_LOG).read_text()[-3000:]}") from None
        assert run["auto_scheduled"], run  # made by the scheduler, not by hand
    finally:
        stop_process(proc)
    server_log = (home / PREFECT_SERVER_LOG).read_text()
    assert "bulk DML" not in server_log, server_log[-3000:]


def test_prefect_process_work_pool_runs_deployment(prefect, tmp_path):
    api_url, home, code = prefect
    env = client_env(prefect)
    pool = "lab-process-pool"

    cli(env, code, "work-pool", "create", pool, "--type", "process")
    # register the deployment (no image, no remote storage: the worker imports the module through PYTHONPATH)
    # and ask for one run of it
    script = textwrap.dedent(f"""
        from prefect.deployments import run_deployment
        from prefect.deployments.runner import EntrypointType
        from {FLOW_MODULE} import tiny

        deployment = tiny.to_deployment(name="pool-run", work_pool_name={pool!r},
                                        entrypoint_type=EntrypointType.MODULE_PATH)
        deployment.apply(work_pool_name={pool!r})
        run = run_deployment("{FLOW_NAME}/pool-run", timeout=0)
        print("FLOW_RUN", run.id)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=code, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_id = result.stdout.split("FLOW_RUN", 1)[1].split()[0]

    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--run-once"],
                                  env=env, cwd=code, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        try:
            assert wait_for_completed_run(api_url, "pool-run", 90)["id"] == run_id
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- worker log ---\n{log_path.read_text()[-4000:]}") from None
        worker.wait(timeout=60)  # --run-once: it exits once its run is done
    finally:
        stop_process(worker)


def test_prefect_deployment_ls_answers(prefect):
    """``prefect deployment ls`` sends explicit nulls (limit, sort) in its filter body: FastAPI 0.150.0 applies the
    defaults, FastAPI >= 0.151 answers 422 (measured with Prefect 3.8.8's server; 0.154.0 fails too)."""
    api_url, home, code = prefect
    cli(client_env(prefect), code, "deployment", "ls")
