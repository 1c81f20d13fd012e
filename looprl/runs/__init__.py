"""Runs: the run directory a training run writes, and the files in it.

- paths.py: `RunPaths`, the run directory's layout (every file and folder a run writes,
  named in one place), and `frame_file`, an episode's GIF in frames/.
- atomic.py: `atomic_write` / `atomic_write_text` (a hidden temporary file beside the
  target, optionally fsynced, then `os.replace`), `fsync_file`, `fsync_dir`: how every
  run file that a reader may see half-written is written.
- checkpoint.py: recover checkpoints under checkpoints/ (written atomically, verified
  by checksums, refused with reasons).
- metrics.py: `Metrics`, metrics.jsonl, the progress bar, reward.png, and the records
  sent to the experiment trackers.
- trajectories.py: the trajectory files, trajectories/step_NNNNNN.parquet (what each
  step trained on), written by `TrajectoryWriter`, read by `looprl show` and the viewer.
- best.py: `BestPolicy`, the policy at the best held-out evaluation, kept in best/.
- stopping.py: how a training run stops (a signal, within about a step's time; a
  workflow that fails too often), with what it trained saved first.

Nothing is imported here: `looprl show` and the viewer read runs without torch.
"""
