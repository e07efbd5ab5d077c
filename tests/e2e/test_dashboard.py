"""/dashboard: a static page (no CDN) that plots /dashboard/stats, whose numbers agree with /metrics."""

from __future__ import annotations

import threading
import time

import httpx


def test_dashboard_page_is_self_contained(tiny_llama_dir: str, server_factory) -> None:
    with server_factory(tiny_llama_dir, "--max-model-len", "256") as server:
        page = httpx.get(server.url + "/dashboard", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "dashboard/stats" in page.text and "<canvas" in page.text
        assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere


def test_dashboard_stats_move_under_load_and_match_metrics(tiny_llama_dir: str, server_factory) -> None:
    with server_factory(tiny_llama_dir, "--max-model-len", "256", "--max-num-seqs", "4") as server:
        idle = httpx.get(server.url + "/dashboard/stats", timeout=10).json()
        assert idle["num_running"] == 0 and idle["generation_tokens_total"] == 0
        body = {"model": server.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 150, "ignore_eos": True}
        clients = [threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120))
                   for _ in range(8)]
        for client in clients:
            client.start()
        seen_busy = seen_rate = False
        deadline = time.monotonic() + 60
        while any(c.is_alive() for c in clients) and time.monotonic() < deadline:
            stats = httpx.get(server.url + "/dashboard/stats", timeout=10).json()
            seen_busy |= stats["num_running"] > 0 and stats["kv_cache_usage_percent"] > 0
            seen_rate |= (stats["generation_tokens_per_second"] or 0) > 0
            time.sleep(0.05)
        for client in clients:
            client.join(60)
        assert seen_busy and seen_rate
        stats = httpx.get(server.url + "/dashboard/stats", timeout=10).json()
        metrics = server.wait_idle()
        assert stats["generation_tokens_total"] == metrics["kvloom:generation_tokens_total"] == 8 * 150
        assert stats["num_running"] == metrics["kvloom:num_requests_running"] == 0
        assert stats["kv_cache_usage_percent"] == 100 * metrics["kvloom:kv_cache_usage_perc"] == 0
        hits, queries = metrics["kvloom:prefix_cache_hits_total"], metrics["kvloom:prefix_cache_queries_total"]
        assert stats["prefix_cache_hit_rate_percent"] == (100 * hits / queries if queries else None)


def _browser():
    """Headless Chromium through Selenium (Debian's chromium and chromium-driver), or a skip."""
    import shutil

    import pytest

    webdriver = pytest.importorskip("selenium.webdriver")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_dashboard_in_a_real_browser_moves_under_load_and_settles_on_the_metrics(tiny_llama_dir: str,
                                                                               server_factory) -> None:
    """The page, run by headless Chromium: its numbers change while requests run, and once they are done
    it shows what /metrics says (nothing running, the KV cache empty)."""
    browser = _browser()
    try:
        # Two sequences at a time: the load lasts several of the page's one-second polls.
        with server_factory(tiny_llama_dir, "--max-model-len", "256", "--max-num-seqs", "2") as server:
            browser.get(server.url + "/dashboard")

            def shown(key: str) -> str:
                return browser.find_element("id", f"value-{key}").text

            def updates() -> int:
                return int(browser.find_element("tag name", "body").get_attribute("data-updates") or 0)

            deadline = time.monotonic() + 30
            while updates() < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert updates() >= 1, browser.find_element("id", "status").text
            body = {"model": server.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 240, "ignore_eos": True}
            # Load that lasts until the page has polled a few times under it (a fast machine ran 16 fixed requests
            # of the tiny model within one poll: the page, rightly, never showed one running), 30 s at most.
            stop = threading.Event()

            def client() -> None:
                while not stop.is_set():
                    httpx.post(server.url + "/v1/completions", json=body, timeout=120)

            clients = [threading.Thread(target=client) for _ in range(8)]
            for c in clients:
                c.start()
            seen_running, seen_rates = set(), set()
            polls = updates() + 4
            deadline = time.monotonic() + 30
            while (updates() < polls or not seen_running - {"0", "–"}) and time.monotonic() < deadline:
                seen_running.add(shown("num_running"))
                seen_rates.add(shown("generation_tokens_per_second"))
                time.sleep(0.2)
            stop.set()
            for c in clients:
                c.join(120)
            assert len(seen_running - {"0", "–"}) >= 1 and len(seen_rates) >= 2  # the page moved
            metrics = server.wait_idle()
            settled = updates() + 2
            deadline = time.monotonic() + 15
            while updates() < settled and time.monotonic() < deadline:
                time.sleep(0.1)
            assert shown("num_running") == f"{metrics['kvloom:num_requests_running']:.0f}" == "0"
            assert shown("kv_cache_usage_percent") == f"{100 * metrics['kvloom:kv_cache_usage_perc']:.1f}"
            assert shown("num_preemptions") == f"{metrics['kvloom:num_preemptions_total']:.0f}"
    finally:
        browser.quit()
