"""The default matrix's recipe ids, pinned as literal strings: a refactor of the tracks, the cells or the scaling
path (#33) must leave every cell's canonical recipe, grid and scaling source as they are."""

from pathlib import Path

import pytest

from mergecal.pipeline.cells import enumerate_cells
from mergecal.pipeline.config import load_params

REPO = Path(__file__).resolve().parents[1]
GRID = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SVC = ("svc(alpha=None,calibrate_at='unit_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',"
       "roundoff_guard=True,solver='gram',space='column',targeted_task=None)")
WSC = "wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)"
FSC = ("fsc(aggregate='mean',conservative='xor',data='task',n_samples_per_task=1,norm='l1',sensitive=None,"
       "token_ratios='per_token')")
DISTAC = ("distac(apply_to='largest_norm',batch_size=128,beta=0.5,grad_clip=1.0,kappa=None,lr=0.0001,optimizer='adam',"
          "schedule='constant',seed=0,steps=50,t_student=10.0,t_teacher=10.0,warmup_fraction=0.0)")


@pytest.fixture(scope="module")
def vision_standard():
    cells = enumerate_cells(load_params(REPO / "params.yaml"))
    return {c.chain: c for c in cells
            if c.track == "vision" and c.regime == "standard" and c.merge == "task_arithmetic"}


@pytest.mark.parametrize("chain, recipe, grid, source", [
    ("{merge}>svc", f"task_arithmetic(scaling=0.05)→{SVC}", GRID, ""),
    ("{merge}(scaling=0.3)>wsc", f"task_arithmetic(scaling=0.3)→{WSC}", (), ""),
    ("{merge}(scaling=1.0)>svc", f"task_arithmetic(scaling=1.0)→{SVC}", (), ""),
    ("distac>{merge}>svc>dsc", f"{DISTAC}→task_arithmetic(scaling=0.05)→{SVC}→{WSC}→{FSC}", GRID, "distac>{merge}"),
    ("{merge}>dsc", f"task_arithmetic(scaling=0.05)→{WSC}→{FSC}", GRID, "{merge}"),
])
def test_default_matrix_recipe_ids_are_pinned(vision_standard, chain, recipe, grid, source):
    cell = vision_standard[chain]
    assert (cell.recipe, cell.grid, cell.scaling_from) == (recipe, grid, source)
