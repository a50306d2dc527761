"""Lecture slides (minibatch/slides.py): every notebook carries slide types; a deck builds with its figures and
demo animation, and headless Chromium renders a slide of it.

The render needs Debian's chromium (.ci/run installs it) and the reveal.js, require.js and jQuery npm packages
(.ci/run installs them into ~/.cache/minibatch/slides); without them that one test is skipped, saying which.
"""
import json
import shutil
import subprocess

import pytest

import exercises
from minibatch import slides

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _cells(*specs):
    return [{"cell_type": kind, "source": [text], "metadata": {}} for kind, text in specs]


def test_default_slide_types():
    cells = _cells(("markdown", "# Title"), ("code", "import torch"), ("markdown", "Some text"),
                   ("code", "x = 1"), ("code", "y = 2"), ("markdown", "## 2. Section"),
                   ("markdown", "**Predict.** How many?"), ("code", "print(3)"), ("markdown", "**Explain.** Why?"),
                   ("code", "import exercises.notebook\nexercises.notebook.skip_unfinished_cells()"))
    assert [slides.default_slide_type(cells, i) for i in range(len(cells))] == \
        ["slide", "-", "subslide", "-", "subslide", "slide", "subslide", "fragment", "fragment", "skip"]
    cells[3]["metadata"]["slideshow"] = {"slide_type": "notes"}
    assert slides.slide_type(cells, 3) == "notes"
    cells[3]["metadata"]["slideshow"] = {"slide_type": "big"}
    with pytest.raises(ValueError, match="unknown slide_type 'big'"):
        slides.slide_type(cells, 3)


@pytest.mark.parametrize("path", slides.notebook_paths(), ids=lambda p: p.name)
def test_every_notebook_cell_has_a_slide_type(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    missing = [i for i, c in enumerate(nb["cells"]) if "slide_type" not in c.get("metadata", {}).get("slideshow", {})
               and "exercises.notebook" not in "".join(c["source"])]       # a student release's guard cell: skipped
    assert not missing, (f"{path.name}: cells {missing} have no slide type: run `python -m minibatch slides --stamp "
                         f"{path.name}` (or set them in JupyterLab's property inspector)")
    for i in range(len(nb["cells"])):
        slides.slide_type(nb["cells"], i)                 # raises on an unknown one


@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    """Notebook 02 built as a deck, executed (its block-pool figures), with a stand-in demo animation."""
    from PIL import Image
    tmp = tmp_path_factory.mktemp("slides")
    (tmp / "demos").mkdir()
    frames = [Image.new("RGB", (64, 36), c) for c in ("#332288", "#44AA99")]
    frames[0].save(tmp / "demos" / "paged.gif", save_all=True, append_images=frames[1:], duration=200)
    log = []
    decks = slides.build(["02"], tmp / "out", demos=tmp / "demos", log=log.append)
    return tmp / "out", decks, log


def test_a_deck_has_its_slides_figures_and_demo(deck):
    out, decks, log = deck
    assert [d.name for d in decks] == ["02_paged_kv_cache.slides.html"]
    html = decks[0].read_text(encoding="utf-8")
    nb = json.loads(slides.notebook_paths(["02"])[0].read_text(encoding="utf-8"))
    new_slides = sum(slides.slide_type(nb["cells"], i) in ("slide", "subslide") for i in range(len(nb["cells"])))
    assert html.count("<section") >= new_slides + 1              # + the demo's slide
    if not exercises.REMOVED:          # in a student release an unfinished ex6 skips the cells that draw them
        assert html.count("data:image/png;base64,") >= 3         # draw_blocks, three times: the notebook ran
    assert '<img alt="paged" src="demo/paged.gif"' in html and (out / "demo" / "paged.gif").exists()
    assert "02_paged_kv_cache.slides.html" in (out / "index.html").read_text(encoding="utf-8")
    assert not any("stopped early" in line for line in log), log


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (on Debian: apt-get install chromium)")
def test_chromium_renders_a_slide(deck, tmp_path):
    out, decks, _ = deck
    if not (out / "lib" / "reveal.js" / "dist" / "reveal.js").exists():
        pytest.skip("reveal.js is not installed locally (npm install --prefix ~/.cache/minibatch/slides "
                    "reveal.js@4.6.1 requirejs jquery), and the test reaches no CDN")
    url = decks[0].as_uri() + "#/1"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--allow-file-access-from-files", "--virtual-time-budget=8000", "--window-size=1280,720"]
    dom = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    png = tmp_path / "slide.png"
    shot = subprocess.run(args + [f"--screenshot={png}", url], capture_output=True, text=True, timeout=120)
    assert png.exists(), shot.stderr[-2000:]
    assert '<div class="reveal' in dom and " ready" in dom.split('<div class="reveal', 1)[1].split(">", 1)[0], \
        "reveal.js did not initialise the deck"
    assert 'class="present"' in dom or "present" in dom, "no slide is shown"
    from PIL import Image
    img = Image.open(png).convert("L")
    dark = sum(img.histogram()[:128])
    assert img.size == (1280, 720) and dark > 2000, f"the slide looks blank ({dark} dark pixels)"
