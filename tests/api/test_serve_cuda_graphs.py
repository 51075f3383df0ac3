"""`loraplex serve --eager / --cuda-graphs`: the choice reaches the engine's config (default: graphs on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli.main import app

DEMO = Path(__file__).resolve().parents[2] / "demo"


@pytest.mark.parametrize("flags, want", [((), True), (("--eager",), False), (("--cuda-graphs",), True)])
def test_serve_passes_the_cuda_graphs_choice_to_the_engine(tmp_path, monkeypatch, flags, want):
    started = []
    monkeypatch.setattr("api.server.serve", lambda settings, **_: started.append(settings))
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "0", *flags], env=env)
    assert result.exit_code == 0, result.output
    assert [s.engine.cuda_graphs for s in started] == [want]
