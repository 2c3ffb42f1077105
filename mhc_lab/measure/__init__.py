"""Measuring: the timer and the device choice (timing.py), recorded results in mhc_lab/recorded and what each
holds (recordings.py, schemas.py), the bytes each design moves (bytes_model.py), the profiler's counts
(profiling.py), the roofline (roofline.py), and ranks trained data-parallel with what each device holds
(distributed.py).

    from mhc_lab.measure import time_fn, time_interleaved, save_recording, load_recording, recorded_or_none, recording_label
"""

from mhc_lab.measure.recordings import (
    RECORDED_DIR,
    bench_command,
    load_recording,
    recorded_or_none,
    recorded_section,
    recording_label,
    save_recording,
    save_sections,
)
from mhc_lab.measure.timing import (
    environment_tags,
    gigabytes_per_second,
    keep_freed_memory,
    last_level_cache_bytes,
    resolve_device,
    synchronize,
    time_fn,
    time_interleaved,
)

__all__ = [
    "RECORDED_DIR",
    "bench_command",
    "environment_tags",
    "gigabytes_per_second",
    "keep_freed_memory",
    "last_level_cache_bytes",
    "load_recording",
    "recorded_or_none",
    "recorded_section",
    "recording_label",
    "resolve_device",
    "save_recording",
    "save_sections",
    "synchronize",
    "time_fn",
    "time_interleaved",
]
