"""`loomrl view`: the dashboard and trajectory viewer of run folders (app.py serves it; static/ is the page)."""
