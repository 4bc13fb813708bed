"""The `env:` section: the environment, its tasks and its sandboxes (loomrl/env/; docs/environments.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from loomrl.config.base import Section


class BrowserConfig(Section):
    """env.browser: the pool of headless Chromium tabs web environments lease (loomrl/env/browser/pool.py; docs/web.md):
    `browsers` processes with `tabs_per_browser` isolated contexts each, pre-warmed, health-checked, reset between
    episodes."""

    browsers: int = Field(1, gt=0)
    """Chromium processes (each runs in bubblewrap with no network; a crash loses only its own tabs)"""
    tabs_per_browser: int = Field(0, ge=0)
    """contexts (tabs) per browser; 0 = enough for the rollout concurrency plus spares, spread over the browsers"""
    prewarm: int | None = Field(None, ge=0)
    """tabs made before the first episode; default: all of them"""
    executable: str = "/usr/lib/chromium/chromium"
    """the Chromium binary (Debian's: `apt-get install -y chromium`); Playwright's own browser download is not used"""
    action_timeout_s: float = Field(10.0, gt=0.0)
    """one browser action (a click, typing, a navigation and its page load) runs at most this; past it the page is
    taken to be hung: the episode ends `env_error` and the tab is replaced"""
    site_timeout_s: float = Field(30.0, gt=0.0)
    """one request to the episode's site is answered within this, else the page gets a 502 and the episode ends
    `env_error`"""
    launch_timeout_s: float = Field(30.0, gt=0.0)
    """starting one Chromium process"""
    context_timeout_s: float = Field(10.0, gt=0.0)
    """making one tab (a browser context and its page; a browser makes 4 at a time)"""
    health_timeout_s: float = Field(5.0, gt=0.0)
    """a tab's health check (a trivial script) when it is made and before it is handed out; raise it on a machine
    so busy that the check times out (the pool gives up after max_failures in a row)"""
    max_failures: int = Field(3, gt=0)
    """failed tab creations or health checks in a row after which the pool gives up and the run stops with the cause"""


class EnvConfig(Section):
    name: str = "calculator"
    """The environment (loomrl/env/api.py, docs/environments.md): a built-in one (calculator, codefix, gym, chat), an
    installed plugin (a `loomrl.envs` entry point), package.module:Factory, or verifiers:<environment id>"""
    args: dict[str, Any] = Field(default_factory=dict)
    """the environment's own settings, validated by its own model at load (calculator: few_shot, crash_rate, ...; gym:
    few_shot); a wrong field stops with one line naming env.args.<field>"""
    families: list[str] | None = None
    """task families: calculator (default add, sub, mul), codefix bug families, or gym games (FrozenLake, Taxi,
    CliffWalking, Blackjack); None = the environment's default (codefix, gym: all)"""
    n_train: int = Field(2000, gt=0)
    """training tasks made (generated families) or taken (fixed corpora, datasets)"""
    n_heldout: int = Field(200, gt=0)
    """per held-out split"""
    heldout_template_share: float = Field(0.25, ge=0.0, lt=1.0)
    """generated families (calculator): this share of each family's templates is held out, and evaluated as a split of
    its own (heldout_templates) beside new numbers on the training templates (heldout)"""
    seed: int = 1234
    """seeds the task draws and splits (independent of the run's seed, so runs with different seeds see the same tasks)
    """
    sandbox: Literal["auto", "bwrap", "process", "docker"] = "auto"
    """the sandbox backend for environments that run code: auto picks bwrap where it works, else process (which isolates
    nothing and says so); docker needs a Docker engine"""
    sandbox_limits: dict[str, int] = Field(default_factory=dict)
    """rlimits and quotas of each sandbox (bwrap: cpu_s, address_space_mb, nproc, file_size_mb, disk_mb, tmp_mb; docker:
    memory_mb, nproc, cpus, disk_mb, tmp_mb); unset keys keep the backend's defaults"""
    pool_size: int = Field(0, ge=0)
    """sandboxes in the env pool; 0 = sized from the rollout concurrency"""
    prewarm: int | None = Field(None, ge=0)
    """created before the first rollout; default: the whole pool"""
    sandbox_max_failures: int = Field(5, gt=0)
    """failed sandbox creations or health checks in a row after which the pool gives up and the run stops with the
    sandbox's own error (a backend that cannot work here must not hang the run)"""
    tool_timeout_s: float = Field(5.0, gt=0.0)
    """a tool call (calculator) or command (codefix) runs at most this"""
    browser: BrowserConfig = Field(default_factory=BrowserConfig)
    """the browser pool, for web environments (env.name=web)"""
