"""Remake docs/chat.png and docs/fleet.png: `shardline serve` with its stages 1 and 2 on two
`shardline worker` processes (loopback, in clear), one chat answered in the page, and the fleet
page, in Debian's headless chromium.

    python docs/screenshots.py --shards DIR    # a 3-stage export, e.g. `shardline export --stages 3`
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

SHARDLINE = str(Path(sys.executable).parent / "shardline")
HERE = Path(__file__).parent


def started(args: list[str], pattern: str) -> tuple[subprocess.Popen[str], str]:
    """A shardline process and the address its first matching line names."""
    proc = subprocess.Popen([SHARDLINE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if found := re.search(pattern, line):
            return proc, found.group(1)
    raise SystemExit(f"{args[0]} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=Path, required=True)
    a = ap.parse_args()
    procs = []
    try:
        for stage in ("1", "2"):
            proc, addr = started(["worker", "--shards", str(a.shards), "--stage", stage, "--listen", "127.0.0.1:0",
                                  "--insecure"], r"listening on (\S+)")
            procs.append((proc, addr))
        server, url = started(["serve", "--shards", str(a.shards), "--port", "0", "--insecure", "--workers",
                               ",".join(addr for _, addr in procs)], r"on (http://\S+)/v1")
        procs.append((server, url))
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,760"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(f"{url}/")
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").text != "…")
            driver.find_element(By.ID, "prompt").send_keys("Explain in two sentences why the sky is blue.")
            driver.find_element(By.ID, "send").click()
            WebDriverWait(driver, 120).until(
                lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-state") == "done")
            driver.save_screenshot(str(HERE / "chat.png"))
            driver.get(f"{url}/fleet")
            time.sleep(2.5)  # two polls: the recent figures filled in
            driver.save_screenshot(str(HERE / "fleet.png"))
        finally:
            driver.quit()
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()
    print(f"wrote {HERE / 'chat.png'} and {HERE / 'fleet.png'}")


if __name__ == "__main__":
    main()
