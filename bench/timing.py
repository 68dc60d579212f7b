"""Interleaved timing of the kernel benchmarks (``vtoken bench repack``, ``scores``,
``fused-scores``): medians of repetitions taken in turn, on the CPU or on CUDA, where each
function is also timed on the device alone (its launch hidden behind a spin of the stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LAUNCH_COVER_CYCLES = 2_000_000  # about 1 ms of spinning at an H200's 1.98 GHz: longer
# than the host needs to launch any function timed here (0.1 ms measured for the repack)


def rounded_ms(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def device_only_times(times: dict[str, float], names: tuple[str, ...]) -> dict[str, float | None]:
    """``NAME_device`` of ``measure_interleaved`` for each name; ``None`` where it was not
    measured (CPU) or the launch was not hidden (the figure would include host time)."""
    return {
        name: times[f"{name}_device"] if times.get(f"{name}_launch_hidden") == 1.0 else None
        for name in names
    }


def measure_interleaved(
    functions: dict[str, Callable[[], object]],
    device: torch.device,
    reps: int,
    cold: bool,
    prime: tuple[str, ...] = (),
    budget_ms: float = 5_000.0,
    device_only: tuple[str, ...] = (),
) -> dict[str, float]:
    """Median milliseconds of each function (and ``NAME_min``: the fastest sample),
    repetitions interleaved (A B C A B C ...).

    Every timed call gets the same preparation: ``cold`` writes a buffer of 3x the last-level
    cache (96 MiB; GPU: 256 MiB) first, so no function starts with its data cached; warm runs
    the function once, untimed, right before. Functions named in ``prime`` run once before
    all (first-call costs); one whose samples pass ``budget_ms`` stops after three samples.
    On a noisy machine the interleaving exposes all functions to the same load, so ratios of
    medians are meaningful where single runs are not.

    CUDA events around a call also time the host's work to launch it (the GPU idles while
    Python prepares the kernel). Functions named in ``device_only`` are timed a second way
    as well, ``NAME_device``: the stream first spins (``LAUNCH_COVER_CYCLES``), so the call
    is queued before the start event fires and the events see the device's work alone, as
    on the engine's side stream, where the host launches while the GPU computes.
    ``NAME_launch_hidden`` is 1.0 when every such sample was queued before the spin ended
    (0.0: the call made the host wait, and ``NAME_device`` includes host time);
    ``NAME_launch``: the host's time to issue the call then (the launch cost alone: what
    the host spends per call whatever the device does).
    """
    import statistics

    import torch

    flush = None
    if cold:
        flush_bytes = (256 if device.type == "cuda" else 96) * 1024 * 1024
        flush = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device)
    times: dict[str, list[float]] = {name: [] for name in functions}
    on_gpu = device.type == "cuda"
    timed_on_device = [name for name in device_only if on_gpu and name in functions]
    for name in timed_on_device:
        times[f"{name}_device"] = []
        times[f"{name}_launch"] = []
    hidden = dict.fromkeys(timed_on_device, True)
    for name in prime:
        functions[name]()  # first-call costs (library build, page faults) stay out
    for rep in range(reps):
        for name, function in functions.items():
            if len(times[name]) >= 3 and sum(times[name]) > budget_ms:
                continue  # a slow baseline: three interleaved samples are enough
            if flush is not None:
                flush.fill_(float(rep))
            else:
                function()
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                function()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
                if name in hidden:
                    if flush is not None:
                        flush.fill_(float(rep))
                    torch.cuda.synchronize()
                    torch.cuda._sleep(LAUNCH_COVER_CYCLES)
                    start.record()
                    issued = time.perf_counter()
                    function()
                    times[f"{name}_launch"].append((time.perf_counter() - issued) * 1e3)
                    end.record()
                    hidden[name] = hidden[name] and not start.query()  # still spinning
                    end.synchronize()
                    times[f"{name}_device"].append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                function()
                times[name].append((time.perf_counter() - begin) * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    minima = {f"{name}_min": min(values) for name, values in times.items()}
    launch = {f"{name}_launch_hidden": float(value) for name, value in hidden.items()}
    return medians | minima | launch
