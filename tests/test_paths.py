"""Where things live (one project root, never the working directory), progress bars as
lines under ``sprpo-reproduce``, and the benchmark report generated from benchmark JSON."""
from __future__ import annotations

import io

import pytest

from sprpo_lib.infra import paths
from sprpo_lib.infra.progress import PROGRESS_ENV, progress_bar


def test_project_root_is_the_checkout_or_sprpo_home(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.HOME_ENV, raising=False)
    assert paths.project_root() == paths.package_checkout()
    assert (paths.project_root() / "notebooks").is_dir()
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    assert paths.project_root() == tmp_path.resolve()
    assert paths.runs_dir("train", "x") == tmp_path.resolve() / "runs" / "train" / "x"
    assert paths.figures_dir() == tmp_path.resolve() / "figures"
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "typo"))  # never created silently
    with pytest.raises(RuntimeError, match="no such folder.*mkdir -p"):
        paths.project_root()
    assert not (tmp_path / "typo").exists()


def test_no_path_depends_on_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.HOME_ENV, raising=False)
    here = paths.project_path("figures")
    monkeypatch.chdir(tmp_path)
    assert paths.project_path("figures") == here == paths.package_checkout() / "figures"
    assert paths.project_path(tmp_path / "abs") == tmp_path / "abs"  # absolute paths are kept
    assert paths.project_path("~/x") == paths.Path.home() / "x"


def test_an_install_outside_a_checkout_asks_for_sprpo_home(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.HOME_ENV, raising=False)
    monkeypatch.setattr(paths, "package_checkout", lambda: tmp_path)  # site-packages: no notebooks/ beside it
    with pytest.raises(RuntimeError, match="set SPRPO_HOME"):
        paths.project_root()


def test_progress_bars_print_lines_under_reproduce(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setenv(PROGRESS_ENV, "lines")
    bar = progress_bar(range(3), desc="train sprpo", file=buf, mininterval=0)
    assert type(bar).__module__ == "tqdm.std"  # plain text, whatever the front end
    list(bar)
    bar.close()
    assert "train sprpo" in buf.getvalue() and "3/3" in buf.getvalue()
    monkeypatch.delenv(PROGRESS_ENV)
    assert type(progress_bar(range(1), disable=True)).__module__ in ("tqdm.std", "tqdm.notebook", "tqdm.asyncio")


def test_stage_table_keeps_recorded_compute_this_machine_does_not_hold(tmp_path):
    """A render-only pass on a machine without the runs and cells keeps the recorded compute
    of the table it replaces instead of erasing it."""
    from sprpo_lib.reproduce import stage_table

    previous = ("| notebook | wall time (last pass) | recorded compute | date | machine |\n|---|---|---|---|---|\n"
                "| `01_training` | 0.2 min | 213.6 min | 2026-11-27 | X |\n| `04_robustness` | 0.2 min | 46.0 min | | |\n")
    got = stage_table("cpu", out_dir=tmp_path / "figures", runs_dir=tmp_path / "runs", previous=previous)
    assert "| `01_training` | not run | 213.6 min |" in got and "| `04_robustness` | not run | 46.0 min |" in got
    assert got.strip().splitlines()[-1] == "| all | 0.0 min | 259.6 min | | |"
    assert "| `01_training` | not run |  |" in stage_table("cpu", out_dir=tmp_path / "figures", runs_dir=tmp_path / "runs")


def test_recorded_compute_text_reads_back_per_machine_class():
    """The stage table's recorded-compute text and its reading back (a table kept from another
    machine) agree for no class, one class, several, and a GPU's name with spaces."""
    from collections import Counter

    from sprpo_lib.reproduce import UNNAMED, compute_text, parse_compute

    for secs, text in (({UNNAMED: 738.0}, "12.3 min"), ({"amx": 738.0}, "12.3 min (amx)"),
                       ({"NVIDIA H200": 738.0}, "12.3 min (NVIDIA H200)"),
                       ({"amx": 720.0, "avx512_bf16": 480.0}, "20.0 min (amx 12.0, avx512_bf16 8.0)"),
                       ({"NVIDIA H200": 720.0, UNNAMED: 480.0}, "20.0 min (NVIDIA H200 12.0, unnamed 8.0)")):
        assert compute_text(Counter(secs)) == text and parse_compute(text) == Counter(secs)
    assert compute_text(Counter()) == ""
