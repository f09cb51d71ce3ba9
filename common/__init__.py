"""What every plane shares: the typed config (`config`), a run's output directory (`run_dir`), how stale a
group may be (`staleness`), the metrics every actor exports (`metrics`), credential redaction (`redaction`) and
the atomic write (`atomic_write`); and, as subpackages, the two shared planes, the trajectory stream
(`stream/`) and weight sync (`weights/`), and the process plumbing every actor uses (`processes/`). Nothing
here imports the planes that use it (tests/test_layers.py).
"""
