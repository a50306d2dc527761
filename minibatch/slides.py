"""Lecture slides from the notebooks: ``python -m minibatch slides [--out DIR] [--no-execute] [NOTEBOOK ...]``.

Each notebook becomes a reveal.js deck through nbconvert's ``slides`` exporter (what ``jupyter nbconvert --to
slides`` does), executed first so that its figures are in it; the lecture demo's animation for that lesson
(``python -m minibatch demo paged`` -> out/demo/paged.gif) closes the deck when it has been made. ``index.html``
lists the decks.

Slide types come from each cell's ``metadata.slideshow.slide_type`` (JupyterLab: Property Inspector > Slide Type);
a cell without one gets ``default_slide_type``: a heading starts a slide, other text a sub-slide when it follows
code, code stays with the text above it, and a "**Predict**" question's answer and its "**Explain**" prompt come
as fragments, one click each. ``--stamp`` writes those defaults into the notebooks that lack them.

reveal.js, require.js and jQuery come from their CDNs unless a folder holding the npm packages ``reveal.js`` (4.x),
``requirejs`` and ``jquery`` is found (``--assets``, ``$MINIBATCH_SLIDES_ASSETS``, or
``~/.cache/minibatch/slides/node_modules``; ``.ci/run`` puts them there with npm): then they are copied beside the
decks, which then open offline.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DEMOS = ROOT / "out" / "demo"
SLIDE_TYPES = ("slide", "subslide", "fragment", "skip", "notes", "-")
DEMO_FOR = {"02": "paged", "03": "continuous", "04": "speculative", "07": "tree"}   # notebook -> demo scenario
ASSETS = {"reveal.js": "reveal.js", "require.js": "requirejs/require.js", "jquery.js": "jquery/dist/jquery.min.js"}
EXECUTE_TIMEOUT = 600                                # seconds for one cell


def default_slide_type(cells: list, i: int) -> str:
    """The slide type of cell ``i`` when the notebook gives none (cells: nbformat dicts)."""
    cell, prev = cells[i], cells[i - 1] if i else None
    text = "".join(cell["source"]).lstrip()
    if cell["cell_type"] == "code" and "exercises.notebook" in text:      # a student release's guard cell
        return "skip"
    if i == 0 or (cell["cell_type"] == "markdown" and text.startswith("#")):
        return "slide"
    prev_text = "".join(prev["source"]).lstrip()
    if cell["cell_type"] == "markdown":
        if text.startswith("**Explain"):
            return "fragment"
        return "subslide" if prev["cell_type"] == "code" or text.startswith(("**Predict", "**Change")) else "-"
    if prev["cell_type"] == "markdown" and prev_text.startswith("**Predict"):
        return "fragment"                                 # the answer, one click after the question
    return "-" if prev["cell_type"] == "markdown" else "subslide"


def slide_type(cells: list, i: int) -> str:
    given = cells[i].get("metadata", {}).get("slideshow", {}).get("slide_type")
    if given is not None and given not in SLIDE_TYPES:
        raise ValueError(f"cell {i}: unknown slide_type {given!r}; choose one of {list(SLIDE_TYPES)}")
    return given or default_slide_type(cells, i)


def with_slide_types(nb: dict) -> int:
    """Fill in every missing slide type, in place; how many were missing."""
    missing = 0
    for i, cell in enumerate(nb["cells"]):
        meta = cell.setdefault("metadata", {})
        if "slide_type" not in meta.get("slideshow", {}):
            meta.setdefault("slideshow", {})["slide_type"] = slide_type(nb["cells"], i)
            missing += 1
    return missing


def stamp(path: Path) -> int:
    """Write the default slide types into a notebook file's cells that have none; how many it wrote."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    n = with_slide_types(nb)
    if n:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    return n


def notebook_paths(names=None) -> list:
    """notebooks/*.ipynb, or those named (a file name, or a prefix such as '03')."""
    every = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not names:
        return every
    out = []
    for name in names:
        hits = [p for p in every if p.name == name or p.name.startswith(name)]
        if not hits:
            raise ValueError(f"no notebook {name!r} in notebooks/; choose from {[p.name for p in every]}")
        out += hits
    return out


def find_assets(given=None):
    """The folder holding the npm packages reveal.js, requirejs and jquery, or None (the CDNs)."""
    for cand in (given, os.environ.get("MINIBATCH_SLIDES_ASSETS"), Path.home() / ".cache/minibatch/slides/node_modules"):
        if cand and all((Path(cand) / rel).exists() for rel in ASSETS.values()):
            return Path(cand)
    if given:
        raise FileNotFoundError(f"--assets {given}: expected {', '.join(ASSETS.values())} inside it "
                                f"(npm install --prefix DIR reveal.js@4 requirejs jquery; then DIR/node_modules)")
    return None


