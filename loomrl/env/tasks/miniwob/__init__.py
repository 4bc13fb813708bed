"""MiniWoB++ as an outside benchmark: the `miniwob` package's own task pages served in process (site.py) and played
through loomrl's browser pool as `env.name=miniwob` (environment.py), never through the package's Selenium driver."""
