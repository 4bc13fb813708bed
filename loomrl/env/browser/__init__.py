"""The browser pool and what web environments share: headless Chromium (Debian's, driven by Playwright) in
isolated contexts, pages reduced to text with element ids, actions on them, and the in-process sites they reach."""
