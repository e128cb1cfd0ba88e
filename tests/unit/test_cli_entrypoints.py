"""The installed commands: ``kv-release-sidecar`` and llm-d's binary name ``pd-sidecar``."""

from __future__ import annotations

import pytest

from sidecar import cli


def test_pd_sidecar_takes_llm_ds_flags_as_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["/app/pd-sidecar", "--help"])
    with pytest.raises(SystemExit) as stopped:
        cli.pd_sidecar_entrypoint()
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kv-release-sidecar pd-sidecar")


def test_pd_sidecar_refuses_a_flag_llm_d_never_had(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["/app/pd-sidecar", "--port=8000", "--no-such-flag=1"])
    with pytest.raises(SystemExit) as stopped:
        cli.pd_sidecar_entrypoint()
    assert stopped.value.code == 2
    assert "no-such-flag" in capsys.readouterr().err
