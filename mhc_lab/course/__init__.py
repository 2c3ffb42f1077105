"""Course tools: checks, hints, measuring, recorded results, widgets, data, training, notebook build, CLI."""
