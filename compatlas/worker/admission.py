"""Who the job server serves, and what a request must hold (``compatlas.worker``'s docstring):
a process of this user that descends from the run's Snakemake (the socket's peer credentials,
where the system gives them) with the run's secret, in a request of the shape ``hand_off`` sends.
Anything else is refused in one line of the server's log (``say``), and the server goes on: a
request whose JSON was a list had killed it (``'list' object has no attribute 'get'``)."""

from __future__ import annotations

import hmac
import socket
import struct
import sys
from pathlib import Path
from typing import Any

MAX_REQUEST = 1 << 22  # bytes of a request's JSON (argv, cwd, environment, sys.path): far above any job's


class BadRequest(ValueError):
    """A request the server does not serve; the message is its line in the server's log."""


# What a request holds, each field's type: anything else is refused before it is used
FIELDS: dict[str, type] = {"argv": list, "cwd": str, "env": dict, "path": list, "network": bool, "secret": str}
_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _json_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def check_request(request: Any, secret: str) -> dict[str, Any]:
    """``request`` (a request's parsed JSON) if it is one of this run's, of the shape ``hand_off``
    sends; else BadRequest saying what is wrong, in one line."""
    if not isinstance(request, dict):
        raise BadRequest(f"the request is {_json_name(request)}, not an object")
    if set(request) != set(FIELDS):
        raise BadRequest(f"the request's fields are {sorted(request)[:10]}, not {sorted(FIELDS)}")
    for name, kind in FIELDS.items():
        if not isinstance(request[name], kind):
            raise BadRequest(f"the request's {name} is {_json_name(request[name])}, not {_JSON_NAMES[kind]}")
    if not hmac.compare_digest(request["secret"].encode(), secret.encode()) or not secret:
        raise BadRequest("the request does not carry this run's secret")
    argv, env, path = request["argv"], request["env"], request["path"]
    if not argv or not all(isinstance(a, str) for a in [*argv, *path]):
        raise BadRequest("the request's argv and path must be lists of strings, argv not empty")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("the request's env must map strings to strings")
    return request


def descends_from(pid: int, ancestor: int) -> bool | None:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (the chain of parents in
    /proc); None where /proc cannot tell (not Linux)."""
    for _ in range(1024):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return None if not Path("/proc/self/stat").exists() else False
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: its parent
    return False


def peer(conn: socket.socket) -> tuple[int, int] | None:
    """The connecting process's pid and uid, where the system tells (SO_PEERCRED: Linux)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def say(line: str) -> None:
    """One line of the server's log (its stderr), whatever a client put in it."""
    line = " ".join(line.split())
    print(line if len(line) <= 400 else line[:400] + " ...", file=sys.stderr, flush=True)
