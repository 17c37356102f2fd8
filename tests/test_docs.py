"""The README and docs/ as a user meets them: their Python examples run, their links resolve, the
CLI reference matches the CLI, and no page carries a dated measurement or a tracker's number."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from infmoe_export.runtimes.ort_kernel import custom_op_library

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
OP_PAGES = sorted(page for page in (ROOT / "docs" / "reference" / "ops").glob("*.md") if page.stem != "README")


def python_blocks(path: Path) -> list:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def run_example(path: Path, code: str):
    exec(compile(code, str(path), "exec"), {"__name__": "__example__"})


def test_readme_is_short_and_has_the_generated_results_block():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    begin, end = text.index("<!-- results:begin -->"), text.index("<!-- results:end -->")
    assert begin < end


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    (code,) = python_blocks(README)
    monkeypatch.chdir(tmp_path)  # it writes model.onnx where it runs
    run_example(README, code)
    assert (tmp_path / "model.onnx").is_file()
    assert capsys.readouterr().out.strip()  # the generated text


def test_every_op_has_a_page():
    from infmoe_export.export.function import FUNCTIONS

    assert {page.stem for page in OP_PAGES} == set(FUNCTIONS)


@pytest.mark.skipif(custom_op_library() is None or not custom_op_library().is_file(),
                    reason="the kernel library is not installed: the examples run the kernels")
@pytest.mark.parametrize("page", OP_PAGES, ids=lambda page: page.stem)
def test_op_page_example_runs_and_matches_the_reference(page):
    (code,) = python_blocks(page)
    assert f'helper.make_node("{page.stem}"' in code
    run_example(page, code)


def test_cli_reference_is_current():
    generator = ROOT / "docs" / "reference" / "generate_cli.py"
    result = subprocess.run([sys.executable, str(generator), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(heading.replace("`", "")) for heading in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_dated_measurement_or_tracker_number(page):
    """No page carries a date, the README's generated results table included (the run's date
    is in its results JSON)."""
    text = page.read_text(encoding="utf-8")
    assert not re.findall(r"20\d\d-[01]\d-[0-3]\d", text)
    assert not re.findall(r"(?i)issue \d+|#\d+", text)
