"""The playground page's Engine tab under a real load, its API-key prompt against a keyed
server, UI=0, and the page's Prometheus arithmetic (prom.js) against a plain reference."""

from __future__ import annotations

import random
import threading

import httpx
import openai
import pytest

from launcher import Stack
from tests.helpers.browser import open_page

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def keyed(triton_only, model_path):
    with Stack(model_path, triton=triton_only, env={"API_KEYS": "key-ui:alice,key-other:bob"}) as running:
        yield running


def _load(stack: Stack, api_key: str, streams: int = 4, rounds: int = 3) -> threading.Thread:
    """`streams` clients, each sending `rounds` requests of 48 tokens, in the background."""
    client = openai.OpenAI(base_url=stack.base_url, api_key=api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one_stream() -> None:
        for _ in range(rounds):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Describe a forest."}],
                max_tokens=48, extra_body={"ignore_eos": True},
            )  # fmt: skip

    def run() -> None:
        workers = [threading.Thread(target=one_stream) for _ in range(streams)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _charts(page) -> dict[str, tuple[int, list]]:
    """Each chart's point count and latest values, as the page drew them."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('figure.chart')].map(
             (el) => [el.dataset.chart, [Number(el.dataset.points), JSON.parse(el.dataset.last || '[]')]]))"""
    )


def test_the_engine_charts_move_under_load(browser, keyed):
    opened = open_page(browser, keyed.frontend.url + "/#engine", api_key="key-ui")
    page = opened.page
    try:
        page.wait_for_function("document.querySelector('[data-chart=requests]').dataset.points >= 2")
        before = _charts(page)
        seen: dict[str, float] = {"running": 0, "kv": 0, "tokens": 0, "alice": 0}
        load = _load(keyed, "key-ui")
        while load.is_alive():
            charts = _charts(page)
            running, _ = charts["requests"][1]
            seen["running"] = max(seen["running"], running or 0)
            seen["kv"] = max(seen["kv"], charts["kv"][1][0] or 0)
            seen["tokens"] = max(seen["tokens"], charts["tokens"][1][0] or 0)
            page.wait_for_timeout(250)
        page.wait_for_timeout(3000)  # two more scrapes: the last requests' counters and histograms
        after = _charts(page)
        assert seen["running"] >= 1 and seen["kv"] >= 1 and seen["tokens"] > 0, seen
        assert after["requests"][0] > before["requests"][0] + 2  # the charts kept drawing
        assert all(value is not None for value in after["ttft"][1] + after["itl"][1]), after
        assert page.locator("[data-chart=tenants] output").inner_text().startswith("alice")
        assert page.locator("[data-chart=tenants] .u-legend").inner_text().count("alice") == 1
        assert opened.errors == []
    finally:
        opened.close()


def test_a_wrong_key_shows_the_apis_error_and_a_right_one_chats(browser, keyed):
    refusal = httpx.get(keyed.base_url + "/models", headers={"Authorization": "Bearer wrong-key"}).json()["error"]
    opened = open_page(browser, keyed.frontend.url + "/")
    page = opened.page
    try:
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "wrong-key")
        page.click("#key-submit")
        page.wait_for_selector("#key-dialog[open] #key-error:not([hidden])")
        assert page.locator("#key-error").inner_text() == refusal["message"]
        page.fill("#key-input", "key-ui")
        page.click("#key-submit")
        page.wait_for_selector("#model option", state="attached")
        page.fill("#max_tokens", "8")
        page.fill("#prompt", "Hello!")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".message.assistant[data-finish]", timeout=120000)
        assert page.locator(".message.assistant").get_attribute("data-finish") in ("stop", "length")
        assert page.evaluate("sessionStorage.getItem('llm-playground-api-key')") == "key-ui"
        curl = page.locator("#curl").text_content()
        assert '"Authorization: Bearer $API_KEY"' in curl and "key-ui" not in curl
        # what the browser saw: the 401s of the first load and of the wrong key; nothing else
        assert opened.errors and all("401" in error for error in opened.errors), opened.errors
    finally:
        opened.close()
    fresh = open_page(browser, keyed.frontend.url + "/")  # a new session: the key is asked for again
    try:
        fresh.page.wait_for_selector("#key-dialog[open]")
    finally:
        fresh.close()


def test_ui_0_leaves_the_page_out(triton_only, model_path, stack):
    page = httpx.get(stack.frontend.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(stack.frontend.url + "/ui/vendor/uPlot.LICENSE").text.startswith("The MIT License")
    with Stack(model_path, triton=triton_only, env={"UI": "0"}) as bare:
        assert httpx.get(bare.frontend.url + "/").status_code == 404
        assert httpx.get(bare.frontend.url + "/ui/main.js").status_code == 404
        assert httpx.get(bare.base_url + "/models").status_code == 200


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) buckets, written out plainly."""
    observed = buckets[-1][1]
    if observed <= 0:
        return None
    rank = q * observed
    for i, (le, count) in enumerate(buckets):
        if count >= rank:
            lower, below = buckets[i - 1] if i else (0.0, 0.0)
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below) if count > below else le
    return buckets[-2][0]


def test_prom_js_quantiles_equal_prometheus_arithmetic(browser, stack):
    opened = open_page(browser, stack.frontend.url + "/")
    rng = random.Random(7)
    try:
        for _ in range(40):
            bounds = sorted(rng.sample([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10], rng.randint(2, 8)))
            earlier, now, count_before, count_now = [], [], 0, 0
            for le in [*bounds, float("inf")]:
                count_before += rng.randint(0, 5)
                count_now += rng.randint(0, 9)
                earlier.append((le, count_before))
                now.append((le, count_before + count_now))
            window = [(le, b - a) for (le, b), (_, a) in zip(now, earlier, strict=True)]
            for q in (0.5, 0.9, 0.99):
                got = opened.page.evaluate(
                    """async ([q, now, before]) => {
                         const prom = await import('./ui/prom.js');
                         const inf = (rows) => rows.map(([le, c]) => [le === 'inf' ? Infinity : le, c]);
                         return prom.quantile(q, inf(now), inf(before));
                       }""",
                    [q, _js(now), _js(earlier)],
                )
                want = _histogram_quantile(q, window)
                assert got == pytest.approx(want, rel=1e-12, abs=1e-15) if want is not None else got is None
        parsed = opened.page.evaluate(
            """async (text) => {
                 const prom = await import('./ui/prom.js');
                 const scrape = prom.parseMetrics(text);
                 return [prom.total(scrape, 'a_total'), [...prom.byLabel(scrape, 'a_total', 'tenant')]];
               }""",
            'a_total{tenant="x\\"y",m="1"} 2\na_total{tenant="z"} 3.5\n# a comment\nb 1\n',
        )
        assert parsed == [5.5, [['x"y', 2], ["z", 3.5]]]
    finally:
        opened.close()


def _js(rows: list[tuple[float, float]]) -> list[list]:
    """Buckets as JSON carries them to the page (+Inf as "inf")."""
    return [["inf" if le == float("inf") else le, count] for le, count in rows]
