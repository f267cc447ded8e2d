"""mini-swe-agent on a Planarian sandbox, with statepoints the model can use.

Selected through mini-swe-agent's own setting, with no change to mini-swe-agent::

    environment:
      environment_class: planarian.contrib.minisweagent.PlanarianEnvironment
      image: docker.io/library/python:3.12
      cwd: /work

The sandbox runs under ``podman --runtime planarian``; commands run as in mini-swe-agent's Docker
environment (``podman exec … bash -lc``). After every command a statepoint is taken in the
background (the next command waits for it). The model uses statepoints through an in-band
command channel, the way mini-swe-agent itself ends a task with a first output line: a command
whose first word is ``planarian-statepoint`` is answered by the environment, never run in the
sandbox::

    planarian-statepoint ledger                       the statepoints as a tree, with outcomes
    planarian-statepoint save NAME [DESCRIPTION]      a named statepoint
    planarian-statepoint note SP STATUS TEXT          what happened after SP (success|failure|…)
    planarian-statepoint rollback SP REASON           back to SP: files, processes, memory

Its answer (the ledger, or the restore context after a rollback) is the command's output, so it
reaches the model's conversation through the unmodified agent loop.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import uuid
from typing import Any, Dict, List, Optional

from pydantic import BaseModel

from planarian import Handle, PlanarianError, Sandbox, _Cli

CHANNEL = "planarian-statepoint"

HELP = f"""{CHANNEL} commands (answered by the environment, not run in the sandbox):
  {CHANNEL} ledger                       the statepoints as a tree, with what was tried after each
  {CHANNEL} save NAME [DESCRIPTION]      save a named statepoint now
  {CHANNEL} note SP STATUS TEXT          record what happened after SP (success, failure, abandoned, info)
  {CHANNEL} rollback SP REASON           return files, processes and memory to SP
A statepoint is taken after every command; the ledger lists them."""


class PlanarianEnvironmentConfig(BaseModel):
    image: str
    cwd: str = "/"
    """Working directory in which to execute commands."""
    env: Dict[str, str] = {}
    forward_env: List[str] = []
    timeout: int = 30
    """Timeout for executing commands in the container."""
    executable: str = os.getenv("MSWEA_DOCKER_EXECUTABLE", "podman")
    run_args: List[str] = []
    """More arguments for ``podman run`` (e.g. ["--network", "none"])."""
    container_timeout: str = "2h"
    interpreter: List[str] = ["bash", "-lc"]
    snapshot_after_each_command: bool = True
    ledger_max_chars: int = 4000


class PlanarianEnvironment:
    def __init__(self, *, config_class: type = PlanarianEnvironmentConfig, logger: Optional[logging.Logger] = None, **kwargs: Any):
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.cli = _Cli(podman=self.config.executable)
        name = f"minisweagent-{uuid.uuid4().hex[:8]}"
        self.sandbox = Sandbox.run(
            self.config.image,
            name=name,
            command=("sleep", self.config.container_timeout),
            cli=self.cli,
            workdir=self.config.cwd,
            **_run_args(self.config.run_args),
        )
        self.container_id = name
        self.statepoints: List[str] = []
        self._pending: Optional[Handle] = None

    def get_template_vars(self, **kwargs: Any) -> Dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), {"planarian_help": HELP}, kwargs)

    def serialize(self) -> Dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "statepoints": list(self.statepoints),
            }
        }

    def execute(self, action: Dict[str, Any], cwd: str = "", *, timeout: Optional[int] = None) -> Dict[str, Any]:
        command = action.get("command", "")
        words = command.strip().split(None, 1)
        if words and words[0] == CHANNEL:
            return self._statepoint(words[1] if len(words) > 1 else "")
        cwd = cwd or self.config.cwd
        cmd = [self.config.executable, "exec", "-w", cwd]
        for key in self.config.forward_env:
            if (value := os.getenv(key)) is not None:
                cmd.extend(["-e", f"{key}={value}"])
        for key, value in self.config.env.items():
            cmd.extend(["-e", f"{key}={value}"])
        cmd.extend([self.container_id, *self.config.interpreter, command])
        try:
            result = subprocess.run(
                cmd, text=True, timeout=timeout or self.config.timeout, encoding="utf-8", errors="replace",
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            output = {"output": result.stdout, "returncode": result.returncode, "exception_info": ""}
        except Exception as e:  # as mini-swe-agent's own environments report it
            raw = getattr(e, "output", None)
            raw = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else (raw or "")
            output = {"output": raw, "returncode": -1, "exception_info": f"An error occurred while executing the command: {e}",
                      "extra": {"exception_type": type(e).__name__, "exception": str(e)}}
        if self.config.snapshot_after_each_command:
            self._snapshot(description=f"after: {command.strip().splitlines()[0][:120] if command.strip() else ''}")
        self._check_finished(output)
        return output

    def _snapshot(self, name: Optional[str] = None, description: Optional[str] = None) -> Optional[str]:
        try:
            h = self.sandbox.snapshot(name=name, description=description)
        except PlanarianError as e:
            self.logger.warning(f"planarian: no statepoint after this step: {e}")
            return None
        self.statepoints.append(h.id)
        self._pending = h
        return h.id

    def _settle(self) -> None:
        """Waits for the last background statepoint (the ledger and a rollback need it committed)."""
        h, self._pending = self._pending, None
        if h is not None:
            try:
                h.result()
            except PlanarianError as e:
                self.logger.warning(f"planarian: statepoint {h.id} was not committed: {e}")

    def _statepoint(self, rest: str) -> Dict[str, Any]:
        """One command of the in-band channel."""
        try:
            args = shlex.split(rest)
        except ValueError as e:
            return _answer(f"{CHANNEL}: {e}\n{HELP}", 2)
        verb, args = (args[0], args[1:]) if args else ("", [])
        self._settle()
        try:
            if verb == "ledger":
                return _answer(str(self.sandbox.ledger(text=True, max_chars=self.config.ledger_max_chars)))
            if verb == "save" and args:
                sp = self.sandbox.snapshot(name=args[0], description=" ".join(args[1:]) or None, wait=True).id
                self.statepoints.append(sp)
                return _answer(f"Saved statepoint {sp} \"{args[0]}\".\n")
            if verb == "note" and len(args) >= 3:
                self.sandbox.append_outcome(args[0], " ".join(args[2:]), args[1], by="agent")
                return _answer(f"Noted on {args[0]}.\n")
            if verb == "rollback" and len(args) >= 2:
                ctx = self.sandbox.rollback(args[0], reason=" ".join(args[1:]))
                return _answer(ctx.text)
        except (PlanarianError, ValueError) as e:
            return _answer(f"planarian: {e}\n", 1)
        return _answer(HELP + "\n", 2)

    def _check_finished(self, output: Dict[str, Any]) -> None:
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}})

    def cleanup(self) -> None:
        if getattr(self, "sandbox", None) is not None:
            try:
                self.sandbox.rm()
            except PlanarianError:
                pass
            self.sandbox = None  # type: ignore[assignment]

    def __del__(self) -> None:
        self.cleanup()


def _answer(text: str, code: int = 0) -> Dict[str, Any]:
    return {"output": text, "returncode": code, "exception_info": ""}


def _run_args(args: List[str]) -> Dict[str, Any]:
    """`["--network", "none"]` as Sandbox.run options."""
    out: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            key = a[2:]
            if "=" in key:
                k, v = key.split("=", 1)
                out[k.replace("-", "_")] = v
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[key.replace("-", "_")] = args[i + 1]
                i += 1
            else:
                out[key.replace("-", "_")] = True
        i += 1
    return out
