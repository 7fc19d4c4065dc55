"""PNG drawing in worker processes: vl-convert draws one figure at a time per process, so the
report keeps ``n`` workers (``compatlas.report.png.main``) busy while it builds the pages.

Plain subprocesses rather than multiprocessing: a spawned multiprocessing worker re-imports the
caller's main script (a Snakemake script has no ``__main__`` guard), and a forked one would
inherit DuckDB's threads. Each job is one line on a worker's stdin, ``path<TAB>spec``; the
worker answers ``ok`` or ``error: ...`` on stdout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class PngPool:
    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "from compatlas.report.png import main; main()"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, encoding="utf-8") for _ in range(n)]
        self.sent = [0] * n
        self.paths: list[Path] = []

    def submit(self, spec: str, path: Path) -> None:
        i = min(range(len(self.procs)), key=lambda k: self.sent[k])  # round robin
        stdin = self.procs[i].stdin
        assert stdin is not None  # every worker is opened with stdin=PIPE
        stdin.write(f"{path}\t{spec}\n")
        stdin.flush()
        self.sent[i] += 1
        self.paths.append(path)

    def wait(self) -> None:
        """Close the workers' input and collect every answer; raise on the first failed drawing."""
        errors = []
        for p in self.procs:
            out, _ = p.communicate()
            errors += [line for line in out.splitlines() if line.startswith("error")]
            if p.returncode:
                errors.append(f"error: PNG worker exited with {p.returncode}")
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    from compatlas.report.page import render_png

    for line in sys.stdin:
        path, spec = line.rstrip("\n").split("\t", 1)
        try:
            render_png(spec, Path(path))
            print("ok", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the report
            print(f"error: {path}: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
