"""A short soak (loadtest/soak.py; `make soak` runs the long one): a minute of mixed
chat/completions load from two tenants, streamed or not, with clients leaving mid-stream,
then no request lost, no KV block or request left in the model, RSS back near its
post-warm-up baseline, and each tenant served again. Starts a stack of its own."""

from __future__ import annotations

import pytest

from loadtest.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_minute_of_mixed_load_leaves_nothing_behind(tmp_path):
    result = run_soak(SoakConfig(minutes=1.0, users=6, warmup_s=10.0, out_dir=tmp_path))
    print((tmp_path / "summary.md").read_text())
    assert result.problems == []
    assert result.samples.count("ok") >= 5
    assert result.samples.count("left") > 0, "no client left mid-stream: the disconnect path went untested"
    assert {row["tenant"] for row in result.samples.rows} == {0, 1}
    for plot in ("latency.png", "throughput.png", "rss.png"):
        assert (tmp_path / plot).stat().st_size > 0
