"""Run several ``mergekit-yaml`` merges in one Python process (the language experiment's mergekit step).

``python -m mergeqp.experiments.mergekit_driver RESULT SPEC OUT [SPEC OUT ...] -- [mergekit-yaml options]``
calls mergekit's own ``mergekit-yaml`` command (``mergekit.scripts.run_yaml.main``, the function
behind the console script) once per ``SPEC OUT`` pair with the given options, exactly as separate
``mergekit-yaml SPEC OUT OPTIONS`` commands would (each call seeds its own random state from
``--random-seed``), but pays for importing torch, transformers and mergekit (~9 s) once. For each
merge it writes to the JSON file ``RESULT`` its wall time, CPU time and peak resident memory (Linux:
the process's high-water mark, reset before each merge through ``/proc/self/clear_refs``; where that
is not possible, the process's peak so far, which the record says). Stops at the first failing merge
(exit code 1, the error in ``RESULT``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _reset_peak() -> bool:
    """Reset this process's resident high-water mark (``VmHWM``); ``False`` where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_mb() -> float | None:
    """This process's resident high-water mark in MiB (``None`` where ``/proc`` has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


def run(result: Path, pairs: list[tuple[str, str]], options: list[str]) -> int:
    from mergekit.scripts.run_yaml import main as mergekit_yaml  # mergekit-yaml's own entry point

    records: list[dict[str, Any]] = []

    def dump(error: str | None = None) -> None:
        result.write_text(json.dumps({"merges": records, "error": error}))

    for spec, out in pairs:
        reset = _reset_peak()
        t, cpu = time.perf_counter(), time.process_time()
        try:
            mergekit_yaml.main(args=[spec, out, *options], standalone_mode=False)
        except BaseException:  # noqa: BLE001 - mergekit's error goes back to the experiment, named
            dump(f"{spec}: {traceback.format_exc()[-2000:]}")
            return 1
        records.append({"spec": spec, "out": out, "seconds": time.perf_counter() - t,
                        "cpu_seconds": time.process_time() - cpu, "peak_rss_mb": _peak_mb(),
                        "peak_is_per_merge": reset})
        dump()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options: list[str] = []
    if "--" in args:
        i = args.index("--")
        args, options = args[:i], args[i + 1:]
    if len(args) < 3 or len(args) % 2 != 1:
        print("usage: python -m mergeqp.experiments.mergekit_driver RESULT SPEC OUT [SPEC OUT ...] -- [options]",
              file=sys.stderr)
        return 2
    result, rest = Path(args[0]), args[1:]
    return run(result, list(zip(rest[::2], rest[1::2])), options)


if __name__ == "__main__":
    sys.exit(main())
