"""docs/lab.md from an empty machine (#62), each command as the page shows it: the PostgreSQL roles and databases
(through PGHOST/PGPORT), the Prefect server on PostgreSQL, members' PREFECT_API_URL, the lab's repository made from
a smoke workspace, and a rerun's results committed and pushed. The page's commands run here are checked to be on
the page (the last test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab_servers import postgres_server, prefect_env, prefect_server  # noqa: I001
from mergecal.pipeline.schedule import pull_checkout
from mergecal.pipeline.workspace import create_workspace

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOC = REPO / "docs" / "lab.md"
PASSWORD = "pg-lab-pw"
RUN: list[str] = []  # the page's commands run here, as the page writes them


def shell(command: str, cwd: Path, env: dict, stdin: str = "", documented: bool = True) -> str:
    """``command`` through bash, in its own session (no terminal: PostgreSQL's password prompts read stdin)."""
    if documented:
        RUN.append(command)
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=300, start_new_session=True)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_roles_databases_and_prefect_on_postgres_as_documented(tmp_path):
    """The cluster's superuser (here the throwaway cluster's own, on a free port) makes the two roles and databases
    with the page's commands, reached through PGHOST/PGPORT; the Prefect server runs on its database; a member's
    client reaches it through PREFECT_API_URL."""
    from sqlalchemy import create_engine, text

    with postgres_server(tmp_path / "pg") as superuser_uri:
        port = superuser_uri.rsplit(":", 1)[1].split("/")[0]
        env = dict(os.environ, PGHOST="127.0.0.1", PGPORT=port, PGUSER="mergecal", PGDATABASE="mergecal")
        for role in ("mlflow", "prefect"):
            shell(f"createuser --pwprompt {role} && createdb --owner {role} {role}", tmp_path, env,
                  stdin=f"{PASSWORD}\n{PASSWORD}\n")
        url = f"postgresql+asyncpg://prefect:{PASSWORD}@127.0.0.1:{port}/prefect"
        RUN.append("export PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://prefect:PASSWORD@127.0.0.1:"
                   "5432/prefect")
        RUN.append("prefect server start --host 127.0.0.1 --port 4200")
        with prefect_server(tmp_path / "prefect-home", PREFECT_SERVER_DATABASE_CONNECTION_URL=url) as api_url:
            member = prefect_env(api_url, tmp_path / "member-home", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
            RUN.append("export PREFECT_API_URL=http://prefect.lab:4200/api")
            shell("prefect work-pool create gpu --type process", tmp_path, member)
            listed = shell("prefect work-pool ls", tmp_path, member, documented=False)
            assert "gpu" in listed
        engine = create_engine(f"postgresql+psycopg://prefect:{PASSWORD}@127.0.0.1:{port}/prefect")
        try:
            with engine.connect() as conn:  # the server's tables are in the prefect role's database
                assert conn.execute(text("SELECT name FROM work_pool")).scalars().all().count("gpu") == 1
                owners = set(conn.execute(text("SELECT tableowner FROM pg_tables WHERE schemaname = 'public'"))
                             .scalars())
                assert owners == {"prefect"}, owners
        finally:
            engine.dispose()
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # no SQLite beside it


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@lab.invalid", *args], cwd=root,
                          capture_output=True, text=True, check=True)
    return done.stdout


