"""The Prefect server a flow talks to: one line, within seconds, when none answers (Prefect's client would
retry, then raise httpx.ConnectError from deep inside the flow or ``serve``)."""

from __future__ import annotations

from mergecal.errors import MergecalError

START_SERVER = ("start one with `mergecal ui` (or `prefect server start --host 127.0.0.1`), then "
                "export PREFECT_API_URL=http://127.0.0.1:4200/api")


def configured_api_url() -> str | None:
    """The server Prefect's client would use (PREFECT_API_URL, from the environment or the active profile);
    None: an ephemeral server of this process."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def check_server(api_url: str, who: str = "schedule", timeout: float = 5.0) -> None:
    """One MergecalError (``who``: the command that needs it) when no server answers at ``api_url``."""
    import httpx

    try:
        httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout).raise_for_status()
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        reason = str(err) or type(err).__name__
        raise MergecalError(f"{who}: no Prefect server answers at PREFECT_API_URL={api_url} ({reason}); "
                            f"{START_SERVER}") from None


# ------------------------------------------------------------------------------------------------ a deployment's runs

# the state types of a run that holds its deployment's concurrency slot: Prefect takes the slot when the run enters
# PENDING and gives it back when the run leaves PENDING, RUNNING and CANCELLING (the server's orchestration rules
# SecureFlowConcurrencySlots and ReleaseFlowConcurrencySlots)
HOLDING = ("PENDING", "RUNNING", "CANCELLING")
NOT_FINISHED = ("SCHEDULED", *HOLDING)


def read_deployment(name: str):
    """The deployment ``flow/deployment`` on the server of PREFECT_API_URL, or None when there is none."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


def deployment_runs(deployment_id, state_types: tuple[str, ...]) -> list:
    """The flow runs of the deployment ``deployment_id`` whose state type is one of ``state_types``, oldest
    expected start first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    wanted = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType(name) for name in state_types])))
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=wanted, sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                                     deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def cancel_run(run_id, message: str) -> str:
    """Set the flow run ``run_id`` Cancelled, forced, as Prefect's own runner marks a run it stopped (a run whose
    process is gone cannot take the Cancelling way: nobody would finish it); leaving PENDING or RUNNING gives the
    deployment's concurrency slot back. The state type it ends in."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelled(message=message), force=True)
        return client.read_flow_run(run_id).state_type.value


def leave_work_pool(deployment_id) -> None:
    """Take the deployment ``deployment_id`` off its work pool (and queue): no worker gets its runs any more."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        client.update_deployment(deployment_id, DeploymentUpdate(work_pool_name=None))
