"""PNG drawing in worker processes: vl-convert draws one figure at a time per process, so the
report keeps ``n`` workers (``compatlas.report.png.main``) busy while it builds the pages.

Plain subprocesses rather than multiprocessing: a spawned multiprocessing worker re-imports the
caller's main script (a Snakemake script has no ``__main__`` guard), and a forked one would
inherit DuckDB's threads. Each job is one line on a worker's stdin, ``path<TAB>spec``; the
worker answers ``ok`` or ``error: ...`` on stdout. A worker runs this file by its path, not as
``compatlas.report.png``: importing the package (altair, DuckDB, scipy) would cost each worker
1.2 s of CPU, beside the pages' on a 2-core machine, for a drawing that needs only vl-convert.
Only the standard library is imported at this module's top for that reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class PngPool:
    def __init__(self, n: int):
        run = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
        self.procs = [subprocess.Popen([sys.executable, "-c", run, __file__], stdin=subprocess.PIPE,
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


def render_png(spec: str, path: Path) -> Path:
    """Draw a spec to a PNG (in a worker process: vl-convert draws one figure at a time per process)."""
    import vl_convert as vlc

    from compatlas.storage import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_bytes(vlc.vegalite_to_png(spec, scale=1))
    return path


def main() -> None:
    for line in sys.stdin:
        path, spec = line.rstrip("\n").split("\t", 1)
        try:
            render_png(spec, Path(path))
            print("ok", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the report
            print(f"error: {path}: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