@pytest.fixture
def lab_repository(tmp_path):
    """The lab's repository made from a workspace as the page says (with what a smoke run leaves in it: the cell
    cache, the tracking store, the summaries), pushed to a bare repository; returns (bare, workspace)."""
    workspace = create_workspace(tmp_path / "workspace", root=REPO)  # what `mergecal smoke DIR` makes, unrun
    for leftover in (".mergecal/cells/store/cell.json", "mlruns/mlruns.db", "results/benchmark.json"):
        (workspace / leftover).parent.mkdir(parents=True, exist_ok=True)
        (workspace / leftover).write_text("{}\n")
    (workspace / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (workspace / "reports").mkdir(exist_ok=True)
    (workspace / "reports" / "leaderboard.md").write_text("# board 1\n")
    env = dict(os.environ, HOME=str(tmp_path / "home"), GIT_AUTHOR_NAME="lab", GIT_AUTHOR_EMAIL="lab@lab.invalid",
               GIT_COMMITTER_NAME="lab", GIT_COMMITTER_EMAIL="lab@lab.invalid")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "mergecal").symlink_to(REPO)  # ~/mergecal: the checkout it was made from
    shell("cp ~/mergecal/.gitignore .", workspace, env)
    shell('git add -A && git commit -m "lab repository"', workspace, env)
    bare = tmp_path / "lab.git"
    _git(tmp_path, "init", "-q", "--bare", str(bare))
    _git(workspace, "remote", "add", "origin", str(bare))
    _git(workspace, "push", "-q", "-u", "origin", "HEAD")
    return bare, workspace, env


@pytest.mark.slow  # a workspace copied, git and dvc init
def test_a_lab_repository_from_a_workspace_versions_the_pipeline_not_its_state(lab_repository, tmp_path):
    bare, workspace, _ = lab_repository
    tracked = _git(workspace, "ls-files").split()
    assert {"dvc.yaml", "params.yaml", "dvc.lock", "reports/leaderboard.md"} <= set(tracked)
    assert not [p for p in tracked if p.startswith((".mergecal/", "mlruns/", "results/"))], tracked
    clone = tmp_path / "member"
    _git(tmp_path, "clone", "-q", str(bare), str(clone))
    assert (clone / "dvc.yaml").is_file() and not (clone / "Makefile").exists()  # installed from a checkout
    assert not (clone / ".mergecal").exists()


@pytest.mark.slow
def test_a_reruns_results_committed_and_pushed_keep_the_next_rerun_going(lab_repository, tmp_path):
    """The page's way to keep a rerun's dvc.lock and reports: commit and push between reruns. The next rerun's pull
    is up to date; after a member's push the lab's push is refused, the next rerun stops in one line, and the
    page's `git pull --rebase && git push` lets it go on."""
    from mergecal.pipeline.schedule import RerunStopped

    bare, lab, env = lab_repository
    (lab / "dvc.lock").write_text("schema: '2.0'\nstages: {rerun: 1}\n")  # what a rerun rewrites
    (lab / "reports" / "leaderboard.md").write_text("# board 2\n")
    shell('git add dvc.lock reports && git commit -m "nightly rerun" && git push', lab, env)
    assert pull_checkout(lab).startswith("up to date with origin/")
    member = tmp_path / "member"
    _git(tmp_path, "clone", "-q", str(bare), str(member))
    assert (member / "reports" / "leaderboard.md").read_text() == "# board 2\n"

    (member / "params.yaml").write_text((member / "params.yaml").read_text() + "# a member's change\n")
    _git(member, "commit", "-qam", "member")
    _git(member, "push", "-q")
    (lab / "reports" / "leaderboard.md").write_text("# board 3\n")
    refused = subprocess.run(["bash", "-c", 'git add dvc.lock reports && git commit -m "nightly rerun" && git push'],
                             cwd=lab, env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "rejected" in refused.stderr, refused.stderr
    with pytest.raises(RerunStopped, match=r"has commits that origin/\S+ lacks"):
        pull_checkout(lab)
    shell("git pull --rebase && git push", lab, env)
    assert pull_checkout(lab).startswith("up to date with origin/")


def test_the_commands_run_here_are_on_the_page():
    """Runs last in this module (pytest keeps file order): each command above, as docs/lab.md writes it."""
    if not RUN:
        pytest.skip("the commands are collected by the tests above: run the module")
    page = DOC.read_text()
    missing = [command for command in RUN if command not in page]
    assert not missing, missing
