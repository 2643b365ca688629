"""The pages in a real browser (issue 14): Debian's chromium, headless, driven by Selenium
through its chromedriver, against real `shardline serve` processes on loopback.

- The chat at `/` streams an answer equal to the API's greedy answer for the same prompt and
  settings, shows its tokens, time to first token and tokens per second, regenerates it the
  same, and stops a long one; with an API key the page asks for it once and keeps it.
- The fleet at `/fleet` draws the chain of a server with two worker processes (three stages:
  the coordinator's and one per worker, each with its address and layers) and marks a worker
  that is killed as down.

A failing test leaves a screenshot of the page in its temporary folder."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import CHAT_PROMPTS
from tests.multiproc.procs import Proc, serve, worker
from tests.serving.test_api import MODEL, Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
N_NEW = 24
WAIT_S = 120.0  # an answer on two busy cores
DOWN_S = 5.0  # a killed worker is marked down within this (the page polls every second)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@contextlib.contextmanager
def shot_on_failure(driver: WebDriver, folder: Path, name: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        driver.save_screenshot(str(folder / f"{name}.png"))
        raise


def _wait(driver: WebDriver, seconds: float, until: Callable[[WebDriver], object], what: str) -> None:
    try:
        WebDriverWait(driver, seconds, poll_frequency=0.1).until(until)
    except TimeoutException:
        raise AssertionError(f"not within {seconds:g} s: {what}") from None


def _set(driver: WebDriver, field: str, value: str) -> None:
    box = driver.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)


def _answers(driver: WebDriver) -> list[tuple[str, str, str]]:
    """(state, text, stats) of every answer on the page."""
    return [(a.get_attribute("data-state") or "", a.find_element(By.CLASS_NAME, "text").text,
             a.find_element(By.CLASS_NAME, "stats").text)
            for a in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")]


def _ask(driver: WebDriver, prompt: str) -> None:
    _set(driver, "prompt", prompt)
    driver.find_element(By.ID, "send").click()


def _done(n: int) -> Callable[[WebDriver], bool]:
    return lambda d: len(_answers(d)) == n and _answers(d)[-1][0] in ("done", "stopped", "error")


@pytest.fixture(scope="module")
def two(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=2)


@pytest.fixture(scope="module")
def server(two: Path) -> Iterator[Server]:
    s = Server(two, "--max-streams", "2")
    yield s
    s.stop()


def test_the_chat_streams_the_apis_greedy_answer(browser: WebDriver, server: Server, tmp_path: Path) -> None:
    prompt = CHAT_PROMPTS[2]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    api = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=N_NEW, temperature=0)
    want = api.choices[0].message.content or ""
    assert want and api.usage is not None
    with shot_on_failure(browser, tmp_path, "chat"):
        browser.get(f"{server.url}/")
        _wait(browser, 30, lambda d: d.find_element(By.ID, "model").text == MODEL, "the model's name shown")
        _set(browser, "temperature", "0")
        _set(browser, "max-tokens", str(N_NEW))
        _ask(browser, prompt)
        _wait(browser, WAIT_S, _done(1), "the answer finished")
        state, text, stats = _answers(browser)[0]
        assert (state, text) == ("done", want)
        assert stats.startswith(f"{api.usage.completion_tokens} tokens · first token ") and "tok/s" in stats
        assert browser.find_element(By.CSS_SELECTOR, ".msg.user .text").text == prompt

        browser.find_element(By.ID, "regenerate").click()  # the same settings: greedy gives it again
        _wait(browser, WAIT_S, _done(1), "regenerated")  # the old answer went at the click
        assert _answers(browser)[0][:2] == ("done", want)

        _set(browser, "max-tokens", "2000")  # a long answer, stopped at its first words
        _ask(browser, "Write a very long story about the sea.")
        _wait(browser, WAIT_S, lambda d: len(_answers(d)) == 2 and _answers(d)[1][1] != "", "a second answer begun")
        browser.find_element(By.ID, "stop").click()
        _wait(browser, 30, _done(2), "the second answer stopped")
        assert _answers(browser)[1][0] == "stopped" and _answers(browser)[1][2].endswith("· stopped")
        assert browser.find_element(By.ID, "error").text == ""


def test_the_chat_asks_for_the_api_key_once_and_keeps_it(browser: WebDriver, two: Path, tmp_path: Path) -> None:
    s = Server(two, "--max-streams", "1", "--api-key", "open-sesame-7")
    try:
        with shot_on_failure(browser, tmp_path, "key"):
            browser.get(f"{s.url}/")
            browser.execute_script("localStorage.clear()")
            browser.refresh()
            _wait(browser, 30, lambda d: d.find_element(By.ID, "key-dialog").is_displayed(), "the key asked for")
            assert browser.find_element(By.ID, "model").text == "…"
            _set(browser, "api-key", "open-sesame-7")
            browser.find_element(By.ID, "key-save").click()
            _wait(browser, 30, lambda d: d.find_element(By.ID, "model").text == MODEL, "the model shown")
            browser.refresh()  # kept in the browser: not asked again
            _wait(browser, 30, lambda d: d.find_element(By.ID, "model").text == MODEL, "the model shown again")
            assert not browser.find_element(By.ID, "key-dialog").is_displayed()
            assert browser.execute_script("return localStorage.getItem('shardline-api-key')") == "open-sesame-7"
    finally:
        browser.execute_script("localStorage.clear()")
        s.stop()


@pytest.fixture(scope="module")
def three(shards: Callable[..., Path]) -> Path:
    return shards("gguf", stages=3)


# Read in one script: the page redraws the chain every second, so elements found one call
# earlier may be gone by the next.
STAGES_JS = """return [...document.querySelectorAll('#chain .stage')].map(b => ({
  where: b.dataset.where, health: b.dataset.health, title: b.querySelector('h3').textContent,
  layers: b.querySelector('.layers').textContent, graph: b.querySelector('.graph').textContent,
  why: b.querySelector('.why').textContent, kv: b.querySelector('.kv').textContent,
  hops: document.querySelectorAll('#chain .hop').length}))"""


def _stages(driver: WebDriver) -> list[dict[str, Any]]:
    return list(driver.execute_script(STAGES_JS))


def test_the_fleet_page_draws_the_chain_and_marks_a_killed_worker(browser: WebDriver, three: Path,
                                                                  tmp_path: Path) -> None:
    workers = [worker(three, "1"), worker(three, "2")]
    proc: Proc | None = None
    try:
        proc = serve(["--shards", str(three), "--port", "0", "--model-id", MODEL, "--insecure",
                      "--workers", ",".join(w.addr for w in workers), "--max-streams", "2"])
        client = openai.OpenAI(base_url=proc.addr, api_key="unused", max_retries=0, timeout=WAIT_S)
        with shot_on_failure(browser, tmp_path, "fleet"):
            browser.get(proc.addr.removesuffix("/v1") + "/fleet")
            _wait(browser, 30, lambda d: len(_stages(d)) == 3, "three stages drawn")
            stages = _stages(browser)
            assert [(s["title"], s["where"], s["health"]) for s in stages] == [
                ("coordinator", "this process", "up"), (workers[0].addr, workers[0].addr, "up"),
                (workers[1].addr, workers[1].addr, "up")]
            assert [s["layers"] for s in stages] == ["0–9", "10–19", "20–29"] and stages[0]["hops"] == 2
            assert all(s["graph"] == "–" and s["kv"] == "0 MB" for s in stages)  # nothing ran yet
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                           max_tokens=8, temperature=0)
            _wait(browser, 10, lambda d: all(s["graph"].endswith(" ms") for s in _stages(d)),
                  "each stage's graph time per token")
            workers[1].proc.kill()
            _wait(browser, DOWN_S, lambda d: [s["health"] for s in _stages(d)] == ["up", "up", "down"],
                  "the killed worker marked down")
            assert workers[1].addr in _stages(browser)[2]["why"]
    finally:
        if proc is not None:
            proc.stop()
        for w in workers:
            w.stop()