def execute(nb, path: Path) -> str:
    """Run the notebook in a Jupyter kernel started in notebooks/ (figures land in its outputs). "" when every
    cell ran, else where it stopped (a notebook that needs Triton stops at once on a machine without it)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("MPLBACKEND", None)                  # the kernel's inline backend: plt.show() emits a PNG
    client = NotebookClient(nb, timeout=EXECUTE_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        return str(e).strip().splitlines()[-1]
    return ""


def _demo_cell(name: str, out: Path, demos: Path):
    """A closing slide with the lecture demo's animation for this notebook, copied beside the deck; or None."""
    scenario = DEMO_FOR.get(name[:2])
    gif = demos / f"{scenario}.gif" if scenario else None
    if gif is None or not gif.exists():
        return None
    (out / "demo").mkdir(parents=True, exist_ok=True)
    shutil.copy(gif, out / "demo" / gif.name)
    import nbformat
    return nbformat.v4.new_markdown_cell(
        f"## The demo: `python -m minibatch demo {scenario}`\n\n![{scenario}](demo/{gif.name})",
        metadata={"slideshow": {"slide_type": "slide"}})


def build(names=None, out="out/slides", execute_cells=True, assets=None, demos=DEMOS, log=print) -> list:
    """Write one reveal.js deck per notebook (and index.html) into ``out``; the paths of the decks."""
    import nbformat
    from nbconvert import SlidesExporter
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    exporter = SlidesExporter(reveal_scroll=True, reveal_theme="simple", reveal_transition="none")
    found = find_assets(assets)
    if found is not None:                        # offline: the scripts beside the decks
        lib = out / "lib"
        shutil.copytree(found / "reveal.js" / "dist", lib / "reveal.js" / "dist", dirs_exist_ok=True)
        shutil.copytree(found / "reveal.js" / "plugin", lib / "reveal.js" / "plugin", dirs_exist_ok=True)
        shutil.copy(found / ASSETS["require.js"], lib / "require.js")
        shutil.copy(found / ASSETS["jquery.js"], lib / "jquery.js")
        exporter.reveal_url_prefix, exporter.require_js_url, exporter.jquery_url = \
            "lib/reveal.js", "lib/require.js", "lib/jquery.js"
    else:
        log("reveal.js, require.js and jQuery: from their CDNs (the decks need a network to open; --assets "
            "DIR makes them offline)")
    decks = []
    for path in notebook_paths(names):
        nb = nbformat.read(str(path), as_version=4)
        with_slide_types(nb)
        stopped = execute(nb, path) if execute_cells else ""
        if stopped:
            log(f"{path.name}: stopped early ({stopped}); the deck shows what ran")
        demo = _demo_cell(path.name, out, Path(demos))
        if demo is not None:
            nb.cells.append(demo)
        body, _ = exporter.from_notebook_node(nb)
        deck = out / path.with_suffix(".slides.html").name
        deck.write_text(body, encoding="utf-8")
        decks.append(deck)
        log(f"{deck}" + (" (with its demo animation)" if demo is not None else ""))
    items = "\n".join(f'<li><a href="{d.name}">{d.name.removesuffix(".slides.html")}</a></li>' for d in decks)
    (out / "index.html").write_text(f"<!doctype html><title>minibatch slides</title><h1>minibatch: lecture "
                                    f"slides</h1><ul>\n{items}\n</ul>\n", encoding="utf-8")
    return decks


def add_arguments(ap) -> None:
    ap.add_argument("notebooks", nargs="*", help="notebooks to build (a name or a prefix such as 03); default: all")
    ap.add_argument("--out", default="out/slides", help="output folder (default: out/slides)")
    ap.add_argument("--no-execute", action="store_true", help="do not run the notebooks first (no figures)")
    ap.add_argument("--assets", default=None, help="a node_modules folder holding reveal.js 4, requirejs and "
                                                  "jquery, copied beside the decks so they open offline")
    ap.add_argument("--stamp", action="store_true", help="write the default slide types into the notebooks' "
                                                        "cells that have none, and build nothing")


def main(args) -> int:
    if args.stamp:
        for path in notebook_paths(args.notebooks):
            print(f"{path.name}: {stamp(path)} cells given a slide type")
        return 0
    build(args.notebooks, args.out, execute_cells=not args.no_execute, assets=args.assets)
    return 0
