"""`looprl view`: a local web page over a run directory (config, metrics, trajectories).

`run_reader.py` reads the files, `app.py` serves them as JSON with the page in
`static/` (plain HTML, JS and SVG: no build step, nothing fetched from elsewhere).
"""
