"""Statepoints for agent sandboxes, from a harness.

Daemonless, like Podman: every call runs the ``planarian`` (or ``podman``) command line and reads
its JSON output; there is nothing to start. A sandbox is a Podman container run by the
``planarian`` runtime::

    from planarian import Sandbox

    sb = Sandbox.run("docker.io/library/python:3.12", name="agent")
    sb.exec("pip install -e .")
    sp = sb.snapshot(name="deps", description="dependencies installed")   # returns at once
    sb.exec("rm -rf src")                                                # waits for the snapshot
    ctx = sb.rollback(sp.id, reason="deleted the sources")               # files, memory, database
    conversation.append(ctx.text)                                        # what is now true

Failures raise :class:`PlanarianError` (or a subclass) carrying planarian's one-line message.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__all__ = [
    "Sandbox",
    "Handle",
    "Result",
    "RestoreContext",
    "PlanarianError",
    "UnknownStatepoint",
    "NotRunning",
    "Busy",
    "ForkError",
    "STATUSES",
]

#: What an outcome may say of what followed a statepoint.
STATUSES = ("success", "failure", "abandoned", "info")


class PlanarianError(Exception):
    """A planarian or Podman command failed; ``str(e)`` is its one-line message."""

    def __init__(self, message: str, command: Sequence[str] = (), returncode: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.command = list(command)
        self.returncode = returncode


class UnknownStatepoint(PlanarianError):
    """No committed statepoint has that id or name."""


class NotRunning(PlanarianError):
    """The sandbox is not running (or does not exist)."""


class Busy(PlanarianError):
    """Another statepoint operation holds the sandbox."""


class ForkError(PlanarianError):
    """One fork of a :meth:`Sandbox.fork` call failed (the others are unaffected)."""


def _last_error(argv: Sequence[str], p: "subprocess.CompletedProcess[str]") -> str:
    """The last line a command wrote to stderr, without its ``planarian: `` prefix."""
    lines = [line.strip() for line in p.stderr.splitlines() if line.strip()]
    message = lines[-1] if lines else f"{argv[0]} exited with {p.returncode}"
    for prefix in ("planarian: ", "Error: "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    return message


def _classify(message: str) -> type:
    if "unknown statepoint" in message:
        return UnknownStatepoint
    if "is not running" in message or "no such container" in message:
        return NotRunning
    if "another statepoint operation" in message:
        return Busy
    return PlanarianError


@dataclass
class Result:
    """What a command in the sandbox printed (stdout and stderr, in that order) and its exit code."""

    output: str
    returncode: int

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class RestoreContext:
    """After a rollback or a fork: which statepoint, what was restored and undone, what was tried
    from there before. ``text`` is what a harness appends to the conversation."""

    operation: str
    container: str
    statepoint: Dict[str, Any]
    restored: List[str]
    compensated: List[Dict[str, Any]]
    discarded_statepoints: List[str]
    reason: Optional[str]
    prior_outcomes: List[Dict[str, Any]]
    time: str
    text: str
    container_id: Optional[str] = None
    #: The path taken: ``{"path": "in-place" | "stop-and-restore", "pages-written": ...}`` for a
    #: rollback, ``{"path": "spare"}`` for a fork handed out from a spare (see :meth:`Sandbox.spare`).
    how: Optional[Dict[str, Any]] = None
    #: What the statepoint's remote state does not cover (tools let through unrecorded).
    uncovered: List[str] = field(default_factory=list)
    #: Processes the statepoint does not hold: they ran outside the container's process tree
    #: (an exec's command still running), so the sandbox does not have them now.
    not_held: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, v: Dict[str, Any]) -> "RestoreContext":
        return cls(
            operation=v["operation"],
            container=v["container"],
            statepoint=v["statepoint"],
            restored=v.get("restored", []),
            compensated=v.get("compensated", []),
            discarded_statepoints=v.get("discarded-statepoints", []),
            reason=v.get("reason"),
            prior_outcomes=v.get("prior-outcomes", []),
            time=v.get("time", ""),
            text=v.get("text", ""),
            container_id=v.get("container-id"),
            how=v.get("how"),
            uncovered=v.get("uncovered", []),
            not_held=v.get("not-held", []),
        )


@dataclass
class _Cli:
    """The two command lines the SDK drives."""

    planarian: str = field(default_factory=lambda: os.environ.get("PLANARIAN", "planarian"))
    podman: str = field(default_factory=lambda: os.environ.get("PODMAN", "podman"))

    def run(self, argv: Sequence[str], input: Optional[str] = None, timeout: Optional[float] = None) -> str:
        try:
            p = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as e:
            raise PlanarianError(f"{argv[0]} not found: {e}", argv) from None
        if p.returncode != 0:
            message = _last_error(argv, p)
            raise _classify(message)(message, argv, p.returncode)
        return p.stdout

    def run_status(self, argv: Sequence[str]) -> Tuple[int, str, str]:
        """Runs ``argv``: its exit code, its standard output, and its last line of error (the
        ``planarian: `` prefix dropped), whatever the exit code."""
        try:
            p = subprocess.run(list(argv), capture_output=True, text=True)
        except FileNotFoundError as e:
            return 127, "", f"{argv[0]} not found: {e}"
        return p.returncode, p.stdout, _last_error(argv, p)

    def planarian_json(self, *args: str, input: Optional[str] = None) -> Any:
        return json.loads(self.run([self.planarian, *args], input=input))


class Handle:
    """A statepoint being taken: ``id`` at once, :meth:`result` once it is committed."""

    def __init__(self, sandbox: "Sandbox", statepoint: str):
        self.sandbox = sandbox
        self.id = statepoint

    def result(self) -> Dict[str, Any]:
        """Waits until the snapshot has ended; its manifest, or the error that discarded it."""
        self.sandbox._cli.run([self.sandbox._cli.planarian, "statepoint", "wait", self.sandbox.name, self.id])
        return self.sandbox._cli.planarian_json("statepoint", "show", self.sandbox.name, self.id)

    def __repr__(self) -> str:
        return f"Handle({self.sandbox.name!r}, {self.id!r})"


class Sandbox:
    """A Podman container run by planarian."""

    def __init__(self, name: str, cli: Optional[_Cli] = None):
        self.name = name
        self._cli = cli or _Cli()

    @classmethod
    def run(
        cls,
        image: str,
        name: Optional[str] = None,
        command: Sequence[str] = ("sleep", "infinity"),
        cli: Optional[_Cli] = None,
        **podman_options: Union[str, bool, Sequence[str]],
    ) -> "Sandbox":
        """Starts a sandbox: ``podman --runtime planarian run -d``. Options become flags
        (``network="none"`` → ``--network none``, ``env=["A=1"]`` → ``--env A=1``, ``tty=True`` → ``--tty``)."""
        cli = cli or _Cli()
        argv = [cli.podman, "--runtime", "planarian", "run", "-d"]
        if name:
            argv += ["--name", name]
        argv += _flags(podman_options)
        argv += [image, *command]
        cid = cli.run(argv).strip().splitlines()[-1]
        return cls(name or cid, cli)

    @classmethod
    def attach(cls, name: str, cli: Optional[_Cli] = None) -> "Sandbox":
        """A sandbox that already runs (checked)."""
        sb = cls(name, cli)
        runtime = sb._cli.run([sb._cli.podman, "inspect", "--format", "{{.OCIRuntime}}", name]).strip()
        if runtime != "planarian":
            raise PlanarianError(f"container {name} is not run by planarian (its runtime is {runtime})")
        return sb

    def exec(self, command: str, cwd: Optional[str] = None, timeout: Optional[float] = None) -> Result:
        """Runs ``sh -c command`` in the sandbox (waiting, as every tool call does, for a snapshot
        or rollback in progress). A timeout kills the command."""
        argv = [self._cli.podman, "exec"]
        if cwd:
            argv += ["--workdir", cwd]
        argv += [self.name, "sh", "-c", command]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return Result(out + f"\n[the command did not finish within {timeout} s and was stopped]", 124)
        return Result(p.stdout + p.stderr, p.returncode)

    def snapshot(self, name: Optional[str] = None, description: Optional[str] = None, state: Optional[Dict[str, Any]] = None, wait: bool = False) -> Handle:
        """A statepoint, taken in the background: returns at once with its id (the next
        :meth:`exec` waits for it); ``wait=True`` returns once it is committed."""
        argv = [self._cli.planarian, "snapshot", self.name, "--async"]
        if name:
            argv += ["--name", name]
        if description:
            argv += ["--description", description]
        if state is not None:
            argv += ["--state", "-"]
        sp = self._cli.run(argv, input=json.dumps(state) if state is not None else None).strip()
        h = Handle(self, sp)
        if wait:
            h.result()
        return h

    def rollback(self, statepoint: str, reason: Optional[str] = None) -> RestoreContext:
        """Returns the sandbox (files, processes, memory, remote state) to ``statepoint``."""
        args = ["rollback", self.name, statepoint, "--by", "harness", "--json"]
        if reason:
            args += ["--reason", reason]
        return RestoreContext.from_json(self._cli.planarian_json(*args))

    def fork(self, statepoint: str, count: Optional[int] = None, names: Optional[Sequence[str]] = None) -> List[Union["Sandbox", ForkError]]:
        """``count`` new sandboxes from one statepoint (one per name when names are given, else
        one); one result per fork: the sandbox (with its ``context``), or the :class:`ForkError`
        that says why that one failed. Without names, each fork takes a spare of the statepoint
        under the spare's own name (a thaw: see :meth:`spare`), or is made as
        ``NAME-fork-SP-K``; its name is the sandbox's."""
        if count is None:
            count = len(names) if names else 1
        wanted: List[Optional[str]] = list(names) if names else [None] * count
        if len(wanted) != count:
            raise ValueError("give one name per fork")
        # One call: the forks are made side by side, what they share done once.
        argv = [self._cli.planarian, "fork", self.name, statepoint, "--count", str(count), "--by", "harness", "--json"]
        for n in wanted:
            if n:
                argv += ["--name", n]
        code, stdout, message = self._cli.run_status(argv)
        try:
            answers = json.loads(stdout) if stdout.strip() else None
        except ValueError:
            answers = None
        if not isinstance(answers, list) or len(answers) != count:
            # Refused as a whole (no such statepoint, a name taken): nothing was made.
            return [ForkError(message, argv, code) for _ in wanted]
        out: List[Union[Sandbox, ForkError]] = []
        for v in answers:
            if "error" in v:
                out.append(ForkError(v["error"], argv, code))
                continue
            ctx = RestoreContext.from_json(v)
            sb = Sandbox(v["container"], self._cli)
            sb.context = ctx  # type: ignore[attr-defined]
            out.append(sb)
        return out

    def fork_async(self, statepoint: str, count: Optional[int] = None, names: Optional[Sequence[str]] = None) -> "Future[List[Union[Sandbox, ForkError]]]":
        """:meth:`fork`, in the background: returns a future at once, so that the forks are made
        while the harness does something else (asks the model for the commands to try in them)."""
        ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"planarian-fork-{self.name}")
        try:
            return ex.submit(self.fork, statepoint, count, names)
        finally:
            ex.shutdown(wait=False)

    def spare(self, statepoint: str, count: int = 1) -> List[str]:
        """Keeps ``count`` forks of ``statepoint`` ready, restored and frozen (``0`` removes them):
        a later :meth:`fork` of it takes one, which costs a thaw (and a rename, when named) instead
        of a restore. Returns the spares' names."""
        out = self._cli.run([self._cli.planarian, "spare", self.name, statepoint, "--count", str(int(count))])
        return [line.split(" ", 1)[0] for line in out.splitlines() if line.strip()]

    def spare_async(self, statepoint: str, count: int = 1) -> "Future[List[str]]":
        """:meth:`spare`, in the background (while the model is asked what to try next)."""
        ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"planarian-spare-{self.name}")
        try:
            return ex.submit(self.spare, statepoint, count)
        finally:
            ex.shutdown(wait=False)

    def ledger(self, text: bool = False, max_chars: Optional[int] = None) -> Union[str, Dict[str, Any]]:
        """The statepoints as a tree: JSON, or the text a model reads."""
        args = ["ledger", self.name]
        if max_chars:
            args += ["--max-chars", str(max_chars)]
        if text:
            return self._cli.run([self._cli.planarian, *args])
        return self._cli.planarian_json(*args, "--json")

    def append_outcome(self, statepoint: str, text: str, status: str, reward: Optional[float] = None, by: str = "harness") -> None:
        """Records what happened after ``statepoint`` (the captured state never changes)."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        argv = [self._cli.planarian, "statepoint", "set", self.name, statepoint, "--outcome", text, "--status", status, "--by", by]
        if reward is not None:
            argv += ["--reward", repr(float(reward))]
        self._cli.run(argv)

    def statepoints(self) -> List[Dict[str, Any]]:
        """The committed statepoints' manifests, oldest first."""
        return self._cli.planarian_json("statepoint", "list", self.name, "--json")

    def remove(self, *statepoints: str) -> None:
        """Removes statepoints (all are checked first: a bad one removes nothing)."""
        self._cli.run([self._cli.planarian, "statepoint", "rm", self.name, *statepoints])

    def rm(self) -> None:
        """Removes the sandbox (and its statepoints' files)."""
        self._cli.run([self._cli.podman, "rm", "-f", "-t", "0", self.name])

    def __repr__(self) -> str:
        return f"Sandbox({self.name!r})"


def _flags(options: Dict[str, Union[str, bool, Sequence[str]]]) -> List[str]:
    out: List[str] = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, (list, tuple)):
            for x in v:
                out += [flag, str(x)]
        else:
            out += [flag, str(v)]
    return out
