"""Every notebook in notebooks/ runs top to bottom (quick setting) and is stored without outputs."""
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # a hang guard, not a speed check (tests do not time things; render_notebooks.py reports times)


def test_there_is_a_notebook_per_paper():
    names = {p.stem for p in NOTEBOOKS}
    for want in ("00_tour", "01_mergecomp", "02_sketch_fusion", "03_dear", "04_utility_of_compression",
                 "05_local_updates"):
        assert want in names, f"notebooks/{want}.ipynb is missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name} cell {i} has stored outputs; clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_headings(path):
    """The first cell is one title heading "# NN · ..." and no markdown heading has a doubled '#'
    ("# # 00 · ..." renders as a heading that reads "# 00 · ...")."""
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell is not markdown"
    title = first.source.splitlines()[0]
    assert re.fullmatch(rf"# {path.stem[:2]} · \S.*", title), f"{path.name}: first line {title!r} is not '# {path.stem[:2]} · ...'"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            assert not re.match(r"#+ +#", line), f"{path.name} cell {i}: doubled heading mark in {line!r}"


PAPERS = {"01_mergecomp": "arxiv.org/abs/2103.15195", "02_sketch_fusion": "sciencedirect.com",
          "03_dear": "arxiv.org/abs/2302.12445", "04_utility_of_compression": "proceedings.mlsys.org",
          "05_local_updates": "arxiv.org/abs/2311.08105",
          "06_your_compressor": "github.com/sands-lab/grace", "07_pull_the_plug": "github.com/pytorch/torchft",
          "08_across_the_internet": "arxiv.org/abs/2412.01152"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_links_its_paper_and_ends_with_an_exercise(path):
    nb = nbformat.read(path, as_version=4)
    intro = nb.cells[0].source
    links = re.findall(r"\]\(([^)\s]+)\)", intro)
    if path.stem in PAPERS:
        assert any(PAPERS[path.stem] in u and u.startswith("https://") for u in links), (path.name, links)
    else:  # the tour points at the four walkthroughs, and each of those files exists
        assert {u for u in links if u.endswith(".ipynb")} == {p.name for p in NOTEBOOKS if p.stem != path.stem}
    last = nb.cells[-1]
    assert last.cell_type == "markdown" and last.source.startswith("## Exercise"), path.name
    assert len(last.source.split()) > 30, f"{path.name}: the exercise says too little to be done"


def test_notebooks_default_to_the_runs_directory_of_every_command(tmp_path, monkeypatch):
    """One default everywhere: $COMMLAB_RUNS, else ./runs where you are (the CLI's, the UI's, the API's)."""
    from commlab.lab.front import notebook, ui
    from commlab.lab.base.paths import default_root
    monkeypatch.delenv("COMMLAB_RUNS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert Path(notebook.runs_dir()) == (tmp_path / "runs").resolve() == default_root().resolve() \
        == ui.runs_dir().resolve()
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path / "elsewhere"))
    assert Path(notebook.runs_dir()) == tmp_path / "elsewhere" == default_root() == ui.runs_dir()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_runs_top_to_bottom(path, tmp_path, monkeypatch):
    """Slow links are modeled here even as root (what every non-root user gets): shaped links, and the
    link calibration notebook 04 does as root, have tests of their own (test_shaped_runs.py, test_netns.py)."""
    monkeypatch.setenv("COMMLAB_QUICK", "1")
    monkeypatch.setenv("COMMLAB_SLOW_LINK", "modeled")
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path / "runs"))
    # the kernel runs in notebooks/: this checkout's commlab first, not whichever one the environment installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    # a notebook that writes a package of yours (06) keeps it in a temporary folder it names and leaves for you to
    # read; the test removes the folder its run made, so a suite leaves nothing in the temporary directory
    before = set(Path(tempfile.gettempdir()).glob("commlab-nb*"))
    try:
        client.execute()  # raises CellExecutionError naming the cell when any cell raises
    finally:
        for d in set(Path(tempfile.gettempdir()).glob("commlab-nb*")) - before:
            shutil.rmtree(d, ignore_errors=True)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_slow_links_are_shaped_as_root_unless_modeled_is_asked_for(monkeypatch):
    from commlab.lab.front import notebook
    monkeypatch.delenv("COMMLAB_SLOW_LINK", raising=False)
    root = os.geteuid() == 0
    assert notebook.slow_link(0.1) == {"link": "shaped" if root else "modeled", "gbps": 0.1}
    monkeypatch.setenv("COMMLAB_SLOW_LINK", "modeled")
    assert notebook.slow_link(1) == {"link": "modeled", "gbps": 1} and not notebook.can_shape()
    monkeypatch.setenv("COMMLAB_SLOW_LINK", "fast")
    with pytest.raises(ValueError, match="COMMLAB_SLOW_LINK: must be shaped or modeled, got 'fast'"):
        notebook.slow_link(1)


def test_commlab_notebooks_outside_a_checkout_says_so_first(monkeypatch, tmp_path):
    """From an installed wheel (no notebooks/), the error is the missing checkout, even where JupyterLab is
    missing too: installing it would not help (a GPU machine without JupyterLab showed the other order)."""
    import importlib.util

    from commlab.lab.front import jupyter
    from commlab.lab.base.errors import LabError
    monkeypatch.setattr(jupyter, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(LabError, match="source checkout"):
        jupyter.notebooks_main(port=18999, browser=False)
