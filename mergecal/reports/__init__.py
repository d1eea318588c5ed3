"""Reports built from the MLflow store: the leaderboard (Markdown, self-contained HTML, JSON for DVC), the papers'
diagnostic plots and the history across invocations (``write.write_reports``), the lab-wide board (``lab``), and
the pieces other stages read on their own (``intervals``: bootstrap intervals; ``stability``: the stability
section). This package file imports nothing, so that a stage importing one of those pieces does not depend on
the rest (the stability stage reruns on an edit of ``intervals.py`` or ``stability.py``, not of the leaderboard's
code)."""
