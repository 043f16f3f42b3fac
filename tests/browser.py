"""A real headless browser for the status page tests: Debian's `chromium` loads a URL, lets the
page's own script run (virtual time), and gives back the DOM as rendered, or a screenshot.
`Dom` parses that DOM (the standard library's HTML parser) into elements a test can look up.

Where chromium is missing the tests skip, except under CI (or NEURONODE_REQUIRE_NETNS=1, which
CI sets), where they fail: `.ci/run` installs it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from netns import required

# No network but the page's own origin: no sync, updates, QUIC probes or first-run fetches.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--mute-audio")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = "no `chromium` on PATH (Debian: apt-get install chromium)"
        if required():
            pytest.fail(f"browser required under CI but {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def browse(url: str, profile: Path, *, screenshot: Path | None = None, budget_ms: int = 3000,
           window: str = "1280,1000", timeout_s: float = 90) -> str:
    """Load `url`, run its scripts for `budget_ms` of virtual time; the DOM then (or, with
    `screenshot`, write the page as PNG there and return "")."""
    cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
           f"--window-size={window}"]
    cmd += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=timeout_s, check=False)
    assert out.returncode == 0, f"chromium exited {out.returncode}:\n{out.stderr[-3000:]}"
    if screenshot is not None:
        assert screenshot.exists() and screenshot.stat().st_size > 0, out.stderr[-3000:]
    return out.stdout


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> list[Element]:
        out = [self]
        for child in self.children:
            if isinstance(child, Element):
                out += child.iter()
        return out

    def find_all(self, tag: str | None = None, *, cls: str | None = None, **attrs: str) -> list[Element]:
        return [e for e in self.iter()
                if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
                and all(e.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def by_id(self, element_id: str) -> Element:
        found = self.find_all(id=element_id)
        assert len(found) == 1, f"{len(found)} elements with id {element_id!r}"
        return found[0]


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Dom(HTMLParser):
    """The element tree of a page as the browser serialized it (text with entities decoded)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)
