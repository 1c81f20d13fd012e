"""Commands built on the parts: `looprl rollout` and `debug workflow` (collect.py),
`looprl serve` (serve.py), `looprl doctor` (doctor.py), `looprl debug consistency`
(consistency.py). They import diagnostics; nothing below imports them."""
