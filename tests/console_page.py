"""The console page (skippy_zmq/api/console_assets) as a browser test drives it: a page object
over Selenium, reading only what the page shows (text, the data- attributes it sets)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

WAIT_S = 60.0          # a page update: one status poll (1 s) or a key check
CHAT_DEADLINE_S = 300  # a whole answer from the real model on a shared CPU
SAMPLE_S = 0.05        # how often the test looks at a streaming answer

_ROWS_JS = """
return Array.from(document.querySelectorAll('#stages tbody tr')).map(
  (tr) => [tr.dataset.stage, Object.fromEntries(Array.from(tr.querySelectorAll('[data-field]')).map(
    (node) => [node.dataset.field, node.textContent]))]);
"""
_ANSWER_JS = """
const all = document.querySelectorAll('.msg.assistant');
const m = all[all.length - 1];
return m ? [m.dataset.state, m.querySelector('.content').textContent, m.dataset.lengths || '',
            m.querySelector('.meta').textContent] : null;
"""


@dataclass
class Answer:
    state: str                 # done | stopped | error
    text: str                  # the rendered answer's text
    meta: str                  # the line under it (finish reason, tokens, seconds)
    repaints: list[int]        # its length at each repaint, as the page recorded it
    observed: list[int] = field(default_factory=list)   # its lengths as this test saw them while streaming


class ConsolePage:
    def __init__(self, driver: Any, url: str) -> None:
        self.driver, self.url = driver, url

    def wait(self, condition: Any, timeout: float = WAIT_S, message: str = "") -> Any:
        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(lambda _: condition(), message)

    def open(self) -> None:
        self.driver.get(self.url + "/")

    def by_id(self, element_id: str) -> Any:
        return self.driver.find_element(By.ID, element_id)

    def auth_message(self) -> str:
        banner = self.by_id("auth-banner")
        self.wait(banner.is_displayed, message="no API key message")
        return banner.text

    def polls(self) -> int:
        return int(self.by_id("updated").get_attribute("data-polls") or 0)

    def use_key(self, key: str) -> None:
        self.by_id("api-key").clear()
        self.by_id("api-key").send_keys(key)
        self.by_id("key-save").click()
        self.wait(lambda: self.polls() > 0 and not self.by_id("auth-banner").is_displayed(),
                  message="the key did not let the status through")

    def rows(self) -> dict[str, dict[str, str]]:
        return dict(self.driver.execute_script(_ROWS_JS))

    def stage_rows(self, ids: set[str]) -> dict[str, dict[str, str]]:
        self.wait(lambda: set(self.rows()) == ids, message=f"no rows for {sorted(ids)}")
        return self.rows()

    def live_stage_rows(self, ids: set[str]) -> dict[str, dict[str, str]]:
        """The rows once two more polls have come in and every stage shows a step time."""
        start = self.polls()
        self.wait(lambda: self.polls() >= start + 2 and set(self.rows()) == ids
                  and all(row["step"] != "—" for row in self.rows().values()), message="the table did not update")
        return self.rows()

    def hop_labels(self) -> list[str]:
        return [node.text for node in self.driver.find_elements(By.CSS_SELECTOR, "#chain text.hop-label")]

    def set_sampling(self, **values: float) -> None:
        if not self.by_id("settings").get_attribute("open"):
            self.driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
        for name, value in values.items():
            box = self.by_id(name)
            box.clear()
            box.send_keys(str(value))

    def new_chat(self) -> None:
        self.by_id("new-chat").click()
        self.wait(lambda: not self.driver.find_elements(By.CSS_SELECTOR, ".msg"), message="the chat was not cleared")

    def chat(self, prompt: str, stop_after_text: bool = False) -> Answer:
        """Send `prompt`; watch the answer stream (pressing Stop once text shows, if asked) until it ends."""
        before = len(self.driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        self.by_id("prompt").send_keys(prompt)
        self.by_id("send").click()
        self.wait(lambda: len(self.driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before,
                  message="no answer appeared")
        observed: list[int] = []
        deadline = time.monotonic() + CHAT_DEADLINE_S
        while True:
            state, text, lengths, meta = self.driver.execute_script(_ANSWER_JS)
            observed.append(len(text))
            if state != "streaming":
                return Answer(state, text, meta, [int(n) for n in lengths.split(",") if n], observed)
            if stop_after_text and text:
                self.by_id("stop").click()
                stop_after_text = False
            assert time.monotonic() < deadline, f"the answer was still streaming after {CHAT_DEADLINE_S} s"
            time.sleep(SAMPLE_S)   # how often we look; the page records every repaint itself

    def render_markdown(self, text: str) -> str:
        """What the page's renderer makes of `text`, as HTML (read back from the DOM it built)."""
        return self.driver.execute_script(
            "const box = document.createElement('div'); window.SkippyMarkdown.render(arguments[0], box);"
            "return box.innerHTML;", text)

    def screenshot(self, path: Path) -> None:
        self.driver.save_screenshot(str(path))

    def console_errors(self) -> list[str]:
        """The browser's errors, but for the 401s of the status polls made before the key was given."""
        return [entry["message"] for entry in self.driver.get_log("browser")
                if entry["level"] == "SEVERE" and "status of 401" not in entry["message"]]
