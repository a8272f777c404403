"""The documentation site: `mkdocs build --strict` passes (no broken link, nav entry or API
reference), every page of docs/ is in the nav, and the home page renders with its navigation in
a real headless browser (Chromium, which .ci/run installs from Debian's packages)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT_DIR

ROOT = Path(ROOT_DIR)
NAV = ["Port a script", "Strategies", "Checkpoints", "Launching", "Troubleshooting", "Architecture",
       "API reference", "Benchmarks"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_its_api_reference(site):
    api = (site / "api" / "index.html").read_text()
    for name in ("paratrain.Session", "paratrain.ZeRO", "paratrain.checkpoint.save", "paratrain.install_flight_recorder"):
        assert name in api, name
    assert "train_step" in api  # a method's docstring, not only the class's name


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    missing = [p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M)]
    assert not missing, f"pages left out of mkdocs.yml's nav: {missing}"


def _browser() -> str:
    found = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if found is None:
        pytest.skip("no headless Chromium on this machine: `apt-get install chromium` (.ci/run does)")
    return found


def test_the_home_page_renders_with_its_navigation_in_a_browser(site, tmp_path):
    browser = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    page = (site / "index.html").as_uri()
    dom = subprocess.run([*browser, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    links = re.findall(r'class="md-nav__link[^"]*"[^>]*>\s*(?:<[^>]+>\s*)*([^<]+?)\s*<', dom)
    assert all(entry in links for entry in NAV), links
    assert re.search(r"<h1[^>]*>paratrain", dom)
    shot = tmp_path / "home.png"
    subprocess.run([*browser, "--window-size=1280,900", f"--screenshot={shot}", page], capture_output=True,
                   timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a drawn page, not a blank one


def home_page_of(readme: str) -> str:
    """The site's home page is the README with its links made relative to docs/ (source files
    shown as code: the site holds no sources) and without the lines about the site itself."""
    text = readme.replace("](docs/", "](")
    text = re.sub(r"\[(`paratrain/[^`]+`)\]\(paratrain/[^)]+\)", r"\1", text)
    text = text.replace("[Changelog](CHANGELOG.md)", "[Changelog](changelog.md)")
    text = text.replace("Apache-2.0 ([LICENSE](LICENSE)).", "Apache-2.0 (the `LICENSE` file in the repository).")
    text = text.replace("The docs are a site: `pip install -e \".[docs]\" && mkdocs serve`, or read the pages here.\n\n", "")
    return text.replace("## Documentation\n", "## Contents\n")


def test_the_home_page_is_the_readme():
    assert (ROOT / "docs" / "index.md").read_text() == home_page_of((ROOT / "README.md").read_text())
