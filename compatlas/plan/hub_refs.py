"""What the hub publishes for a repository (its branches and tags), asked once per repository
when a config is validated, so that a misspelt repository or a checkpoint it never published
fails before any job, in one line naming the key, and not inside an extract job minutes later.

Offline (``HF_HUB_OFFLINE=1``) or with the hub out of reach, nothing is checked and validation
says so: the jobs will find out. No torch here (validation runs in the Snakemake process).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compatlas.plan.checkpoints import hub_series

# the branch names of the families that publish training checkpoints (Pythia: step1000,
# stanford-crfm: checkpoint-100)
STEP_BRANCH = re.compile(r"(?:step|checkpoint-)(\d+)")
COMMIT = re.compile(r"[0-9a-f]{7,40}")


class HubCheckError(ValueError):
    """A hub source that names what the hub does not have: ``key`` is where in the model's entry
    (``source.name``, ``checkpoints.1.value``...), the message says what (the plan adds the model)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class HubRefs:
    """A repository's branches and tags, as ``/api/models/<repo>/refs`` lists them."""

    repo: str
    branches: tuple[str, ...]
    tags: tuple[str, ...]

    def has(self, revision: str) -> bool:
        """A branch or tag of the repository; a commit hash is taken on trust (refs do not list them)."""
        return revision in self.branches or revision in self.tags or bool(COMMIT.fullmatch(revision))

    def steps(self) -> dict[int, str]:
        """Training step -> branch, for the branches named after a step."""
        return {int(m[1]): b for b in self.branches if (m := STEP_BRANCH.fullmatch(b))}


def fetch_refs(repo: str, timeout: float | None = None) -> HubRefs | str:
    """The repository's refs, or why they could not be asked for (offline, no answer). A
    repository the hub does not have raises ``HubCheckError``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    url = f"{constants.ENDPOINT}/api/models/{repo}/refs"
    try:
        response = get_session().get(url, headers=build_hf_headers(), timeout=timeout or constants.HF_HUB_ETAG_TIMEOUT)
        hf_raise_for_status(response)
        data = response.json()
    except GatedRepoError:
        return "the repository is gated (log in with `hf auth login` to check it)"
    except RepositoryNotFoundError as e:
        raise HubCheckError("source.name", f"{repo} is not a repository on the hub at {constants.ENDPOINT} "
                            "(misspelt? a private or gated one needs `hf auth login`)") from e
    except Exception as e:  # noqa: BLE001 - the hub is down or out of reach: the jobs will say so, with retries
        text = str(e).strip().splitlines()
        return f"the hub at {constants.ENDPOINT} did not answer ({type(e).__name__}: {text[0] if text else ''})"
    return HubRefs(repo, tuple(b["name"] for b in data.get("branches", [])),
                   tuple(t["name"] for t in data.get("tags", [])))


def _nearest(steps: Sequence[int], step: int) -> list[int]:
    return sorted(sorted(steps, key=lambda s: (abs(s - step), s))[:2])


def check_checkpoints(src: Mapping[str, Any], checkpoints: Sequence[Mapping[str, Any]], refs: HubRefs) -> None:
    """Every revision the source and its checkpoints ask for is published; raises
    ``HubCheckError`` naming the first that is not (its key ``checkpoints.<i>.<key>``) with the
    nearest published steps."""
    name = src["name"]
    if src.get("revision") and not refs.has(src["revision"]):
        raise HubCheckError("source.revision", f"{name} has no revision {src['revision']!r} (branches: "
                            f"{', '.join(refs.branches[:8])}{' ...' if len(refs.branches) > 8 else ''})")
    steps = refs.steps()
    series = hub_series(name)
    for i, c in enumerate(checkpoints):
        if "revision" in c:
            if not refs.has(c["revision"]):
                m = STEP_BRANCH.fullmatch(c["revision"])
                near = f" (nearest published steps: {_nearest(list(steps), int(m[1]))})" if m and steps else ""
                raise HubCheckError(f"checkpoints.{i}.revision", f"{name} has no revision {c['revision']!r}{near}")
            continue
        key = "value" if "value" in c else "index"
        step = c.get("value")
        if step is None and series is not None and -len(series[0]) <= c["index"] < len(series[0]):
            step = series[0][c["index"]]
        if step is not None and step not in steps:
            near = f"nearest published: {_nearest(list(steps), step)}" if steps else "it publishes no step branches"
            raise HubCheckError(f"checkpoints.{i}.{key}", f"{name} does not publish step {step} on the hub ({near})")
