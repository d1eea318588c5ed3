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
