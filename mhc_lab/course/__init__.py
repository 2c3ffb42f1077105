"""What the labs use: each lab's set-up, checks and hints, exercises, probes, widgets, data, training loops and
the helpers that show measured and recorded figures."""
